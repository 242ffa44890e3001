"""The command line of supervised fine-tuning (`alignrl train sft`): its flat config, and OpenRLHF's `train_sft` and
TRL's `SFTConfig` flag spellings read as its keys.

    alignrl train sft --config sft.yaml train_files=[data/train.jsonl] --output_dir models/sft --nproc 2
    alignrl train sft --pretrain Qwen/Qwen2.5-0.5B --dataset data/train.jsonl --input_key question \\
        --output_key answer --apply_chat_template --max_len 1024 --micro_train_batch_size 4 --save_path models/sft

The keys shared with `alignrl train rm|dpo` (engines, LoRA, checkpoints, evaluation, logging) are
`preference.configs.CommonConfig`'s, layered the same way: defaults < `--config` YAML < `key=value` < flags. Every
key is also taken as a flag, `--key VALUE` or `--key=VALUE` (a switch bare, or with true/false). Nothing here
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config import ConfigError, opt
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli
from alignrl.preference.configs import CommonConfig
from alignrl.preference.flag_names import (COMMON_NAMES, FALSE_WORDS, TRUE_WORDS, CommandFlags, flags_as_keys,
                                           their_names)
from alignrl.preference.notes import say
from alignrl.preference.their_defaults import TRL, spellings


@dataclass(frozen=True)
class SFTConfig(CommonConfig):
    train_files: list = opt([], "training rows (.jsonl/.json/.parquet), concatenated (OpenRLHF: --dataset)")
    eval_files: list = opt([], "held-out rows: their token-mean loss and perplexity before and after training; []: "
                               "none (OpenRLHF: --eval_dataset)")
    prompt_key: str = opt("prompt", "column of a prompt-completion row's prompt (OpenRLHF: --input_key; verl: "
                                    "data.prompt_key)")
    response_key: str = opt("completion", "column of its completion (OpenRLHF: --output_key; verl: "
                                          "data.response_key)")
    messages_key: str = opt("messages", "column of a conversational row's messages")
    text_key: str = opt("text", "column of a plain-text row (TRL: dataset_text_field)")
    apply_chat_template: bool = opt(False, "string prompt-completion rows too through the tokenizer's chat template: "
                                           "the prompt a user turn, the completion the assistant's reply (OpenRLHF's "
                                           "--apply_chat_template); false: as text, the completion closed by eos "
                                           "(TRL's way), or OpenRLHF's text with input_template. Rows of chat "
                                           "messages always go through the template")
    completion_only_loss: bool = opt(True, "prompt-completion rows: loss on the completion's tokens alone (TRL's "
                                           "default); false: on every token")
    assistant_only_loss: bool = opt(True, "conversational rows: loss on the assistant turns alone (OpenRLHF's "
                                          "--multiturn); false: on every token")
    batch_size: int = opt(8, "rows per device per micro-batch (OpenRLHF: --micro_train_batch_size)", ge=1)
    eval_batch_size: int = opt(16, "rows per device per evaluation forward", ge=1)
    max_length: int = opt(512, "tokens of a whole row; a longer one is cut at the end (OpenRLHF: --max_len)", ge=8)
    max_train_pairs: int = opt(0, "use only the first N training rows of all train_files together, in their order "
                                  "(OpenRLHF: --max_samples); 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out rows of all eval_files together; 0: all", ge=0)
    packing: bool = opt(False, "a micro-batch's rows packed into sequences of at most max_length tokens, position "
                               "ids restarting at each row and no padding; the same rows, loss and update as "
                               "padded (OpenRLHF: --packing_samples; TRL: padding_free, not its packing of "
                               "the whole dataset)")
    neftune_noise_alpha: float = opt(0.0, "NEFTune: uniform noise of scale alpha / sqrt(L * hidden size) on the "
                                          "input embeddings in training (L: the row's length); 0: off (TRL's "
                                          "neftune_noise_alpha; 5 is the paper's)", ge=0.0)
    learning_rate: float = opt(2e-5, "peak AdamW learning rate", gt=0.0)


# OpenRLHF's train_sft and TRL's SFTConfig/ScriptArguments names of sft's own keys, beside flag_names.COMMON_NAMES
SFT_NAMES = {
    "dataset": "train_files", "dataset_name": "train_files", "eval_dataset": "eval_files", "input_key": "prompt_key",
    "output_key": "response_key", "max_seq_length": "max_length", "dataset_text_field": "text_key",
}
FLAG_NAMES = {**COMMON_NAMES, **SFT_NAMES}
# `--multiturn` trains the assistant turns of the conversation that `--input_key` then names (OpenRLHF's reading)
SFT_SWITCHES = {"pretrain_mode": ("completion_only_loss", "false"), "multiturn": ("assistant_only_loss", "true")}
SFT_LEFT_OUT = {"dataset_probs": "files are concatenated; per-file sampling probabilities are left out"}
# OpenRLHF's --packing_samples and TRL's --packing and --padding_free switch the `packing` key (read before the
# common table, which takes the first two as switches of no effect for the other offline commands)
PACKING_FLAGS = ("packing", "packing_samples", "padding_free")
# TRL's --packing packs the whole dataset into sequences of max_length tokens; ours packs each micro-batch's rows
TRL_PACKING_NOTE = ("note: --packing packs each micro-batch's rows among themselves (TRL's padding_free, OpenRLHF's "
                    "--packing_samples), not the whole dataset into sequences of max_length tokens as TRL's packing "
                    "does: the rows per step and the step count follow per_device_train_batch_size, as without "
                    "packing, not TRL's packed sequences")


def sft_flags(argv: list[str]) -> CommandFlags:
    """sft's flag table for this line: `--input_key` names the plain text with `--pretrain_mode` (OpenRLHF trains
    its column as text then) and the messages with `--multiturn`."""
    pretrain, multiturn = _switched_on(argv, "pretrain_mode"), _switched_on(argv, "multiturn")
    if pretrain and multiturn:
        raise ConfigError("--pretrain_mode with --multiturn: --input_key names either plain text or a conversation; "
                          "give one of the two")
    names = dict(SFT_NAMES)
    if pretrain or multiturn:
        names["input_key"] = "text_key" if pretrain else "messages_key"
    return CommandFlags(names, SFT_SWITCHES, SFT_LEFT_OUT)


def packing_switches(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the line without `--packing`/`--packing_samples`/`--padding_free`, their `packing=` overrides): the
    overrides go after all the others, so that the flag wins over a `key=value` override, as every flag does."""
    rest, overrides, i = [], [], 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        flag, eq, value = word.partition("=")
        if not flag.startswith("--") or flag[2:] not in PACKING_FLAGS:
            rest.append(word)
            i += 1
            continue
        taken = not eq and nxt is not None and nxt.lower() in TRUE_WORDS + FALSE_WORDS
        given = (value if eq else nxt if taken else "true").lower()
        if given not in TRUE_WORDS + FALSE_WORDS:
            raise ConfigError(f"{word}: {flag} takes true or false, or nothing (true)")
        overrides.append(f"packing={'true' if given in TRUE_WORDS else 'false'}")
        i += 2 if taken else 1
    return rest, overrides


def _switched_on(argv: list[str], name: str) -> bool:
    """Whether the line turns switch `--name` on: bare, `--name=WORD` or `--name WORD` (the last one wins)."""
    on = False
    for i, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag == f"--{name}":
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else ""
            given = value.lower() if eq else nxt if nxt in TRUE_WORDS + FALSE_WORDS else "true"
            on = given in TRUE_WORDS
    return on


def _say_trl_packing(argv: list[str], rest: list[str]) -> None:
    """One note when a line in TRL's spelling switches packing on by `--packing`, whose step count differs in TRL."""
    if TRL in spellings(their_names(rest, sft_flags(rest))) and _switched_on(argv, "packing"):
        say(TRL_PACKING_NOTE)


def parse_sft(argv: list[str]) -> SFTConfig:
    p = make_parser("alignrl train sft", "Supervised fine-tuning of a causal LM on conversations, prompt-completion "
                                         "rows or plain text.")
    p.epilog = ("Every key is also a flag (--key VALUE, a switch bare or with true/false). OpenRLHF's and TRL's "
                "names: " + ", ".join(f"--{k} -> {v}" for k, v in FLAG_NAMES.items() if k != v) +
                "; --multiturn: --input_key names the messages, assistant turns trained (--output_key's reply "
                "appended as the last turn); --pretrain_mode: --input_key names plain text, every token trained; "
                "--lora_rank N > 0 switches LoRA on; --packing_samples, --packing, --padding_free: packing=true. "
                "Keys and data layouts: docs/sft.md")
    rest, packing = packing_switches(argv)
    _say_trl_packing(argv, rest)
    args = p.parse_intermixed_args(flags_as_keys(rest, SFTConfig, sft_flags(rest)) + packing)
    cfg = load_flat_config(SFTConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError("train_files is empty: give the training rows, e.g. train_files=[data/train.jsonl] "
                          "(OpenRLHF: --dataset FILE)")
    return cfg


COMMANDS["sft"] = (parse_sft, "alignrl.preference.sft", "train_sft")


def sft_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "sft")
