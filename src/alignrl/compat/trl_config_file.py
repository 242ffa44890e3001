"""TRL's YAML config file (`trl grpo --config grpo.yaml`, as TRL's and open-r1's recipes are run) on
`alignrl train grpo`: its keys are TRL's flag names, its values their values, and flags on the line win over it, as
TRL's parser takes the file's values as defaults. An `env:` mapping in it is set in the environment first, as TRL
does. A `--config` file with no TRL settings (an alignrl or verl YAML) is left where it is.

    alignrl train grpo --config recipes/grpo.yaml --learning_rate 1e-6
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from alignrl.compat.trl_grpo_flags import TrlFlagError

# alignrl's own top-level sections (and verl's): a file holding one is not TRL's
NOT_TRL = ("model", "data", "rollout", "actor", "algorithm", "critic", "safety", "services", "pipeline", "agent",
           "retriever", "sandbox", "ptx", "trainer", "actor_rollout_ref", "reward_model", "custom_reward_function")


def config_at(words: list[str]) -> tuple[int, int, str] | None:
    """(start, end, path) of the line's `--config PATH` / `--config=PATH` words; None when it has none."""
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words):
            return i, i + 2, words[i + 1]
        if word.startswith("--config="):
            return i, i + 1, word.split("=", 1)[1]
    return None


def trl_settings(path: str, flag_names: set[str]) -> dict[str, Any] | None:
    """The file's settings when it is TRL's (a mapping of TRL's flag names, none of alignrl's sections); None for
    any other YAML. A file that cannot be read is one line."""
    file = Path(path)
    if not file.is_file():
        return None  # left to the line's own reader, which names the missing file
    import yaml

    try:
        loaded = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise TrlFlagError(f"--config {path}: not valid YAML{at} ({getattr(e, 'problem', None) or e}); "
                           "fix the file") from None
    if not isinstance(loaded, dict) or any(k in NOT_TRL for k in loaded):
        return None
    return loaded if any(k in flag_names or k == "env" for k in loaded) else None


def as_words(settings: dict[str, Any], path: str, flag_names: set[str]) -> list[str]:
    """TRL's settings as the flags that say the same; `env` set in this process's environment (ranks started from
    it inherit it). A key that is not a TRL flag is one line naming every such key."""
    settings = dict(settings)
    env = settings.pop("env", None) or {}
    if not isinstance(env, dict):
        raise TrlFlagError(f"--config {path}: `env` must be a mapping of variable names to values")
    unknown = sorted(str(k) for k in settings if k not in flag_names)
    if unknown:
        raise TrlFlagError(f"--config {path}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
                           "among TRL's GRPO flags alignrl reads (docs/trl.md lists them); remove "
                           f"{'it' if len(unknown) == 1 else 'them'} from the file")
    for name, value in env.items():
        os.environ[str(name)] = str(value)
    words: list[str] = []
    for name, value in settings.items():
        if value is None:
            continue  # TRL's default
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


def grpo_flag_names() -> set[str]:
    from alignrl.compat.trl_grpo_flags import parser

    return {a.dest for a in parser()._actions} - {"help", "config"}


def expand(words: list[str], flag_names: set[str] | None = None) -> list[str] | None:
    """The line with its TRL config file's settings as flags before its own (which override them); None when the
    line names no TRL config file."""
    flag_names = grpo_flag_names() if flag_names is None else flag_names
    at = config_at(words)
    if at is None:
        return None
    start, end, path = at
    settings = trl_settings(path, flag_names)
    if settings is None:
        return None
    return as_words(settings, path, flag_names) + words[:start] + words[end:]
