"""A user's Python file (a reward function, an environment) imported as a module, its failure one line."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from alignrl.errors import UserError


# verl's APIs that users' files import (its tool classes, interactions, dataset class and reward functions), which
# alignrl provides under verl's module names where verl is not installed. One file may hold a tool, a dataset class
# and a reward function together (verl's ReTool recipe), and the first of them to load (the dataset class, as the
# config counts its epochs) must find them all; their providers live in the layers above this one, so they are named
# here and imported when a user's file is. Each provides its modules once, and nothing where verl is installed.
VERL_PROVIDERS = ("alignrl.rollout.verl_tools:verl_tool_modules", "alignrl.rollout.verl_interactions:interaction_api",
                  "alignrl.data.verl_dataset:dataset_base", "alignrl.rewards.registry:provide_verl_rewards")


def provide_verl_apis() -> None:
    """Registers verl's APIs alignrl provides (`VERL_PROVIDERS`) before a user's file is imported. One that cannot
    (an installed verl whose module fails to import) is skipped here: the key whose file needs it says so."""
    for provider in VERL_PROVIDERS:
        module, _, function = provider.partition(":")
        try:
            getattr(importlib.import_module(module), function)()
        except UserError:
            pass


def import_user_file(path: Path, key: str, error: type[Exception], prefix: str, missing_hint: str = "") -> ModuleType:
    """`path` imported as module `prefix` + its resolved path, verl's APIs importable by it (`provide_verl_apis`); a
    failure raises `error` naming `key` in one line, with `missing_hint` after it when what failed was an import
    inside the file."""
    provide_verl_apis()
    module_name = prefix + re.sub(r"\W", "_", str(path.resolve()))
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{key} file {path} cannot be imported (give a .py file)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        hint = f"; {missing_hint}" if missing_hint and isinstance(exc, ImportError) else ""
        raise error(f"{key} file {path} failed to import: {type(exc).__name__}: {exc}".splitlines()[0] + hint) from exc
    return module


def provide_modules(provided: dict[str, dict[str, object]], doc: str) -> None:
    """Registers `provided` ({module name: its members}) under those names, with each missing parent package, so
    that a user's file written against another framework (`from openrlhf.utils.agent import ...`) imports what
    alignrl provides in its place. A module that can be imported is imported, and only given the missing members."""
    for name, members in provided.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            _module(".".join(parts[:i]), doc)
        for key, value in members.items():
            vars(sys.modules[name]).setdefault(key, value)


def _module(name: str, doc: str) -> ModuleType:
    """The module `name`: imported when it can be, else an empty package of that name, set on its parent."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    module = ModuleType(name, doc)
    module.__path__ = []  # a package: its submodules resolve through sys.modules
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, module)
    return module
