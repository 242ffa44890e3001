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

from dataclasses import dataclass

from alignrl.config import ConfigError, opt
from alignrl.core.kto import KTO_LOSS_TYPES
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli
from alignrl.preference.flag_names import CommandFlags, dataset_hint, epilog, flags_as_keys
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
    apply_chat_template: bool = opt(False, "string rows through the tokenizer's chat template too: the prompt a user "
                                           "turn, the completion the assistant's reply (OpenRLHF's "
                                           "--apply_chat_template); false: as text (TRL's way), or OpenRLHF's text "
                                           "with input_template. Rows of chat messages always go through it")
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
    max_train_pairs: int = opt(0, "use only the first N training lines of all train_files together, in their "
                                  "order (OpenRLHF's --max_samples); 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out lines of all eval_files together; 0: all", ge=0)
    learning_rate: float = opt(1e-6, "peak AdamW learning rate (TRL's KTO default)", gt=0.0)


# OpenRLHF's train_kto and TRL's KTOConfig/ScriptArguments names of kto's own keys, beside flag_names.COMMON_NAMES
KTO_FLAGS = CommandFlags(
    names={"dataset": "train_files", "dataset_name": "train_files", "eval_dataset": "eval_files",
           "input_key": "prompt_key", "output_key": "completion_key",
           "desirable_loss_weight": "desirable_weight", "undesirable_loss_weight": "undesirable_weight"},
    left_out={"precompute_ref_log_probs": "the reference is run beside the policy at every step",
              "sync_ref_model": "the reference stays fixed"},
    ignored=("ref_offload",))


def parse_kto(argv: list[str]) -> KTOConfig:
    p = make_parser("alignrl train kto", "KTO on unpaired feedback: prompts with one completion each, labelled "
                                         "desirable or not (paired rows are unpaired into two).")
    p.epilog = epilog(KTO_FLAGS) + " Keys and data layouts: docs/kto.md"
    args = p.parse_intermixed_args(flags_as_keys(argv, KTOConfig, KTO_FLAGS))
    cfg = load_flat_config(KTOConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError(f"train_files is empty: give the training rows, {dataset_hint(argv, KTO_FLAGS)}")
    if cfg.loss_type == "kto" and cfg.batch_size < 2:  # TRL refuses it too
        raise ConfigError("loss_type=kto with batch_size=1: a row's mismatched completion would be its own, so the KL "
                          "estimate would equal its implicit reward; use batch_size >= 2")
    if cfg.desirable_weight == 0 and cfg.undesirable_weight == 0:
        raise ConfigError("desirable_weight and undesirable_weight are both 0: nothing would train")
    return cfg


COMMANDS["kto"] = (parse_kto, "alignrl.preference.kto", "train_kto")


def kto_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "kto")
