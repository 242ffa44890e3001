"""Atomic checkpoints: `checkpoints/global_step_N/{model/, model_state/, trainer_state.pt}` (plus
`critic/`, `critic_state/`... with a critic) and a tracker file.

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

from alignrl.dist.env import SINGLE, DistEnv, barrier

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


def save_checkpoint(ckpt_root: Path, step: int, engines: dict[str, Any], tokenizer, trainer_state: dict[str, Any],
                    keep: int, env: DistEnv = SINGLE) -> Path:
    """Collective: every rank calls it. `engines` maps a folder name to a TrainEngine ("model" for the
    policy, "critic", "cost_critic"): each is saved as a full HF folder plus `<name>_state/` (its resumable
    optimizer state). Rank 0 writes everything except DeepSpeed's per-rank optimizer shards."""
    final = ckpt_root / f"global_step_{step}"
    tmp = ckpt_root / f".global_step_{step}.tmp"  # one name on every rank: DeepSpeed ranks write into it
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    for name, engine in engines.items():
        full = engine.full_state_dict()  # collective
        if env.is_main:
            engine.model.save_pretrained(tmp / name, state_dict=full)
        (tmp / f"{name}_state").mkdir(exist_ok=True)
        engine.save_state(tmp / f"{name}_state")  # collective
    barrier(env)
    if env.is_main:
        tokenizer.save_pretrained(tmp / "model")
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(ckpt_root / TRACKER, str(step))
        steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in ckpt_root.glob("global_step_*") if p.is_dir())
        for old in steps[:-keep]:
            shutil.rmtree(ckpt_root / f"global_step_{old}", ignore_errors=True)
    barrier(env)
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
