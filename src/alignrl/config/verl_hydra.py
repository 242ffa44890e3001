"""Hydra's config selection on a verl command line (`--config-path DIR --config-name NAME`, `-cp`/`-cn`): verl's own
`ppo_trainer` says nothing, and a user's config that extends it (`defaults: [ppo_trainer, _self_]`, as verl's
multi-turn examples are written) is read as the overrides it holds, placed before the command line's, so that those
win as they do in Hydra. Its defaults list may compose other configs of its folder, and options of config groups kept
there (group/option.yaml); one of verl's own groups, which alignrl does not read, is one line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from alignrl.config.schema import ConfigError
from alignrl.config.verl_keys import reads
from alignrl.config.verl_tables import STRATEGIES

SELECTION_FLAGS = {"--config-name": "--config-name", "-cn": "--config-name", "--config-path": "--config-path",
                   "-cp": "--config-path", "--config-dir": "--config-dir", "-cd": "--config-dir"}
BASE = "ppo_trainer"  # main_ppo's own config: the defaults every verl-spelled run starts from


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
        if flag not in SELECTION_FLAGS:
            kept.append(argv[i])
        elif sep or i + 1 < len(argv):
            value = value if sep else argv[i + 1]
            i += 0 if sep else 1
            chosen[SELECTION_FLAGS[flag]] = value.strip("'\"")
        else:
            raise ConfigError(f"{flag} needs a value (a folder for --config-path, a config name for --config-name)")
        i += 1
    return kept, chosen


def config_overrides(folder: Path, name: str) -> tuple[list[str], list[str]]:
    """The dotted overrides a user's Hydra config in `folder` holds, composed as Hydra composes it (`_composed`), its
    `hydra:` section (search paths, run folders) left out; and the ones alignrl does not read (a fork's own keys,
    which Hydra merges in and plain verl never reads)."""
    judged = [(f"{k}={v}", reads(k, v)) for k, v in _composed(folder, name.removesuffix(".yaml"), ())]
    return [o for o, read in judged if read], [o for o, read in judged if not read]


def _composed(folder: Path, name: str, within: tuple[str, ...], package: str = "") -> list[tuple[str, str]]:
    """(key, value) of the config `name` in merge order, later ones winning, as Hydra composes its defaults list:
    verl's ppo_trainer gives nothing (alignrl's defaults are its), another config of this folder is composed in its
    place, a group entry `group: option` (`override`/`optional` and `@package` as Hydra reads them) reads
    group/option.yaml of this folder under the group's package, and `_self_` marks where the file's own keys go (the
    end when it is not listed, as Hydra 1.1 composes). A config that names one of verl's own groups is one line."""
    path = folder / f"{name}.yaml"
    data = _read(path, folder, name)
    if name in within:
        raise ConfigError(f"{path}: its defaults compose it again ({' -> '.join((*within, name))})")
    defaults = data.pop("defaults", [BASE] if not within else [])
    data.pop("hydra", None)
    own = _flat(data, package)
    if not isinstance(defaults, list):
        raise ConfigError(f"{path}: defaults must be a list (of configs, group: option entries and _self_)")
    out, placed = [], False
    for entry in defaults:
        if entry == "_self_":
            out, placed = out + own, True
        elif entry in (BASE, "/" + BASE):
            continue  # verl's ppo_trainer: alignrl's defaults are its defaults
        elif isinstance(entry, str) and (folder / f"{entry}.yaml").is_file():
            out += _composed(folder, entry, (*within, name), package)
        elif isinstance(entry, dict) and len(entry) == 1:
            out += _group(folder, path, *next(iter(entry.items())), (*within, name))
        else:
            raise ConfigError(f"{path}: its defaults entry {entry!r} composes a config alignrl cannot read (verl's own "
                              f"or missing); keep `defaults: [{BASE}, _self_]` with configs of {folder}, or put those "
                              "settings in the file or on the command line")
    return out if placed else out + own


def _group(folder: Path, path: Path, group: str, option: object, within: tuple[str, ...]) -> list[tuple[str, str]]:
    """A `group: option` entry of a defaults list: group/option.yaml of `folder` under the group's package."""
    words = str(group).split()
    optional = "optional" in words[:-1]
    group, _, package = words[-1].partition("@")
    if option is None:
        return []  # Hydra's placeholder for an option chosen later
    file = folder / group.strip("/") / f"{option}.yaml"
    if not file.is_file():
        if optional:
            return []
        raise ConfigError(f"{path}: its defaults entry {group}: {option} names {file}, which is not there (one of "
                          "verl's own config groups, which alignrl does not read); put those settings in the file or "
                          "on the command line")
    prefix = (package or group.strip("/").replace("/", ".")).removeprefix("_global_").strip(".")
    return _composed(file.parent, str(option), within, prefix + "." if prefix else "")


def _read(path: Path, folder: Path, name: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"--config-path={folder} --config-name={name}: no such file {path}; give the folder and "
                          "the name of a YAML config (without .yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a Hydra config is a mapping of settings; this file holds a {type(data).__name__}")
    return data


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
