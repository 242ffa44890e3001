"""Reading the preference trainers' YAML files, the reference Safe-MM-DPO project's own included.

That project's `configs/rm_config.yaml` and `configs/dpo_config.yaml` load as they are: their Greek keys
(`λ_init`, `β_ori`, `λ_lr`), their path keys (`policy_model_path`, `train_helpful_path`, ...), their nested
`lora: {r, alpha, dropout, target_modules}` block beside `use_lora`, and a key written twice (PyYAML keeps the
last value; so does this reader, and it says so in one line). Each of their keys becomes the flat key of
`alignrl.preference.cli` that means the same thing (`MMDPO_KEYS`); a key unknown to both is refused in one line
by the config loader. Nothing here imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from alignrl.config import ConfigError

# Safe-MM-DPO key -> our flat key, for both commands (a key only one command has is refused by the other as unknown)
MMDPO_KEYS = {
    "λ_init": "lambda_init", "β_ori": "beta", "λ_lr": "lambda_lr", "w": "beta_w", "k": "beta_k",
    "max_grad_norm": "grad_clip", "policy_model_path": "model_path", "base_model_path": "model_path",
    "helpful_rm_path": "helpful_rm", "harmless_rm_path": "harmless_rm", "num_epochs": "epochs",
}
# the RM's per-task files and the DPO's file lists, from the same keys of that project
RM_FILES = {"train_helpful_path": "helpful_train_file", "val_helpful_path": "helpful_eval_file",
            "train_harmless_path": "harmless_train_file", "val_harmless_path": "harmless_eval_file"}
DPO_FILES = {"train_files": ("train_helpful_path", "train_harmless_path"),
             "eval_files": ("val_helpful_path", "val_harmless_path")}
# verl's name of the template variables (its data.apply_chat_template_kwargs); ours is the RL runs' and vLLM's
VERL_NAMES = {"apply_chat_template_kwargs": "chat_template_kwargs"}
# TRL's name of the DPO's NLL term (RPO), which OpenRLHF calls nll_loss_coef, as ours
TRL_NAMES = {"rpo_alpha": "nll_loss_coef", "cpo_alpha": "nll_loss_coef"}
LORA_KEYS = {"r": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "lora_target_modules"}


_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                      |\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)


def read_yaml(path: str, say=print) -> dict[str, Any]:
    """The mapping of a YAML file. A key written twice in one mapping keeps its last value, as PyYAML's, and is
    named in one line through `say`; a file that is not a mapping, or not YAML, is one ConfigError."""
    import yaml

    if not Path(path).is_file():
        raise ConfigError(f"config file not found: {path} (pass --config with an existing YAML file)")
    repeated: list[tuple[str, int]] = []

    class _Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                repeated.append((str(key), key_node.start_mark.line + 1))
            seen[key] = key_node.start_mark.line + 1
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    # YAML 1.2 floats, as OmegaConf reads them: PyYAML's 1.1 rules take `1e-5` (no dot) for a string
    _Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)  # noqa: S506  a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {path}: {' '.join(str(e).split())}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, not a {type(data).__name__}")
    for key, line in repeated:
        say(f"note: {path}:{line}: key '{key}' is written more than once; its last value ({data.get(key)!r}) is "
            "used, as PyYAML reads it")
    return data


def translate(raw: dict[str, Any], command: str) -> dict[str, Any]:
    """The flat keys of `command` (rm | dpo) for a file written with the Safe-MM-DPO project's keys; keys already ours pass
    as they are. One of its keys and our counterpart both given must agree."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # our key -> the file's key that set it

    def put(key: str, value: Any, source: str) -> None:
        if key in out and out[key] != value:
            raise ConfigError(f"{given[key]}={out[key]!r} and {source}={value!r} set the same thing ({key}); keep "
                              "one of them")
        out[key], given[key] = value, source

    for key, value in raw.items():
        if key in MMDPO_KEYS or key in VERL_NAMES:
            put(MMDPO_KEYS.get(key) or VERL_NAMES[key], value, key)
        elif command == "rm" and key in RM_FILES:
            put(RM_FILES[key], value, key)
        elif command == "dpo" and key in RM_FILES:
            continue  # the two file lists below
        elif key == "lora":
            _lora_block(value, put)
        else:
            put(key, value, key)
    if command == "dpo":
        for ours, (helpful, harmless) in DPO_FILES.items():
            files = [raw[k] for k in (helpful, harmless) if raw.get(k)]
            if files:
                put(ours, files, f"{helpful}/{harmless}")
    return out


def _lora_block(block: Any, put) -> None:
    """That project's `lora:` mapping (read whether or not use_lora is on; use_lora decides)."""
    if block is None:
        return
    if not isinstance(block, dict):
        raise ConfigError(f"lora must be a mapping of r, alpha, dropout, target_modules, not {block!r}")
    for key, value in block.items():
        if key not in LORA_KEYS:
            raise ConfigError(f"unknown key lora.{key}; the lora block takes {', '.join(LORA_KEYS)}")
        if key == "target_modules" and value is None:
            continue  # that project's "null: the default modules"
        put(LORA_KEYS[key], value, f"lora.{key}")


def translate_override(override: str, command: str) -> str:
    """A `key=value` override spelled with that project's key (`λ_init=0.5`, `lora.r=8`) in our key (the DPO's file keys
    stay as written: one file of a list is no key of ours)."""
    key, eq, value = override.partition("=")
    if not eq:
        return override
    if key.startswith("lora.") and key[5:] in LORA_KEYS:
        return f"{LORA_KEYS[key[5:]]}={value}"
    head, dot, rest = key.lstrip("+").partition(".")  # verl's `+key.name=v` adds an entry: here every key exists
    if head in VERL_NAMES:
        return f"{VERL_NAMES[head]}{dot}{rest}={value}"
    files = RM_FILES if command == "rm" else TRL_NAMES
    return f"{MMDPO_KEYS.get(key, files.get(key, key))}={value}"
