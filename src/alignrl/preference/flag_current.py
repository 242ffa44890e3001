"""The run-level flags of OpenRLHF's current offline scripts (`--param_dtype`, `--backend`, `--attn_implementation`,
`--load_checkpoint`) and of TRL's trainers (`--eval_strategy`, `--eos_token`, `--push_to_hub`, `--dataset_streaming`,
`--remove_unused_columns`, `--logging_first_step`) on `alignrl train sft|rm|dpo|kto`: each is translated to a key of
ours, accepted with a note when it changes nothing here, or refused in one line saying what to do instead.
`flag_names.flags_as_keys` asks `read_flag` first for every flag of a line. Nothing here imports torch.
"""

from __future__ import annotations

import os

from alignrl.config import ConfigError
from alignrl.preference.notes import say

# transformers' string_to_bool words
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "t", "y", "1", "on"), ("false", "no", "f", "n", "0", "off")
# flags whose value picks a value of one of our keys: flag -> (our key, {their value: ours}, why another is refused).
# OpenRLHF's --param_dtype (its current dtype flag, default bf16) is our bf16; its --backend our strategy.
CHOICE_FLAGS = {
    "param_dtype": ("bf16", {"bf16": "true"}, "the offline trainers compute in bfloat16 or float32 (bf16=true or "
                                              "false); float16 is left out"),
    "backend": ("strategy", {"deepspeed": "deepspeed", "fsdp2": "fsdp2"}, "the training engines here are ddp, "
                                                                          "fsdp2 and deepspeed (strategy=...)"),
    # TRL's ModelConfig dtype (--dtype, formerly --torch_dtype): the dtype the weights load in. TRL's configs keep
    # bf16 mixed precision on whatever it is (--bf16 sets that): float32 and auto change nothing here
    **{name: ("bf16", {"bfloat16": "true", "float32": None, "auto": None}, "the offline trainers compute in "
                      "bfloat16 or float32; float16 is left out")
       for name in ("dtype", "torch_dtype")},
}
# OpenRLHF's flags of its current scripts: a line naming one is written for them, whose default dtype is bf16
CURRENT_OPENRLHF = ("param_dtype", "attn_implementation", "backend")
_METRICS = "metrics go to logging_dir: report_to=[jsonl,tensorboard], and wandb with report_to=[...,wandb]"
# flags with a value that change nothing here -> why
IGNORED_VALUED = {
    "attn_implementation": "attention runs through PyTorch's SDPA here, which needs no flash-attention package",
    "dataset_num_proc": "the rows are read and encoded in this process",
    "max_ckpt_mem": "checkpoints are kept by number (--max_ckpt_num, save_total_limit), not by size",
    **{name: _METRICS for name in ("use_tensorboard", "wandb_org", "wandb_group", "wandb_run_name")}}
# OpenRLHF's wandb flags: --use_wandb KEY (or a true switch) logs to wandb, the key its API key; --wandb_project
WANDB_FLAGS = ("use_wandb", "wandb_project")
# switches that change nothing here -> why
IGNORED_SWITCHES = {
    "remove_unused_columns": "the loaders read only the columns they name",
    "no_remove_unused_columns": "the loaders read only the columns they name",
    "logging_first_step": "training metrics are logged every log_every steps; log_every=1 logs the first",
    "save_only_model": "checkpoints here also hold the optimizer state, so that a run can go on from one",
    "disable_ds_ckpt": "checkpoints hold the weights with the engine's own optimizer state",
    "save_hf_ckpt": "checkpoints hold the weights; with checkpoint_layout trl or verl also the model as an HF folder",
}
# switches refused when on (off, they ask for what happens anyway) -> what to do instead
REFUSED_SWITCHES = {
    "push_to_hub": "upload the run's final model folder with `huggingface-cli upload`; drop the flag",
    "dataset_streaming": "the dataset is read whole before training; drop the flag",
}
# flags with a value refused whatever it is -> what to do instead
REFUSED_VALUED = {
    "eos_token": "each row here ends with the tokenizer's own eos token; to end rows with another, set "
                 "\"eos_token\" in the model folder's tokenizer_config.json, then drop the flag",
}
# flags that name what happens here anyway -> (the values accepted, what happens here)
COMMON_ACCEPTED = {"optim": (("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"), "the optimizer is torch's "
                                                                                        "AdamW")}
LOAD_CHECKPOINT = "load_checkpoint"
_LOAD_MARK = "\0load_checkpoint"  # stands for the resume_from override until the line's output folder is known


def _wandb(name: str, given: str) -> list[str]:
    """OpenRLHF's --use_wandb (a key, which OpenRLHF logs in with, or a switch) as the wandb sink, the key the run's
    WANDB_API_KEY; --wandb_project as WANDB_PROJECT, the project the sink logs to."""
    if name == "wandb_project":
        os.environ["WANDB_PROJECT"] = given
        return []
    if given.lower() in FALSE_WORDS:
        return []
    if given.lower() not in TRUE_WORDS:
        os.environ["WANDB_API_KEY"] = given  # the ranks started from here inherit it; it never enters the config
    return ["report_to=[jsonl,tensorboard,wandb]"]


def read_switch(word: str, name: str, value: str | None, nxt: str | None) -> tuple[bool, int]:
    """(on or off, words taken) of a switch: bare, `--name=true|false`, or `--name true|false` (TRL's spelling)."""
    taken = value is None and nxt is not None and nxt.lower() in TRUE_WORDS + FALSE_WORDS
    given = value if value is not None else (nxt if taken else "true")
    if given.lower() not in TRUE_WORDS + FALSE_WORDS:
        raise ConfigError(f"{word}: --{name} takes true or false, or nothing (true)")
    return given.lower() in TRUE_WORDS, 2 if taken else 1


def _value(name: str, eq: str, value: str, nxt: str | None) -> tuple[str, int]:
    """(the value of `--name VALUE` or `--name=VALUE`, words taken)."""
    if not eq and (nxt is None or nxt.startswith("--")):
        raise ConfigError(f"--{name} needs a value (--{name} VALUE)")
    return (value, 1) if eq else (nxt, 2)


def _means(given: str, values: tuple[str, ...]) -> bool:
    """Whether `given` says one of `values`: the same text, the same number (`0.` is 0), or the same truth value in
    transformers' words (`no` is false)."""
    if given in values:
        return True
    low = given.strip().lower()
    for words in (TRUE_WORDS, FALSE_WORDS):
        if low in words and any(v.lower() in words for v in values):
            return True
    try:
        return any(float(given) == float(v) for v in values)
    except ValueError:
        return False


def _given(name: str, word: str, eq: str, value: str, nxt: str | None, values: tuple[str, ...]) -> tuple[str, int]:
    """The value of an accepted flag: a switch of truth values may stand bare (`--seq_kd` is true, as TRL reads it)."""
    if all(v.lower() in TRUE_WORDS + FALSE_WORDS for v in values):
        on, taken = read_switch(word, name, value if eq else None, nxt)
        return ("true" if on else "false"), taken
    return _value(name, eq, value, nxt)


def read_flag(word: str, name: str, eq: str, value: str, nxt: str | None,
              accepted: dict[str, tuple[tuple[str, ...], str]]) -> tuple[list[str], int] | None:
    """(the overrides of flag `--name` at `word`, words taken), or None when it is none of this module's flags.
    `accepted`: the command's flags that name what happens here anyway (flag -> (values accepted, what happens))."""
    accepted = {**COMMON_ACCEPTED, **accepted}
    if name in WANDB_FLAGS:
        given, taken = _value(name, eq, value, nxt)
        return _wandb(name, given), taken
    if name in CHOICE_FLAGS:
        given, taken = _value(name, eq, value, nxt)
        key, values, why = CHOICE_FLAGS[name]
        if given not in values:
            raise ConfigError(f"--{name} {given}: {why}; give {' or '.join(values)}, or leave the flag out")
        return ([f"{key}={values[given]}"] if values[given] is not None else []), taken
    if name in accepted or name in IGNORED_VALUED or name in REFUSED_VALUED:
        given, taken = (_given(name, word, eq, value, nxt, accepted[name][0]) if name in accepted
                        else _value(name, eq, value, nxt))
        if name in REFUSED_VALUED:
            raise ConfigError(f"--{name} is not supported here: {REFUSED_VALUED[name]}")
        if name in IGNORED_VALUED:
            say(f"note: --{name} changes nothing here and is ignored ({IGNORED_VALUED[name]})")
            return [], taken
        values, why = accepted[name]
        if not _means(given, values):
            raise ConfigError(f"--{name} {given}: {why}; give {' or '.join(values)}, or leave the flag out")
        return [], taken
    if name in IGNORED_SWITCHES or name in REFUSED_SWITCHES or name == LOAD_CHECKPOINT:
        on, taken = read_switch(word, name, value if eq else None, nxt)
        if name in REFUSED_SWITCHES and on:
            raise ConfigError(f"--{name} is not supported here: {REFUSED_SWITCHES[name]}")
        if name in IGNORED_SWITCHES:
            say(f"note: --{name} changes nothing here and is ignored ({IGNORED_SWITCHES[name]})")
        return ([_LOAD_MARK] if name == LOAD_CHECKPOINT and on else []), taken
    return None


def with_resume(words: list[str]) -> list[str]:
    """`words` with `--load_checkpoint`'s stand-in as OpenRLHF's: resume_from=auto, the newest complete checkpoint
    of the run's checkpoint folder when it starts, the base model on a first run. A resume_from the line gives
    itself wins."""
    if _LOAD_MARK not in words:
        return words
    rest = [w for w in words if w != _LOAD_MARK]
    return rest if any(w.startswith("resume_from=") for w in rest) else rest + ["resume_from=auto"]


def is_current_openrlhf(argv: list[str]) -> bool:
    """Whether the line names a flag only OpenRLHF's current scripts have (their default dtype is bf16, where the
    older scripts trained in float32 without --bf16)."""
    return any(w.startswith("--") and w[2:].partition("=")[0] in CURRENT_OPENRLHF for w in argv)
