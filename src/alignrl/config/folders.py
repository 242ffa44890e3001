"""Run folders checked before anything is moved aside or trained: each can be made and written."""

from __future__ import annotations

import os
from pathlib import Path

from alignrl.config.schema import ConfigError


def check_folders(folders: dict[str, Path]) -> None:
    """Each run folder (by the config key or flag that sets it) can be made: no part of its path is a file, which
    would fail only after training. Checked before anything is moved aside or trained."""
    for key, path in folders.items():
        file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            raise ConfigError(f"{key}: {file} is a file, so {path} cannot be a folder; move the file or "
                              f"set {key} to another path")
        problem = unwritable(path)
        if problem:
            raise ConfigError(f"{key}: cannot write under {path} ({problem}); set {key} to a folder you can write")


def unwritable(path: Path) -> str | None:
    """Why nothing can be written in `path` or the nearest folder above it that exists (None: it can): a folder made
    and removed there is the only sure test (root passes access() on read-only and virtual file systems)."""
    import tempfile

    here = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if here is None or here == Path(here.anchor):  # a path whose top does not exist here (a compute node's
        return None  # /scratch seen from a login node) cannot be judged from this machine
    try:
        os.rmdir(tempfile.mkdtemp(dir=here, prefix=".alignrl-write-check-"))
    except OSError as e:
        return f"{here}: {e.strerror or e}"
    return None
