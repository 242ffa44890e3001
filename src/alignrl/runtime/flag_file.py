"""A YAML file of another tool's flags (`trl grpo --config grpo.yaml`, `trl sft --config sft.yaml`) read as those
flags: its keys are flag names, its values their values, and the flags written on the line after it win, as TRL's
parser takes the file's values as defaults. An `env:` mapping in it is set in the environment first, as TRL does."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from alignrl.errors import ConfigError


def config_at(words: list[str]) -> tuple[int, int, str] | None:
    """(start, end, path) of the line's `--config PATH` / `--config=PATH` words; None when it has none."""
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words):
            return i, i + 2, words[i + 1]
        if word.startswith("--config="):
            return i, i + 1, word.split("=", 1)[1]
    return None


def yaml_mapping(path: str, bad_yaml_is_theirs: bool = True) -> dict[str, Any] | None:
    """The file's top-level mapping; None when it is missing (the line's own reader names it) or not a mapping. A
    file that is not YAML is one line, or None where `bad_yaml_is_theirs` is false (the line's own reader, which
    reads other files too, says what is wrong with it)."""
    file = Path(path)
    if not file.is_file():
        return None
    import yaml

    try:
        loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        if not bad_yaml_is_theirs:
            return None
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"--config {path}: not valid YAML{at} ({getattr(e, 'problem', None) or e}); "
                          "fix the file") from None
    return loaded if isinstance(loaded, dict) else None


def as_words(settings: dict[str, Any], path: str, known: Collection[str] | None, whose: str,
             nullable: Collection[str] = ()) -> list[str]:
    """The settings as the flags that say the same; `env` set in this process's environment (ranks started from it
    inherit it). A key that is not one of the `known` flags is one line naming every such key (None: the line's
    parser names them). A null (TRL's None) of a `nullable` flag, whose default is None, is that default: left out."""
    settings = {k: v for k, v in settings.items() if not (v is None and k in nullable)}
    env = settings.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ConfigError(f"--config {path}: `env` must be a mapping of variable names to values")
    unknown = [] if known is None else sorted(str(k) for k in settings if k not in known)
    if unknown:
        one = len(unknown) == 1
        raise ConfigError(f"--config {path}: {', '.join(unknown)} {'is' if one else 'are'} not among {whose} "
                          f"flags alignrl reads; remove {'it' if one else 'them'} from the file")
    for name, value in env.items():
        os.environ[str(name)] = str(value)
    nulls = sorted(str(k) for k, v in settings.items() if v is None or v == [])
    if nulls:  # TRL reads null as None, which these flags (whose defaults are values) cannot take here
        one = len(nulls) == 1
        raise ConfigError(f"--config {path}: {', '.join(nulls)} {'has' if one else 'have'} no value (null or []), "
                          f"which alignrl cannot take for {'it' if one else 'them'}; give a value or remove the key "
                          "from the file")
    words: list[str] = []
    for name, value in settings.items():
        words.append(f"--{name}")
        if isinstance(value, bool):
            words.append(str(value).lower())
        elif isinstance(value, list):
            words += [json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value]
        elif isinstance(value, dict):
            words.append(json.dumps(value))
        else:
            words.append(str(value))
    return words


def expand(words: list[str], is_theirs: Callable[[dict[str, Any]], bool], known: Collection[str] | None,
           whose: str, bad_yaml_is_theirs: bool = True, nullable: Collection[str] = ()) -> list[str] | None:
    """The line with its `--config` file's settings as flags before its own (which override them), when
    `is_theirs(settings)` says the file is the other tool's; None when the line names no such file."""
    at = config_at(words)
    if at is None:
        return None
    start, end, path = at
    settings = yaml_mapping(path, bad_yaml_is_theirs)
    if settings is None or not is_theirs(settings):
        return None
    return as_words(settings, path, known, whose, nullable) + words[:start] + words[end:]
