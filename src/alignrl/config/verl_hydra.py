"""Hydra's config selection on a verl command line (`--config-path DIR --config-name NAME`, `-cp`/`-cn`): verl's own
`ppo_trainer` says nothing, and a user's config that extends it (`defaults: [ppo_trainer, _self_]`, as verl's
multi-turn examples are written) is read as the overrides it holds, placed before the command line's, so that those
win as they do in Hydra. Anything else Hydra would compose (another config group, another base) is one line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from alignrl.config.schema import ConfigError
from alignrl.config.verl_keys import reads
from alignrl.config.verl_tables import STRATEGIES

_SELECTION = {"--config-name": "--config-name", "-cn": "--config-name", "--config-path": "--config-path",
              "-cp": "--config-path", "--config-dir": "--config-dir", "-cd": "--config-dir"}
BASE = "ppo_trainer"  # main_ppo's own config: the defaults every verl-spelled run starts from
_OWN_DEFAULTS = (BASE, "_self_")


def hydra_selection(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`argv` without Hydra's config selection, the overrides of the selected config: none for verl's own
    ppo_trainer); one line for a selection alignrl cannot read."""
    kept, chosen = _split(argv)
    name, folder = chosen.get("--config-name"), chosen.get("--config-path") or chosen.get("--config-dir")
    if name and "megatron" in name:
        raise ConfigError(f"--config-name={name} selects verl's Megatron trainer, which is not supported "
                          f"({STRATEGIES})")
    if name is None and folder is not None:  # a folder alone: Hydra would still read ppo_trainer from verl's package
        raise ConfigError(f"--config-path={folder} without --config-name: give the config's name too, or put the "
                          "overrides on the command line")
    if name is None or (name.removesuffix(".yaml") == BASE and folder is None):
        return kept, []
    if folder is None:
        raise ConfigError(f"--config-name={name}: alignrl reads verl's ppo_trainer and a config of yours that extends "
                          "it; give its folder with --config-path, or put the overrides on the command line")
    read, unread = config_overrides(Path(folder), name)
    if unread and os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 speaks for all
        # Hydra merges a file's keys into ppo_trainer's, new ones too, and verl reads only what its code asks for
        print(f"alignrl: {name}: keys alignrl does not read, left unread: {', '.join(unread)}", file=sys.stderr,
              flush=True)
    return kept, read


def _split(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    kept, chosen, i = [], {}, 0
    while i < len(argv):
        flag, sep, value = argv[i].partition("=")
        if flag not in _SELECTION:
            kept.append(argv[i])
        elif sep or i + 1 < len(argv):
            value = value if sep else argv[i + 1]
            i += 0 if sep else 1
            chosen[_SELECTION[flag]] = value.strip("'\"")
        else:
            raise ConfigError(f"{flag} needs a value (a folder for --config-path, a config name for --config-name)")
        i += 1
    return kept, chosen


def config_overrides(folder: Path, name: str) -> tuple[list[str], list[str]]:
    """The dotted overrides a user's Hydra config in `folder` holds, its `defaults` checked to be verl's ppo_trainer
    (and _self_) and its `hydra:` section (search paths, run folders) left out; and the ones alignrl does not read
    (a fork's own keys, which Hydra merges in and plain verl never reads)."""
    path = folder / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        raise ConfigError(f"--config-path={folder} --config-name={name}: no such file {path}; give the folder and "
                          "the name of a YAML config (without .yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a Hydra config is a mapping of settings; this file holds a {type(data).__name__}")
    defaults = data.pop("defaults", [BASE])
    other = [d for d in defaults if d not in _OWN_DEFAULTS] if isinstance(defaults, list) else [defaults]
    if other:
        raise ConfigError(f"{path}: its defaults {other} compose other Hydra configs, which alignrl does not read; "
                          f"keep `defaults: [{BASE}, _self_]` and put those settings in the file or on the command "
                          "line")
    data.pop("hydra", None)
    judged = [(f"{k}={v}", reads(k, v)) for k, v in _flat(data, "")]
    return [o for o, read in judged if read], [o for o, read in judged if not read]


def _flat(node: dict, prefix: str) -> list[tuple[str, str]]:
    out = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", _text(value)))
    return out


def _text(value: object) -> str:
    """A YAML value as an override's value: null, true/false, numbers and lists in YAML's flow form."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
