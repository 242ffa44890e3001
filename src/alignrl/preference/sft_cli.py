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
from alignrl.preference.flag_names import COMMON_NAMES, CommandFlags, dataset_hint, flags_as_keys, read_switch
from alignrl.preference.verl_sft_keys import in_our_words, launch_words


STRATEGIES = ("micro_batch", "bfd", "bfd_split", "wrapped")
OLD_STRATEGY_NAMES = {"bfd-requeue": "bfd_split"}  # TRL < 1.0's name of bfd_split


@dataclass(frozen=True)
class SFTConfig(CommonConfig):
    train_files: list = opt([], "training rows (.jsonl/.json/.parquet), concatenated (OpenRLHF: --dataset)")
    eval_files: list = opt([], "held-out rows: their token-mean loss and perplexity before and after training; []: "
                               "none (OpenRLHF: --eval_dataset)")
    prompt_key: str = opt("prompt", "column of a prompt-completion row's prompt (OpenRLHF: --input_key; verl: "
                                    "data.prompt_key)")
    response_key: str = opt("completion", "column of its completion (OpenRLHF: --output_key; verl: "
                                          "data.response_key)")
    messages_key: str = opt("messages", "column of a conversational row's messages (verl: data.messages_key)")
    text_key: str = opt("text", "column of a plain-text row (TRL: dataset_text_field)")
    eos_token: str = opt("", "the token that closes each completion and text row, one of the tokenizer's (TRL's "
                             "--eos_token, e.g. '<|im_end|>' for a base model's chat rows); empty: the tokenizer's "
                             "own eos, which the saved tokenizer keeps otherwise")
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
    max_length: int = opt(512, "tokens of a whole row; a longer one is cut as truncation says (OpenRLHF: --max_len; "
                               "verl: data.max_length)", ge=8)
    truncation: str = opt("right", "a row longer than max_length: right: cut at its end (OpenRLHF's, TRL's); left: "
                                   "its first tokens dropped, its end kept; error: the run stops, naming how many "
                                   "rows are longer (verl's data.truncation, its default error)",
                          choices=("right", "left", "error"))
    image_key: str = opt("images", "column of a row's images, for a vision-language model_path (verl: "
                                   "data.image_key; TRL's one-image `image` column is read too)")
    tools_key: str = opt("tools", "column of a conversational row's tool schemas (a JSON string or a list), given "
                                  "to its chat template; its assistant turns' tool_calls are trained, tool turns not "
                                  "(verl: data.multiturn.tools_key; TRL's tools column)")
    enable_thinking_key: str = opt("enable_thinking", "column of a row's enable_thinking for its chat template, over "
                                                      "chat_template_kwargs (verl: data.enable_thinking_key)")
    prompt_dict_keys: list = opt([], "keys taken in turn inside prompt_key's value, a dict, to reach the prompt "
                                     "(verl: data.prompt_dict_keys, e.g. [question] with prompt_key=extra_info)")
    response_dict_keys: list = opt([], "keys taken in turn inside response_key's value to reach the response "
                                       "(verl: data.response_dict_keys)")
    min_pixels: int = opt(0, "rows with images: each image resized to at least this many pixels (bounds its "
                             "tokens); 0: the processor's own bound", ge=0)
    max_pixels: int = opt(0, "rows with images: each image resized to at most this many pixels; 0: the "
                             "processor's own bound", ge=0)
    max_train_pairs: int = opt(0, "use only the first N training rows of all train_files together, in their order "
                                  "(OpenRLHF: --max_samples); 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out rows of all eval_files together; 0: all", ge=0)
    packing: bool = opt(False, "pack rows into sequences of at most max_length tokens, as packing_strategy says "
                               "(OpenRLHF: --packing_samples; TRL: --packing, --padding_free)")
    packing_strategy: str = opt("micro_batch", "with packing: micro_batch: each micro-batch's rows, position ids "
                                               "restarting at each row and no padding, the same rows, loss and "
                                               "update as padded (OpenRLHF's --packing_samples, TRL's "
                                               "padding_free); bfd: the whole training set before batching, best "
                                               "fit decreasing, rows kept apart, a longer row cut at max_length "
                                               "(TRL's packing, the default of a line in TRL's spelling); bfd_split: "
                                               "as bfd, a longer row cut into max_length pieces packed as rows of "
                                               "their own, no token lost (TRL's bfd_split; its older name "
                                               "bfd-requeue is taken too); wrapped: the whole training set end to "
                                               "end, cut every max_length tokens, attention crossing rows. With bfd, "
                                               "bfd_split and wrapped, batch_size counts packed rows",
                                choices=STRATEGIES)
    eval_packing: bool | None = opt(None, "whether the held-out rows are packed as packing_strategy packs the "
                                          "training rows (bfd, bfd_split, wrapped: eval_batch_size then counting "
                                          "packed rows); null: as "
                                          "packing (TRL's eval_packing)")
    neftune_noise_alpha: float = opt(0.0, "NEFTune: uniform noise of scale alpha / sqrt(L * hidden size) on the "
                                          "input embeddings in training (L: the row's length); 0: off (TRL's "
                                          "neftune_noise_alpha; 5 is the paper's)", ge=0.0)
    learning_rate: float = opt(2e-5, "peak AdamW learning rate", gt=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing_strategy in OLD_STRATEGY_NAMES:  # TRL still takes its old name, for the new one
            object.__setattr__(self, "packing_strategy", OLD_STRATEGY_NAMES[self.packing_strategy])


def packs_dataset(cfg: SFTConfig) -> bool:
    """Whether the whole training set is packed before batching (TRL's packing=True), not each micro-batch."""
    return cfg.packing and cfg.packing_strategy != "micro_batch"


def eval_packs(cfg: SFTConfig) -> bool:
    """Whether the held-out rows are packed (TRL's eval_packing; unset, as the training rows)."""
    return cfg.packing if cfg.eval_packing is None else cfg.eval_packing


# OpenRLHF's train_sft and TRL's SFTConfig/ScriptArguments names of sft's own keys, beside flag_names.COMMON_NAMES
SFT_NAMES = {
    "dataset": "train_files", "dataset_name": "train_files", "eval_dataset": "eval_files", "input_key": "prompt_key",
    "output_key": "response_key", "max_seq_length": "max_length", "dataset_text_field": "text_key",
}
FLAG_NAMES = {**COMMON_NAMES, **SFT_NAMES}
# `--multiturn` trains the assistant turns of the conversation that `--input_key` then names (OpenRLHF's reading)
SFT_SWITCHES = {"pretrain_mode": ("completion_only_loss", "false"), "multiturn": ("assistant_only_loss", "true")}
SFT_LEFT_OUT: dict[str, str] = {}
# OpenRLHF's --packing_samples and TRL's --packing and --padding_free switch the `packing` key (read before the
# common table, which takes the first two as switches of no effect for the other offline commands). --packing's
# packing_strategy is the line's: TRL's bfd for a line in TRL's spelling (their_defaults), micro_batch otherwise;
# the other two pack each micro-batch (OpenRLHF's packing_samples, TRL's padding_free without packing)
PACKING_FLAGS = ("packing", "packing_samples", "padding_free")


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
    """(the line without `--packing`/`--packing_samples`/`--padding_free`, their overrides: `packing=`, and
    `packing_strategy=micro_batch` when one of the other two turns packing on and `--packing` does not). The
    overrides go after the line's own `key=value` words, so that the flag wins over them, as every flag does."""
    rest, overrides, switched, i = [], [], {}, 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        flag, eq, value = word.partition("=")
        if not flag.startswith("--") or flag[2:] not in PACKING_FLAGS:
            rest.append(word)
            i += 1
            continue
        on, taken = read_switch(word, flag[2:], value if eq else None, nxt)
        overrides.append(f"packing={'true' if on else 'false'}")
        switched[flag[2:]] = on
        i += taken
    chosen = any(w.startswith(("packing_strategy=", "--packing_strategy")) for w in rest)
    if any(switched.values()) and not switched.get("packing") and not chosen:  # a strategy the line names wins
        overrides.append("packing_strategy=micro_batch")
    return rest, overrides


def _switched_on(argv: list[str], name: str) -> bool:
    """Whether the line turns switch `--name` on: bare, `--name=WORD` or `--name WORD` (the last one wins)."""
    on = False
    for i, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag == f"--{name}":
            on, _ = read_switch(word, name, value if eq else None, argv[i + 1] if i + 1 < len(argv) else None)
    return on


def parse_sft(argv: list[str]) -> SFTConfig:
    p = make_parser("alignrl train sft", "Supervised fine-tuning of a causal LM on conversations, prompt-completion "
                                         "rows or plain text.")
    p.epilog = ("Every key is also a flag (--key VALUE, a switch bare or with true/false). OpenRLHF's and TRL's "
                "names: " + ", ".join(f"--{k} -> {v}" for k, v in FLAG_NAMES.items() if k != v) +
                "; --multiturn: --input_key names the messages, assistant turns trained (--output_key's reply "
                "appended as the last turn); --pretrain_mode: --input_key names plain text, every token trained; "
                "--lora_rank N > 0 switches LoRA on; --packing_samples, --padding_free: packing=true "
                "packing_strategy=micro_batch; --packing: packing=true (packing_strategy=bfd in a line of TRL's "
                "spelling, as TRL's); --packing_strategy bfd-requeue: bfd_split; --eval_packing: the held-out "
                "rows packed too (unset: as --packing). verl's SFT keys (data.*, optim.*, model.*, trainer.*, "
                "engine=) are read as these keys, with verl's defaults. Keys and data layouts: docs/sft.md")
    rest, packing = packing_switches(in_our_words(argv, SFTConfig))  # verl's keys as ours first (verl_sft_keys)
    # the packing overrides join the line's own words, so that a line of TRL's spelling that packs takes TRL's bfd
    args = p.parse_intermixed_args(flags_as_keys(rest + packing, SFTConfig, sft_flags(rest)))
    cfg = load_flat_config(SFTConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError(f"train_files is empty: give the training rows, {dataset_hint(rest, sft_flags(rest))}")
    return cfg


COMMANDS["sft"] = (parse_sft, "alignrl.preference.sft", "train_sft")


def sft_main(argv: list[str] | None = None) -> int:
    import sys

    from alignrl.errors import UserError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # a verl line's trainer.nnodes × n_gpus_per_node ranks, as `--nproc` (verl_sft_keys.launch_words)
        argv = launch_words(argv)
    except UserError as e:
        print(f"alignrl: error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_cli(argv, "sft")
