"""The command line of supervised fine-tuning (`alignrl train sft`): its flat config, and OpenRLHF's `train_sft` and
TRL's `SFTConfig` flag spellings read as its keys.

    alignrl train sft --config sft.yaml train_files=[data/train.jsonl] --output_dir models/sft --nproc 2
    alignrl train sft --pretrain Qwen/Qwen2.5-0.5B --dataset data/train.jsonl --input_key question \\
        --output_key answer --apply_chat_template --max_len 1024 --micro_train_batch_size 4 --save_path models/sft

The keys shared with `alignrl train rm|dpo` (engines, LoRA, checkpoints, evaluation, logging) are
`preference.configs.CommonConfig`'s, layered the same way: defaults < `--config` YAML < `key=value` < flags. Every key is
also taken as a flag, `--key VALUE` or `--key=VALUE` (a switch bare, or with true/false). Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from alignrl.config import ConfigError, opt
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli, say
from alignrl.preference.configs import CommonConfig


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
    apply_chat_template: bool | None = opt(None, "render prompts and conversations with the tokenizer's chat "
                                                 "template; null (default): when it has one")
    completion_only_loss: bool = opt(True, "prompt-completion rows: loss on the completion's tokens alone (TRL's "
                                           "default); false: on every token")
    assistant_only_loss: bool = opt(True, "conversational rows: loss on the assistant turns alone (OpenRLHF's "
                                          "--multiturn); false: on every token")
    batch_size: int = opt(8, "rows per device per micro-batch (OpenRLHF: --micro_train_batch_size)", ge=1)
    eval_batch_size: int = opt(16, "rows per device per evaluation forward", ge=1)
    max_length: int = opt(512, "tokens of a whole row; a longer one is cut at the end (OpenRLHF: --max_len)", ge=8)
    max_train_pairs: int = opt(0, "use only the first N training rows of each file; 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out rows of each file; 0: all", ge=0)
    learning_rate: float = opt(2e-5, "peak AdamW learning rate", gt=0.0)


# OpenRLHF's train_sft and TRL's SFTConfig/ScriptArguments names of our keys (a name already ours needs no entry)
FLAG_NAMES = {
    "pretrain": "model_path", "model_name_or_path": "model_path", "dataset": "train_files",
    "dataset_name": "train_files", "eval_dataset": "eval_files", "input_key": "prompt_key",
    "output_key": "response_key", "save_path": "output_dir", "max_len": "max_length", "max_seq_length": "max_length",
    "max_epochs": "epochs", "num_train_epochs": "epochs", "micro_train_batch_size": "batch_size",
    "per_device_train_batch_size": "batch_size", "per_device_eval_batch_size": "eval_batch_size",
    "micro_eval_batch_size": "eval_batch_size", "max_samples": "max_train_pairs", "l2": "weight_decay",
    "max_norm": "grad_clip", "max_grad_norm": "grad_clip", "lr_warmup_ratio": "warmup_ratio",
    "lr_scheduler_type": "lr_scheduler", "logging_steps": "log_every", "target_modules": "lora_target_modules",
    "lora_r": "lora_rank", "use_peft": "use_lora",
    "dataset_text_field": "text_key",
}
# switches of theirs that set one of our keys to a value
SWITCHES = {"pretrain_mode": ("completion_only_loss", "false"), "bf16": ("bf16", "true")}
LEFT_OUT = {
    "train_batch_size": "give the global batch as gradient_accumulation_steps = train_batch_size / "
                        "(micro_train_batch_size × ranks)",
    "packing_samples": "packing is left out: rows train padded",
    "packing": "packing is left out: rows train padded",
    "neftune_noise_alpha": "NEFTune is left out",
    "load_checkpoint": "resume with resume_from=<output_dir>.checkpoints/step_N",
    "ckpt_path": "checkpoints go to <output_dir>.checkpoints (save_steps), resumed with resume_from",
}
IGNORED = ("flash_attn", "adam_offload", "disable_fast_tokenizer", "use_tensorboard")  # no effect on what trains
OWN_FLAGS = ("config", "logging_dir", "nproc", "help")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")


def _switch_keys() -> set[str]:
    return {f.name for f in fields(SFTConfig) if f.type in (bool, "bool", "bool | None")}


def _list_value(value: str) -> str:
    """OpenRLHF's comma-separated file list (`--dataset a.jsonl,b.jsonl`) as a list override; `[...]` as given."""
    if value.startswith("["):
        return value
    return json.dumps([v for v in value.split(",") if v])


def _switch(word: str, name: str, value: str | None, nxt: str | None) -> tuple[bool, int]:
    """(on or off, words taken) of a switch: bare, `--name=true|false`, or `--name true|false` (TRL's spelling)."""
    taken = value is None and nxt is not None and nxt.lower() in TRUE_WORDS + FALSE_WORDS
    given = value if value is not None else (nxt if taken else "true")
    if given.lower() not in TRUE_WORDS + FALSE_WORDS:
        raise ConfigError(f"{word}: --{name} takes true or false, or nothing (true)")
    return given.lower() in TRUE_WORDS, 2 if taken else 1


def flags_as_keys(argv: list[str]) -> list[str]:
    """`--name VALUE`, `--name=VALUE` and bare switches of OpenRLHF's, TRL's or our own key names as `key=value`
    overrides. `--multiturn` makes `--input_key` name the conversation column (OpenRLHF's reading), and
    `--lora_rank N` (N > 0) switches LoRA on unless use_lora is given, as OpenRLHF has no switch of its own."""
    keys, switches = {f.name for f in fields(SFTConfig)}, _switch_keys()
    multiturn = any(a.lower() in ("--multiturn", "--multiturn=true", "--multiturn=1") for a in argv)
    lora_given = any(a.startswith(("--use_lora", "use_lora=", "--use_peft")) for a in argv)
    out, i = [], 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        key = "messages_key" if multiturn and name == "input_key" else FLAG_NAMES.get(name, name)
        if name in LEFT_OUT:
            raise ConfigError(f"--{name}: {LEFT_OUT[name]}")
        if name in IGNORED or name == "multiturn":
            on, taken = _switch(word, name, value if eq else None, nxt)
            if name in IGNORED:
                say(f"note: --{name} changes nothing here and is ignored")
            else:
                out.append(f"assistant_only_loss={str(on).lower()}")
            i += taken
        elif name in SWITCHES or (key in switches and name not in OWN_FLAGS):
            on, taken = _switch(word, name, value if eq else None, nxt)
            target, set_to = SWITCHES.get(name, (key, "true"))
            out.append(f"{target}={set_to if on else ('false' if set_to == 'true' else 'true')}")
            i += taken
        elif name and name not in OWN_FLAGS and key in keys:
            if not eq and (nxt is None or nxt.startswith("--")):
                raise ConfigError(f"--{name} needs a value (--{name} VALUE)")
            value, i = (value, i + 1) if eq else (nxt, i + 2)
            if key == "output_dir":
                out += ["--output_dir", value]
                continue
            if key in ("save_steps", "eval_steps") and value.strip() == "-1":  # OpenRLHF's "never"; ours is 0
                value = "0"
            out.append(f"{key}={_list_value(value) if key in ('train_files', 'eval_files') else value}")
            if name == "lora_rank" and not lora_given and value.strip().isdigit() and int(value) > 0:
                out.append("use_lora=true")
        else:  # our own flags, overrides, and what argparse names as unknown
            out.append(word)
            i += 1
    return out


def parse_sft(argv: list[str]) -> SFTConfig:
    p = make_parser("alignrl train sft", "Supervised fine-tuning of a causal LM on conversations, prompt-completion "
                                         "rows or plain text.")
    p.epilog = ("Every key is also a flag (--key VALUE, a switch bare or with true/false). OpenRLHF's and TRL's "
                "names: " + ", ".join(f"--{k} -> {v}" for k, v in FLAG_NAMES.items() if k != v) +
                "; --multiturn: --input_key names the messages, assistant turns trained; --pretrain_mode: every "
                "token trained; --lora_rank N > 0 switches LoRA on. Keys and data layouts: docs/sft.md")
    args = p.parse_intermixed_args(flags_as_keys(argv))
    cfg = load_flat_config(SFTConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError("train_files is empty: give the training rows, e.g. train_files=[data/train.jsonl] "
                          "(OpenRLHF: --dataset FILE)")
    return cfg


COMMANDS["sft"] = (parse_sft, "alignrl.preference.sft", "train_sft")


def sft_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "sft")
