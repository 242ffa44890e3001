"""verl's SFT trainer keys on `alignrl train sft`: a line written for `torchrun -m verl.trainer.sft_trainer` (or the
older `verl.trainer.fsdp_sft_trainer`) is read as this command's keys, so that the script runs with only its entry
point changed (the shims `python -m verl.trainer.sft_trainer ...` keep even that).

    alignrl train sft data.train_files=data/train.parquet data.messages_key=messages data.micro_batch_size_per_gpu=4 \\
        data.train_batch_size=32 optim.lr=1e-5 engine=fsdp model.path=Qwen/Qwen2.5-0.5B-Instruct \\
        trainer.default_local_dir=models/sft trainer.total_epochs=2

Every dotted verl key (`data.*`, `optim.*`, `model.*`, `trainer.*`, `engine=`/`engine.*`, Hydra's `+`/`++`
prefixes taken) is one of three kinds: renamed to a key of ours with verl's meaning (`RENAMED`, and the converted
ones in `_converted`); not applied, because it changes nothing that trains here (sharding, offload, sequence
parallelism, padding removal, loggers without a sink), listed once at start; or asked at a value alignrl cannot
give (a custom dataset class, Liger kernels, the WSD schedule), one line naming it. A verl key not known here is one
line too. A line in verl's spelling also takes verl's defaults where it is silent (`NEW_DEFAULTS`, or
`OLD_DEFAULTS` for a line of the older trainer, told by its `model.partial_pretrain`), said in one line.
Nothing here imports torch.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import yaml

from alignrl.config import ConfigError
from alignrl.config.checks import did_you_mean
from alignrl.preference.notes import say

HEADS = ("data", "optim", "model", "trainer", "engine", "checkpoint", "profiler")
TOP_KEYS = ("ulysses_sequence_parallel_size", "use_remove_padding")  # the older trainer's top-level keys
_WORD = re.compile(r"^\+{0,2}([A-Za-z_][\w.]*)=(.*)$", re.S)

# verl's key -> ours, same meaning (values converted by `_value_for` where verl's spelling differs)
RENAMED = {
    "data.train_files": "train_files", "data.val_files": "eval_files", "data.prompt_key": "prompt_key",
    "data.response_key": "response_key", "data.messages_key": "messages_key",
    "data.multiturn.messages_key": "messages_key", "data.train_batch_size": "train_batch_size",
    "data.max_length": "max_length", "data.truncation": "truncation", "data.num_workers": "num_workers",
    "data.apply_chat_template_kwargs": "chat_template_kwargs", "data.train_max_samples": "max_train_pairs",
    "data.val_max_samples": "max_eval_pairs", "model.path": "model_path", "model.partial_pretrain": "model_path",
    "model.lora_alpha": "lora_alpha", "model.target_modules": "lora_target_modules",
    "model.enable_gradient_checkpointing": "gradient_checkpointing", "optim.lr": "learning_rate",
    "optim.betas": "adam_betas", "optim.weight_decay": "weight_decay", "optim.warmup_steps_ratio": "warmup_ratio",
    "optim.lr_warmup_steps_ratio": "warmup_ratio", "optim.clip_grad": "grad_clip", "optim.min_lr_ratio": "min_lr_ratio",
    "trainer.total_epochs": "epochs", "trainer.total_training_steps": "max_steps", "trainer.seed": "seed",
    "trainer.default_local_dir": "output_dir", "trainer.save_freq": "save_steps", "trainer.test_freq": "eval_steps",
    "trainer.resume_from_path": "resume_from", "trainer.resume_path": "resume_from",
    "trainer.max_ckpt_to_keep": "save_total_limit", "data.image_key": "image_key", "data.tools_key": "tools_key",
    "data.multiturn.tools_key": "tools_key", "data.enable_thinking_key": "enable_thinking_key",
    "data.multiturn.enable_thinking_key": "enable_thinking_key", "data.prompt_dict_keys": "prompt_dict_keys",
    "data.response_dict_keys": "response_dict_keys",
}
DICT_KEYS = ("data.prompt_dict_keys", "data.response_dict_keys")  # the older trainer's path into a nested column
NEVER = ("data.train_max_samples", "data.val_max_samples", "trainer.save_freq", "trainer.test_freq")  # -1: 0 here
SCHEDULERS = ("optim.lr_scheduler", "optim.lr_scheduler_type", "optim.warmup_style")

# keys that change nothing that trains here, by pattern, with why (said once at start when the line gives them)
NOT_APPLIED = {
    "engine.*": "the engine's sharding, offload, precision and sequence-parallel settings: the loss and update do "
                "not depend on them",
    "ulysses_sequence_parallel_size": "sequence parallelism: a memory layout, the loss is the same",
    "use_remove_padding": "padding removal: rows train padded, to the same loss; packing=true drops the padding",
    "model.use_remove_padding": "padding removal: rows train padded, to the same loss; packing=true drops the "
                                "padding",
    "model.fsdp_config.*": "FSDP wrapping, offload and dtype (the engine is strategy's)",
    "model.[!l]*": "model loading and kernel settings that change no result here",
    "data.use_dynamic_bsz": "token-budget micro-batches: a micro-batch holds micro_batch_size_per_gpu rows, the "
                            "update is the same",
    "data.max_token_len_per_gpu": "token-budget micro-batches: a micro-batch holds micro_batch_size_per_gpu rows, "
                                  "the update is the same",
    "data.pad_mode": "padding removal: rows train padded, to the same loss; packing=true drops the padding",
    "data.balance_dp_token": "rank token balancing", "data.use_shm": "shared-memory loading",
    "data.multiturn.enable": "rows are told apart by their columns (messages, prompt/response)",
    "data.ignore_input_ids_mismatch": "conversations render whole here", "data.custom_cls.name": "custom dataset",
    "trainer.device": "the device is the one torch finds", "trainer.balance_batch": "rank balancing",
    "trainer.profile_interval": "profiling",
    "checkpoint.*": "a checkpoint holds the weights, optimizer and data position, and the model in huggingface/",
    "profiler.*": "profiling", "optim.optimizer_impl": "AdamW from torch", "optim.zero_indexed_step": "schedule steps",
    "optim.total_training_steps": "set from the trainer's steps", "optim.override_optimizer_config": "none here",
    "optim.lr_warmup_steps": "warm-up by steps: used when > 0",
}
# read where they act (`launch_words`, `_finish`): the ranks, the resume mode, the default output folder's names, the
# enable_thinking of rows without their own
HANDLED = ("trainer.nnodes", "trainer.n_gpus_per_node", "trainer.resume_mode", "trainer.project_name",
           "trainer.experiment_name", "data.enable_thinking_default")
# the groups verl's Hydra config composes: their default options only
GROUPS = {"engine": ("fsdp", "fsdp2", "deepspeed"), "optim": ("fsdp", "deepspeed"), "model": ("hf_model",),
          "profiler": ("profiler",)}
# keys asked at the one value alignrl behaves as: any other value is one line saying why
ONLY = {
    "model.use_liger": ((False,), "Liger kernels are left out"),
    "model.custom_chat_template": ((None,), "a chat template of one's own is left out; the tokenizer's is used"),
    "data.chat_template": ((None,), "a chat template of one's own is left out; the tokenizer's is used"),
    "model.tokenizer_path": ((None,), "the tokenizer is model.path's"),
    "model.hf_config_path": ((None,), "the model config is model.path's"),
    "model.external_lib": ((None,), "external model libraries are not imported"),
    "model.lora_adapter_path": ((None,), "training on from a saved adapter is left out"),
    "model.exclude_modules": ((None,), "LoRA goes on every module model.target_modules names"),
    "model.override_config": (({},), "the model's HF config is not overridden"),
    "data.custom_cls.path": ((None,), "a custom dataset class is left out; give rows in one of the three layouts"),
    "trainer.default_hdfs_dir": ((None,), "HDFS copies are left out"),
    "data.micro_batch_size": ((None,), "verl's deprecated global micro batch; give data.micro_batch_size_per_gpu"),
    "optim.optimizer": (("AdamW", "adamw"), "the optimizer is torch's AdamW"),
    "optim.num_cycles": ((0.5,), "the cosine is half a cycle"),
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "train_batch_size": 256, "batch_size": 4, "eval_batch_size": 4, "max_length": 1024, "truncation": "error",
    "epochs": 4, "weight_decay": 0.01, "grad_clip": 1.0, "min_lr_ratio": 0.0, "seed": 1, "log_every": 1,
    "lora_alpha": 16, "lora_dropout": 0.0, "apply_chat_template": True,
    # verl's trainer.logger [console, wandb]: wandb where it is installed (offline without an API key)
    "report_to": ["jsonl", "wandb"] if importlib.util.find_spec("wandb") else ["jsonl"]}
# verl's sft_trainer (sft_trainer_engine.yaml with optim/fsdp.yaml and model/hf_model.yaml)
NEW_DEFAULTS = {**_COMMON_DEFAULTS, "learning_rate": 1e-3, "adam_betas": [0.9, 0.999], "warmup_ratio": 0.0,
                "lr_scheduler": "constant", "gradient_checkpointing": True}
# the older fsdp_sft_trainer (fsdp_sft_trainer.yaml): its prompt-response rows' columns too
OLD_DEFAULTS = {**_COMMON_DEFAULTS, "learning_rate": 1e-5, "adam_betas": [0.9, 0.95], "warmup_ratio": 0.1,
                "lr_scheduler": "cosine", "gradient_checkpointing": False, "prompt_key": "question",
                "response_key": "answer"}
OLD_ONLY = ("model.partial_pretrain", "data.multiturn.", "optim.warmup_steps_ratio", "trainer.resume_path",
            "ulysses_sequence_parallel_size", "use_remove_padding", "data.micro_batch_size=")


@dataclass
class _Pass:
    out: list[str] = field(default_factory=list)  # our key=value words
    not_applied: dict[str, list[str]] = field(default_factory=dict)  # why -> the words it covers
    given: dict[str, Any] = field(default_factory=dict)  # verl key -> value, for what depends on several keys
    engine: str = "fsdp"  # verl's default engine


def verl_key(word: str) -> str | None:
    """The verl key a `key=value` word sets (its Hydra prefix dropped), or None for any other word."""
    m = _WORD.match(word)
    if not m:
        return None
    key = m.group(1)
    return key if key.split(".")[0] in HEADS or key in TOP_KEYS else None


def spelled_verl(argv: list[str]) -> bool:
    return any(verl_key(w) for w in argv)


def launch_words(argv: list[str]) -> list[str]:
    """The line with `--nproc N` added where a verl line outside torchrun asks for trainer.nnodes ×
    trainer.n_gpus_per_node > 1 ranks (as `alignrl train ppo` starts them); torchrun's own world otherwise."""
    given = {verl_key(w): _parse(w.partition("=")[2]) for w in argv if verl_key(w)}
    nodes, per_node = given.get("trainer.nnodes", 1), given.get("trainer.n_gpus_per_node", 1)
    if not isinstance(nodes, int) or not isinstance(per_node, int) or nodes < 1 or per_node < 1:
        raise ConfigError(f"trainer.nnodes={nodes} and trainer.n_gpus_per_node={per_node} must be whole numbers >= 1")
    wanted, world = nodes * per_node, os.environ.get("WORLD_SIZE")
    if any(w == "--nproc" or w.startswith("--nproc=") for w in argv):
        return argv
    if world is not None:
        if int(world) != wanted and ("trainer.nnodes" in given or "trainer.n_gpus_per_node" in given):
            say(f"note: trainer.nnodes × trainer.n_gpus_per_node = {wanted}, torchrun started {world} ranks: they "
                "train")
        return argv
    return [*argv, "--nproc", str(wanted)] if wanted > 1 else argv


def in_our_words(argv: list[str], config: type | None = None) -> list[str]:
    """`argv` with verl's keys as ours, verl's defaults for what it leaves unsaid placed first (so that anything
    the line sets wins), those where `config`'s own default differs; the line itself when it has no verl key."""
    if not spelled_verl(argv):
        return argv
    st, rest = _Pass(), []
    for word in argv:
        key = verl_key(word)
        if key is None:
            rest.append(word)
            continue
        value = _parse(word.partition("=")[2])
        st.given[key] = value
        _translate(st, key, value, word.partition("=")[2])
    _finish(st, rest)
    old = any(k.startswith(OLD_ONLY) or f"{k}=".startswith(OLD_ONLY) for k in st.given)
    defaults = _defaults(old, [*st.out, *rest], _own_defaults(config))
    if st.not_applied:
        say("verl keys not applied here: " + "; ".join(f"{', '.join(words)} ({why})"
                                                       for why, words in st.not_applied.items()))
    return [*defaults, *st.out, *rest]


def _translate(st: _Pass, key: str, value: Any, text: str) -> None:
    if key in ("trainer.save_freq", "trainer.test_freq") and value == "after_each_epoch":
        st.out.append(f"{'save' if key.endswith('save_freq') else 'eval'}_strategy=epoch")
    elif key in RENAMED:
        st.out.append(f"{RENAMED[key]}={_value_for(key, value, text)}")
    elif key in GROUPS:
        _group(st, key, value)
    elif key in ("data.micro_batch_size_per_gpu",):  # "this is also val batch size"
        st.out += [f"batch_size={value}", f"eval_batch_size={value}"]
    elif key == "model.lora_rank":  # 0: no LoRA, as verl's default
        st.out += [f"use_lora={'true' if _number(key, value) > 0 else 'false'}"]
        st.out += [f"lora_rank={value}"] if _number(key, value) > 0 else []
    elif key in SCHEDULERS:
        _scheduler(st, key, value)
    elif key == "trainer.logger":
        _logger(st, value)
    elif key in ONLY:
        allowed, why = ONLY[key]
        if value not in allowed:
            raise ConfigError(f"verl's {key}={text}: {why}")
    elif key in HANDLED:
        return
    elif key == "engine.strategy":
        _group(st, "engine", value)
    elif key == "optim.lr_warmup_steps" and _number(key, value) > 0:
        st.out.append(f"warmup_steps={value}")
    elif any(fnmatch.fnmatchcase(key, p) for p in NOT_APPLIED):
        why = next(w for p, w in NOT_APPLIED.items() if fnmatch.fnmatchcase(key, p))
        st.not_applied.setdefault(why, []).append(f"{key}={text}")
    else:
        known = [*RENAMED, *ONLY, *SCHEDULERS, "data.micro_batch_size_per_gpu", "model.lora_rank", "trainer.logger"]
        raise ConfigError(f"unknown verl SFT key '{key}'{did_you_mean(key, known)}; docs/sft.md lists the verl keys "
                          "alignrl takes")


def _value_for(key: str, value: Any, text: str) -> str:
    """verl's value in our spelling: one file or a list of them, -1 for never or all, ~ for the home folder."""
    if key in ("data.train_files", "data.val_files"):
        files = [] if value is None else value if isinstance(value, list) else [value]
        return json.dumps([os.path.expanduser(str(f)) for f in files])
    if key in DICT_KEYS:  # null: the column itself; one key alone: a list of it
        return json.dumps([] if value is None else [str(k) for k in (value if isinstance(value, list) else [value])])
    if key in NEVER:
        return "0" if value is None or _number(key, value) < 0 else str(value)
    if key == "trainer.max_ckpt_to_keep":  # verl keeps every checkpoint for null or a number below 1
        return "0" if value is None or _number(key, value) < 1 else str(value)
    if key in ("trainer.total_training_steps",):
        return "0" if value is None else str(value)
    if key in ("model.path", "model.partial_pretrain", "trainer.default_local_dir", "trainer.resume_from_path",
               "trainer.resume_path"):
        return "null" if value is None else os.path.expanduser(str(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return text


def _group(st: _Pass, group: str, option: Any) -> None:
    """verl's config group selections: its FSDP and DeepSpeed engines (`_finish`), the default options of the others."""
    if group == "engine" and option not in GROUPS["engine"]:
        raise ConfigError(f"verl's engine={option}: alignrl trains on FSDP2 (engine=fsdp), DeepSpeed "
                          "(engine=deepspeed), DDP or one process; not on Megatron, VeOmni, torchtitan or AutoModel")
    if group == "engine":
        st.engine = str(option)
    elif option not in GROUPS[group]:
        raise ConfigError(f"verl's {group}={option}: alignrl reads verl's default {group} options alone "
                          f"({', '.join(GROUPS[group])})")


def _scheduler(st: _Pass, key: str, value: Any) -> None:
    if value is None:  # warmup_style's deprecated null: lr_scheduler_type decides
        return
    if value not in ("constant", "cosine"):
        raise ConfigError(f"verl's {key}={value}: the schedules here are constant and cosine (linear warm-up "
                          "first); WSD is left out")
    st.out.append(f"lr_scheduler={value}")


def _logger(st: _Pass, value: Any) -> None:
    """verl's loggers: console always prints, tensorboard and wandb are sinks here, the others write nothing here."""
    names = [value] if isinstance(value, str) else list(value or [])
    st.out.append(f"report_to={json.dumps(['jsonl'] + [n for n in ('tensorboard', 'wandb') if n in names])}")
    other = [n for n in names if n not in ("console", "tensorboard", "wandb")]
    if other:
        st.not_applied.setdefault("metrics go to logging_dir: metrics.jsonl, tensorboard", []).append(
            f"trainer.logger {', '.join(other)}")


def _finish(st: _Pass, rest: list[str]) -> None:
    """What depends on several keys: verl's FSDP engine (its default) is FSDP2 over torchrun's ranks, one process
    unsharded (the ranks of `--nproc` read the line again); resume_mode=auto (its default) goes on from the newest
    checkpoint of the output folder, checkpoints/<project>/<experiment> unless trainer.default_local_dir names one."""
    if st.engine == "deepspeed":
        st.out.append("strategy=deepspeed")
    elif int(os.environ.get("WORLD_SIZE") or 1) > 1:  # FSDP2 shards over the ranks; one process trains unsharded
        st.out.append("strategy=fsdp2")
    # verl's project and experiment name the wandb run; the ranks started from here inherit them
    for key, variable in (("trainer.project_name", "WANDB_PROJECT"), ("trainer.experiment_name", "WANDB_NAME")):
        if key in st.given:
            os.environ[variable] = str(st.given[key])
    thinking = st.given.get("data.enable_thinking_default")
    if thinking is not None:  # the rows without their own enable_thinking; over apply_chat_template_kwargs, as in verl
        if not isinstance(thinking, bool):
            raise ConfigError(f"verl's data.enable_thinking_default={thinking!r}: give true, false or null")
        st.out.append(f"chat_template_kwargs.enable_thinking={_text(thinking)}")
    if "trainer.default_local_dir" not in st.given:
        project = st.given.get("trainer.project_name", "gsm8k-sft")
        st.out.insert(0, f"output_dir=checkpoints/{project}/{st.given.get('trainer.experiment_name', 'test')}")
    st.out.append("checkpoint_layout=verl")  # global_step_N/ with huggingface/ in default_local_dir
    mode = st.given.get("trainer.resume_mode", "auto")
    if mode not in ("auto", "disable", "resume_path"):
        raise ConfigError(f"verl's trainer.resume_mode={mode}: one of auto, disable, resume_path")
    if mode == "disable":
        st.out = [w for w in st.out if not w.startswith("resume_from=")]
    given = any(w.startswith(("resume_from=", "--resume_from")) for w in [*st.out, *rest])
    if mode == "resume_path" and not given:
        raise ConfigError("verl's trainer.resume_mode=resume_path goes on from trainer.resume_from_path: give it")
    if mode == "auto" and not given:  # the newest complete checkpoint of default_local_dir, found when the run starts
        st.out.append("resume_from=auto")


def _own_defaults(config: type | None) -> dict[str, Any]:
    if config is None:
        return {}
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(config)}


def _defaults(old: bool, words: list[str], own: dict[str, Any]) -> list[str]:
    table = OLD_DEFAULTS if old else NEW_DEFAULTS
    set_keys = {w.lstrip("-").partition("=")[0] for w in words}
    lora = "use_lora=true" in words  # LoRA's keys are taken (and said) only for a line that trains adapters
    taken = {k: v for k, v in table.items()
             if k not in set_keys and (k not in own or own[k] != v) and (lora or not k.startswith("lora_"))}
    if taken:
        which = "fsdp_sft_trainer" if old else "sft_trainer"
        say(f"verl's {which} defaults taken: " + ", ".join(f"{k}={_text(v)}" for k, v in taken.items()))
    return [f"{k}={_text(v)}" for k, v in taken.items()]


def _text(value: Any) -> str:
    if isinstance(value, list):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _parse(text: str) -> Any:
    """A Hydra value as YAML reads it (`[a,b]`, `true`, `null`, `-1`); a value YAML cannot read is its text."""
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"verl's {key}={value!r} must be a number")
    return value
