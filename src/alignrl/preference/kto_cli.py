"""The command line of KTO (`alignrl train kto`): its flat config, and OpenRLHF's `train_kto` and TRL's `KTOConfig`
flag spellings read as its keys.

    alignrl train kto train_files=[data/feedback.jsonl] eval_files=[data/test.jsonl] --output_dir models/kto --nproc 2
    alignrl train kto --pretrain models/sft --dataset data/feedback.jsonl --input_key question --output_key answer \\
        --label_key thumbs_up --beta 0.1 --desirable_loss_weight 1.33 --max_len 1024 --save_path models/kto

The keys shared with `alignrl train rm|dpo|sft` are `preference.configs.CommonConfig`'s, layered the same way:
defaults < `--config` YAML < `key=value` < flags. Every key is also taken as a flag, `--key VALUE` or `--key=VALUE` (a
switch bare, or with true/false). The defaults of beta, the weights, loss_type, learning_rate (1e-6) and max_length
(1024) are TRL's KTOConfig's. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from alignrl.config import ConfigError, opt
from alignrl.core.kto import KTO_LOSS_TYPES
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli, say
from alignrl.preference.configs import CommonConfig


@dataclass(frozen=True)
class KTOConfig(CommonConfig):
    train_files: list = opt([], "training rows (.jsonl/.json/.parquet), concatenated (OpenRLHF: --dataset)")
    eval_files: list = opt([], "held-out rows: their implicit rewards and KL estimate before and after training; "
                               "[]: none (OpenRLHF: --eval_dataset)")
    prompt_key: str = opt("prompt", "column of a row's prompt (OpenRLHF: --input_key)")
    completion_key: str = opt("completion", "column of an unpaired row's completion (OpenRLHF: --output_key)")
    label_key: str = opt("label", "column of an unpaired row's label: true (or 1) when the completion is desirable")
    chosen_key: str = opt("chosen", "column of a paired row's chosen completion (trained as a desirable row)")
    rejected_key: str = opt("rejected", "column of a paired row's rejected completion (an undesirable row)")
    apply_chat_template: bool | None = opt(None, "render prompts with the tokenizer's chat template; null (default): "
                                                 "when it has one")
    ref_model_path: str | None = opt(None, "frozen reference model; default: the initial weights of model_path (with "
                                           "LoRA: the policy with its adapters off)")
    loss_type: str = opt("kto", "kto, or apo_zero_unpaired (no KL reference point)", choices=KTO_LOSS_TYPES)
    beta: float = opt(0.1, "β: scale of the implicit reward β·(log π - log π_ref)", gt=0.0)
    desirable_weight: float = opt(1.0, "weight of a desirable row's loss (OpenRLHF: --desirable_loss_weight)", ge=0.0)
    undesirable_weight: float = opt(1.0, "weight of an undesirable row's loss (OpenRLHF: --undesirable_loss_weight)",
                                    ge=0.0)
    batch_size: int = opt(8, "rows per device per micro-batch; kto pairs each with the next one's completion for "
                             "its KL estimate (OpenRLHF: --micro_train_batch_size)", ge=1)
    eval_batch_size: int = opt(16, "rows per device per evaluation forward", ge=1)
    max_length: int = opt(1024, "tokens of prompt + completion; a longer row keeps at most half for the prompt, from "
                                "its end (OpenRLHF: --max_len)", ge=8)
    max_train_pairs: int = opt(0, "use only the first N training lines of each file; 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out lines of each file; 0: all", ge=0)
    learning_rate: float = opt(1e-6, "peak AdamW learning rate (TRL's KTO default)", gt=0.0)


# OpenRLHF's train_kto and TRL's KTOConfig/ScriptArguments names of our keys (a name already ours needs no entry)
FLAG_NAMES = {
    "pretrain": "model_path", "model_name_or_path": "model_path", "dataset": "train_files",
    "dataset_name": "train_files", "eval_dataset": "eval_files", "input_key": "prompt_key",
    "output_key": "completion_key", "save_path": "output_dir", "max_len": "max_length", "max_epochs": "epochs",
    "num_train_epochs": "epochs", "micro_train_batch_size": "batch_size", "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size", "micro_eval_batch_size": "eval_batch_size",
    "max_samples": "max_train_pairs", "l2": "weight_decay", "max_norm": "grad_clip", "max_grad_norm": "grad_clip",
    "lr_warmup_ratio": "warmup_ratio", "lr_scheduler_type": "lr_scheduler", "logging_steps": "log_every",
    "target_modules": "lora_target_modules", "lora_r": "lora_rank", "use_peft": "use_lora",
    "desirable_loss_weight": "desirable_weight", "undesirable_loss_weight": "undesirable_weight",
}
LEFT_OUT = {
    "train_batch_size": "give the global batch as gradient_accumulation_steps = train_batch_size / "
                        "(micro_train_batch_size × ranks)",
    "input_template": "prompts are rendered with the chat template (apply_chat_template) or taken as they are",
    "precompute_ref_log_probs": "the reference is run beside the policy at every step",
    "sync_ref_model": "the reference stays fixed",
    "load_checkpoint": "resume with resume_from=<output_dir>.checkpoints/step_N",
    "ckpt_path": "checkpoints go to <output_dir>.checkpoints (save_steps), resumed with resume_from",
}
IGNORED = ("flash_attn", "adam_offload", "disable_fast_tokenizer", "use_tensorboard", "ref_offload")
OWN_FLAGS = ("config", "logging_dir", "nproc", "help")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")


def _switch(word: str, name: str, value: str | None, nxt: str | None) -> tuple[bool, int]:
    """(on or off, words taken) of a switch: bare, `--name=true|false`, or `--name true|false` (TRL's spelling)."""
    taken = value is None and nxt is not None and nxt.lower() in TRUE_WORDS + FALSE_WORDS
    given = value if value is not None else (nxt if taken else "true")
    if given.lower() not in TRUE_WORDS + FALSE_WORDS:
        raise ConfigError(f"{word}: --{name} takes true or false, or nothing (true)")
    return given.lower() in TRUE_WORDS, 2 if taken else 1


def flags_as_keys(argv: list[str]) -> list[str]:
    """`--name VALUE`, `--name=VALUE` and bare switches of OpenRLHF's, TRL's or our own key names as `key=value`
    overrides; `--lora_rank N` (N > 0) switches LoRA on unless use_lora is given (OpenRLHF has no switch of its own)."""
    keys = {f.name for f in fields(KTOConfig)}
    switches = {f.name for f in fields(KTOConfig) if f.type in (bool, "bool", "bool | None")}
    lora_given = any(a.startswith(("--use_lora", "use_lora=", "--use_peft")) for a in argv)
    out, i = [], 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        key = FLAG_NAMES.get(name, name)
        if name in LEFT_OUT:
            raise ConfigError(f"--{name}: left out; {LEFT_OUT[name]}")
        if name in IGNORED or name == "bf16" or (key in switches and name not in OWN_FLAGS):
            on, taken = _switch(word, name, value if eq else None, nxt)
            if name in IGNORED:
                say(f"note: --{name} changes nothing here and is ignored")
            else:
                out.append(f"{key}={str(on).lower()}")
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
            if key in ("train_files", "eval_files") and not value.startswith("["):  # OpenRLHF's a.jsonl,b.jsonl
                value = json.dumps([v for v in value.split(",") if v])
            out.append(f"{key}={value}")
            if name == "lora_rank" and not lora_given and value.strip().isdigit() and int(value) > 0:
                out.append("use_lora=true")
        else:  # our own flags, overrides, and what argparse names as unknown
            out.append(word)
            i += 1
    return out


def parse_kto(argv: list[str]) -> KTOConfig:
    p = make_parser("alignrl train kto", "KTO on unpaired feedback: prompts with one completion each, labelled "
                                         "desirable or not (paired rows are unpaired into two).")
    p.epilog = ("Every key is also a flag (--key VALUE, a switch bare or with true/false). OpenRLHF's and TRL's "
                "names: " + ", ".join(f"--{k} -> {v}" for k, v in FLAG_NAMES.items()) +
                "; --lora_rank N > 0 switches LoRA on. Keys and data layouts: docs/kto.md")
    args = p.parse_intermixed_args(flags_as_keys(argv))
    cfg = load_flat_config(KTOConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError("train_files is empty: give the training rows, e.g. train_files=[data/train.jsonl] "
                          "(OpenRLHF: --dataset FILE)")
    if cfg.loss_type == "kto" and cfg.batch_size < 2:  # TRL refuses it too
        raise ConfigError("loss_type=kto with batch_size=1: a row's mismatched completion would be its own, so the KL "
                          "estimate would equal its implicit reward; use batch_size >= 2")
    if cfg.desirable_weight == 0 and cfg.undesirable_weight == 0:
        raise ConfigError("desirable_weight and undesirable_weight are both 0: nothing would train")
    return cfg


COMMANDS["kto"] = (parse_kto, "alignrl.preference.kto", "train_kto")


def kto_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "kto")
