"""A user's Python file (a reward function, an environment) imported as a module, its failure one line."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


def import_user_file(path: Path, key: str, error: type[Exception], prefix: str, missing_hint: str = "") -> ModuleType:
    """`path` imported as module `prefix` + its resolved path; a failure raises `error` naming `key` in one line,
    with `missing_hint` after it when what failed was an import inside the file."""
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
