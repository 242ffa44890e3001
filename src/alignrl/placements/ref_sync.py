"""The reference moved toward the policy during RL (TR-DPO's reference update, as TRL's GRPO `sync_ref_model` and
verl forks' `actor_rollout_ref.ref.sync_ref_model` do it): after every `actor.ref_sync_steps`-th update every
reference weight becomes α·policy + (1 − α)·reference (α = `actor.ref_mixup_alpha`).

It runs where the reference is a frozen copy in the trainer's own processes (one process, or each torchrun rank with
its own copy): a sink beside the policy's, so it sees each update's weights, gathered in full from a sharded policy
on every rank (a collective), and so every rank's copy stays the same. Once moved, the reference is no longer the base
model: each checkpoint holds it (`reference/model.safetensors`) and a resumed run loads it back.
"""

from __future__ import annotations

from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from alignrl.core.ref_mix import MovingReference
from alignrl.errors import ConfigError
from alignrl.train.actor import Actor
from alignrl.utils.tracking import console

FOLDER, FILE = "reference", "model.safetensors"


class ReferenceMix:
    """WeightSink: after every `steps`-th update, the frozen `reference` takes `alpha` of the policy's weights. A
    publish of weights already mixed (the first one after a resume, a fresh run's base weights) changes nothing."""

    def __init__(self, actor: Actor, reference: torch.nn.Module, steps: int, alpha: float):
        self.actor, self.moving = actor, MovingReference(reference, alpha, steps)

    @property
    def mixed_at(self) -> int:
        """The update the reference was last moved at (0: it is the base model)."""
        return self.moving.moved_at

    def publish(self, version: int) -> None:
        if self.moving.due(version):
            self.moving.mix(self.actor.engine.full_state_dict(), version)  # collective: every rank keeps its copy

    def save(self, folder: Path) -> str | None:
        """Checkpoint writer (rank 0, into the folder being written): the moved reference's weights and the update
        it was moved at (nothing while it is the base model), or why they could not be written."""
        weights = self.moving.weights()
        if weights is None:
            return None
        try:
            (folder / FOLDER).mkdir()
            save_file(weights, folder / FOLDER / FILE, metadata=self.moving.record())
        except OSError as e:
            return f"the reference's weights could not be written to {folder / FOLDER} ({e.strerror or e})"
        return None

    def load(self, checkpoint: Path) -> None:
        """The moved reference a checkpoint holds; one written before any sync has none, and the base model stays
        the reference."""
        path = checkpoint / FOLDER / FILE
        if not path.is_file():
            return
        with safe_open(path, "pt") as f:
            record = f.metadata() or {}
        if self.moving.restore(load_file(path), {"moved_at": record.get("mixed_at", "0"), **record}) is not None:
            raise ConfigError(f"{path} holds other weights than this run's reference model (its model.path): resume "
                              "with the model that wrote it, or set trainer.resume_mode=disable to start afresh")
        console.print(f"reference weights loaded from {path} (moved toward the policy at update {self.mixed_at})",
                      markup=False)
        change = self.moving.change(record, "update")
        if change:
            console.print(change, markup=False)


def reference_mix(actor: Actor, reference, steps: int, alpha: float, resume: Path | None
                  ) -> ReferenceMix | None:
    """The sink moving `reference` (a LocalRefScorer's model) toward the policy, with a resumed run's reference
    loaded; None when actor.ref_sync_steps is 0 (a checkpoint whose reference moved is then one line: resuming
    against the base model would change the KL term's anchor without a word)."""
    if reference is None:
        return None
    if steps <= 0:
        if resume is not None and (resume / FOLDER / FILE).is_file():
            raise ConfigError(f"{resume} holds a reference moved toward the policy (actor.ref_sync_steps): resume "
                              "with actor.ref_sync_steps set, or set trainer.resume_mode=disable to start afresh")
        return None
    mix = ReferenceMix(actor, reference.model, steps, alpha)
    if resume is not None:
        mix.load(resume)
    return mix
