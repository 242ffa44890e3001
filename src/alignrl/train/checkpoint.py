"""Atomic checkpoints: `checkpoints/global_step_N/{model/, trainer_state.pt}` plus a tracker file.

A checkpoint is written into a temporary folder and renamed into place, and the tracker
(`latest_checkpointed_iteration.txt`, verl's name) is replaced atomically after it, so a run killed
at any moment leaves the previous checkpoint intact and the tracker never points at a partial one.
The trainer state holds everything a resumed run needs to continue bit-for-bit: optimizer,
scheduler, RNG states, data position, step and counters.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(ckpt_root: Path, step: int, model, tokenizer, trainer_state: dict[str, Any],
                    keep: int, extra_models: dict[str, Any] | None = None) -> Path:
    """`extra_models` (e.g. {"critic": value_model}) are saved as HF folders beside `model/`."""
    final = ckpt_root / f"global_step_{step}"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckpt_root, prefix=f".global_step_{step}."))
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    for name, extra in (extra_models or {}).items():
        extra.save_pretrained(tmp / name)
    torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckpt_root / TRACKER, str(step))
    steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in ckpt_root.glob("global_step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(ckpt_root / f"global_step_{old}", ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    tracker = ckpt_root / TRACKER
    if not tracker.is_file():
        return None
    path = ckpt_root / f"global_step_{tracker.read_text().strip()}"
    return path if (path / "trainer_state.pt").is_file() else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    # Our own file, written by save_checkpoint; it holds optimizer tensors and RNG states.
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)
