"""The defaults of OpenRLHF's scripts (`train_rm`, `train_dpo`, `train_sft`, `train_kto`, `train_kd`, `train_prm`) and
of TRL's configs (`RewardConfig`, `DPOConfig`, `SFTConfig`, `KTOConfig`, `GKDConfig`, `PRMConfig` on transformers'
`TrainingArguments`), taken by an offline
command line written in their spelling: what such a line leaves unsaid trains as their script would, not as this
command's own defaults.

Which spelling a line is in is read from the flag names that only one of them has (`--pretrain`, `--max_len`,
`--micro_train_batch_size` are OpenRLHF's; `--model_name_or_path`, `--num_train_epochs`,
`--per_device_train_batch_size` TRL's); a name both have (`--logging_steps`) decides nothing, and a line naming
both takes only the defaults the two share. Of a table, a key is taken when this command has it, its value here
differs, and the line (its flags, `key=value` words, or its `--config` file) does not set it. What is taken is said
in one line at start, with what of theirs has no counterpart here. Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from typing import Any

from alignrl.preference.notes import say

OPENRLHF, TRL = "OpenRLHF", "TRL"
# their flag names (renamed to a key of ours, or a switch) by whose spelling they are; every renamed name of the
# offline commands' tables is in one of the three (a test holds it)
OPENRLHF_NAMES = frozenset({
    "pretrain", "save_path", "max_len", "max_epochs", "micro_train_batch_size", "micro_eval_batch_size",
    "max_samples", "l2", "max_norm", "lr_warmup_ratio", "target_modules", "dataset", "eval_dataset", "ref_pretrain",
    "ipo", "input_key", "output_key", "desirable_loss_weight", "undesirable_loss_weight", "pretrain_mode",
    "multiturn", "ckpt_path", "max_ckpt_num", "dataset_probs"})
TRL_NAMES = frozenset({
    "model_name_or_path", "num_train_epochs", "per_device_train_batch_size", "per_device_eval_batch_size",
    "max_grad_norm", "lr_scheduler_type", "use_peft", "lora_r", "dataset_name", "rpo_alpha", "cpo_alpha",
    "max_seq_length", "dataset_text_field", "resume_from_checkpoint", "use_bnb_nested_quant"})
SHARED_NAMES = frozenset({"logging_steps"})

# the keys that act only with LoRA: taken (and said) only when the line trains adapters
LORA_ONLY = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "bnb_4bit_use_double_quant",
             "bnb_4bit_quant_storage")
# sft's key that acts only with packing: taken (and said) only when the line packs (TRL's --packing: bfd)
PACKING_ONLY = ("packing_strategy",)

# OpenRLHF's train_*.py argparse defaults, in our keys (save_steps -1 "never" is our 0, eval_steps -1 "once per
# epoch" our eval_strategy=epoch; cosine_with_min_lr is our cosine with
# min_lr_ratio's floor; in the older scripts --bf16 unset trains in fp32, OPENRLHF_CURRENT_BF16 says the current
# ones'; --lora_rank 0 is no LoRA). Without --apply_chat_template their scripts train on text: the prompt formatted
# into --input_template (train_sft's and train_kto's default is 'User: {}\nAssistant: ', train_rm's and train_dpo's
# none: the prompt as it is, our '{}'), then the response.
_OPENRLHF_COMMON: dict[str, Any] = {
    "warmup_ratio": 0.03, "adam_betas": [0.9, 0.95], "lr_scheduler": "cosine", "min_lr_ratio": 0.1, "grad_clip": 1.0,
    "weight_decay": 0.0, "seed": 42, "epochs": 1, "batch_size": 8, "train_batch_size": 128, "log_every": 1,
    "bf16": "false", "zero_stage": 2, "gradient_checkpointing": False, "save_steps": 0, "eval_strategy": "epoch",
    "save_total_limit": 3,
    "use_lora": False, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": "all-linear"}
# OpenRLHF's current scripts (--param_dtype, --attn_implementation, --backend) have no --bf16: --param_dtype sets the
# dtype, bf16 unless asked otherwise
OPENRLHF_CURRENT_BF16 = "true"
OPENRLHF_DEFAULTS: dict[str, dict[str, Any]] = {
    "rm": {**_OPENRLHF_COMMON, "learning_rate": 9e-6, "batch_size": 1, "max_length": 512,
           "apply_chat_template": False, "input_template": "{}"},
    "dpo": {**_OPENRLHF_COMMON, "learning_rate": 1e-5, "max_length": 512, "beta": 0.1, "loss_type": "sigmoid",
            "label_smoothing": 0.0, "nll_loss_coef": 0.0, "apply_chat_template": False, "input_template": "{}"},
    "sft": {**_OPENRLHF_COMMON, "learning_rate": 5e-6, "max_length": 2048, "epochs": 2,
            "input_template": "User: {}\nAssistant: "},
    "kto": {**_OPENRLHF_COMMON, "learning_rate": 1e-5, "max_length": 2048, "beta": 0.01, "desirable_weight": 1.0,
            "undesirable_weight": 1.0, "input_template": "User: {}\nAssistant: "},
    # reward_tokens: train_prm's --reward_tokens is unset (None), its loss over the whole vocabulary
    "prm": {**_OPENRLHF_COMMON, "learning_rate": 1e-6, "max_length": 2048, "batch_size": 1, "label_key": "label",
            "reward_tokens": []}}
# train_kd is train_sft with one epoch (the same learning rate, 5e-6, and kd_coef, 0.4, as here)
OPENRLHF_DEFAULTS["kd"] = {**OPENRLHF_DEFAULTS["sft"], "epochs": 1}
# TRL's (1.x) configs: TrainingArguments' optimizer and schedule, TRL's own logging_steps 10 and
# gradient_checkpointing on, ModelConfig's LoRA. TRL's bf16 is on unless fp16 is: our auto (on where supported).
_TRL_COMMON: dict[str, Any] = {
    "warmup_ratio": 0.0, "warmup_steps": 0, "lr_scheduler": "linear", "min_lr_ratio": 0.0,
    "adam_betas": [0.9, 0.999], "grad_clip": 1.0, "weight_decay": 0.0,
    "seed": 42, "epochs": 3, "batch_size": 8, "eval_batch_size": 8, "gradient_accumulation_steps": 1,
    "log_every": 10, "save_steps": 500, "eval_steps": 0, "gradient_checkpointing": True, "bf16": "auto",
    "checkpoint_layout": "trl",  # output_dir/checkpoint-N, each a model folder, one at the last step
    "eval_strategy": "no",  # TRL measures held-out rows during training only when asked
    "use_lora": False, "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
    "lora_target_modules": "peft-default",  # ModelConfig's None: PEFT's choice for the architecture
    "bnb_4bit_use_double_quant": False}  # ModelConfig's use_bnb_nested_quant: a 4-bit base's block scales stay float32
# TRL templates a row of chat messages only: a string prompt is text (maybe_apply_chat_template)
TRL_DEFAULTS: dict[str, dict[str, Any]] = {
    "rm": {**_TRL_COMMON, "learning_rate": 1e-4, "max_length": 1024, "apply_chat_template": False},
    "dpo": {**_TRL_COMMON, "learning_rate": 1e-6, "max_length": 1024, "apply_chat_template": False,
            "beta": 0.1, "loss_type": "sigmoid",
            "label_smoothing": 0.0, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512},
    "sft": {**_TRL_COMMON, "learning_rate": 2e-5, "max_length": 1024, "completion_only_loss": True,
            "assistant_only_loss": False, "text_key": "text", "packing_strategy": "bfd"},
    "kto": {**_TRL_COMMON, "learning_rate": 1e-6, "max_length": 1024, "beta": 0.1, "desirable_weight": 1.0,
            "undesirable_weight": 1.0},
    "prm": {**_TRL_COMMON, "learning_rate": 1e-5, "max_length": 1024}}
# GKDConfig is SFTConfig with temperature 0.9, the divergence alone (kd_coef 1), the generalized JSD at beta 0.5
TRL_DEFAULTS["kd"] = {**TRL_DEFAULTS["sft"], "kd_coef": 1.0, "temperature": 0.9, "beta": 0.5}
# their defaults with no counterpart here: (the key of ours it would set, what is kept instead); LoRA's only with LoRA
_PAIRS_NOT_TAKEN = {"prompt_key=None": ("prompt_key", "a row's prompt column is read")}
OPENRLHF_NOT_TAKEN: dict[str, dict[str, tuple[str, str]]] = {
    "sft": {"input_key=input": ("prompt_key", "the rows' own layout names the columns")},
    "kto": {"input_key=input": ("prompt_key", "the rows' own layout names the columns")},
    "rm": _PAIRS_NOT_TAKEN, "dpo": _PAIRS_NOT_TAKEN}
OPENRLHF_NOT_TAKEN["kd"] = OPENRLHF_NOT_TAKEN["sft"]
SCRIPTS = {OPENRLHF: {"rm": "train_rm", "dpo": "train_dpo", "sft": "train_sft", "kto": "train_kto", "kd": "train_kd",
                      "prm": "train_prm"},
           TRL: {"rm": "RewardConfig", "dpo": "DPOConfig", "sft": "SFTConfig", "kto": "KTOConfig", "kd": "GKDConfig",
                 "prm": "PRMConfig"}}
COMMAND_OF = {"RMConfig": "rm", "DPOConfig": "dpo", "SFTConfig": "sft", "KTOConfig": "kto", "KDConfig": "kd",
              "PRMConfig": "prm"}


def spellings(theirs: list[str]) -> set[str]:
    """Whose spelling the line's flag names `theirs` (names of OpenRLHF or TRL, not keys of ours) are."""
    return ({OPENRLHF} if OPENRLHF_NAMES.intersection(theirs) else set()) | (
        {TRL} if TRL_NAMES.intersection(theirs) else set())


def their_defaults(command: str, whose: set[str]) -> dict[str, Any]:
    """The defaults a line of `whose` spelling takes: one spelling's table, or what two (or none: a name both have)
    agree on."""
    tables = [OPENRLHF_DEFAULTS[command], TRL_DEFAULTS[command]]
    if whose == {OPENRLHF}:
        return dict(tables[0])
    if whose == {TRL}:
        return dict(tables[1])
    return {k: v for k, v in tables[0].items() if k in tables[1] and tables[1][k] == v}


def _default(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _word(value: Any) -> str:
    """A default as a `key=value` override's value; a text beyond a plain word quoted, so that YAML reads it back
    as it is (a template's `{}`, `:`, `#` and newline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not re.fullmatch(r"[\w.+-]*", value):
        return json.dumps(value)
    return json.dumps(value) if isinstance(value, list) else str(value)


def adopted(config_class: type, whose: set[str], line_keys: set[str], lora: bool,
            chat: bool = False, packed: bool = False, current: bool = False) -> tuple[list[str], list[str]]:
    """(the `key=value` overrides of their defaults this line takes, what of theirs has no counterpart here): keys
    of `config_class` whose default differs and which the line does not set (`line_keys`); with `chat` (the line
    turns the chat template on) not input_template, which their scripts ignore then; the packing keys only when the
    line packs (`packed`); with `current` (the line names a flag of OpenRLHF's current scripts) OpenRLHF's
    current dtype, bf16."""
    command = COMMAND_OF[config_class.__name__]
    ours = {f.name: _default(f) for f in fields(config_class)}
    theirs = their_defaults(command, whose)
    if current and whose == {OPENRLHF}:
        theirs["bf16"] = OPENRLHF_CURRENT_BF16
    if "gradient_accumulation_steps" in line_keys:  # the line gives the global batch its own way
        theirs.pop("train_batch_size", None)
    if "eval_steps" in line_keys and whose == {OPENRLHF}:  # the line's own cadence (its -1: eval_strategy=epoch)
        theirs.pop("eval_strategy", None)
    if chat:
        theirs.pop("input_template", None)
    taken = [f"{k}={_word(v)}" for k, v in theirs.items()
             if k in ours and k not in line_keys and v != ours[k] and (lora or k not in LORA_ONLY)
             and (packed or k not in PACKING_ONLY)]
    missing = (OPENRLHF_NOT_TAKEN if whose == {OPENRLHF} else {}).get(command, {})
    not_taken = [f"{flag} ({why}: {key}={_word(ours[key])} kept)" for flag, (key, why) in missing.items()
                 if key not in line_keys and (lora or key not in LORA_ONLY)]
    return taken, not_taken


def say_adopted(config_class: type, whose: set[str], names: list[str], taken: list[str], not_taken: list[str]) -> None:
    """The one line at start naming what the line took of their defaults."""
    command = COMMAND_OF[config_class.__name__]
    listed = ", ".join(taken)
    missing = f"; not taken: {', '.join(not_taken)}" if not_taken else ""
    if len(whose) == 1:
        (who,) = whose
        if taken or not_taken:
            say(f"note: {who}'s {SCRIPTS[who][command]} defaults where the line is silent: {listed or 'none differ'}"
                f"{missing}")
        return
    flags = ", ".join(f"--{n}" for n in names)
    why = "names of both OpenRLHF and TRL" if not whose else "OpenRLHF's and TRL's names mixed"
    say(f"note: {flags}: {why}, so only the defaults the two share are taken: {listed or 'none differ'}")
