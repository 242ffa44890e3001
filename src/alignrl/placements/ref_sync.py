"""The reference moved toward the policy during RL (TR-DPO's reference update, as TRL's GRPO `sync_ref_model` and
verl forks' `actor_rollout_ref.ref.sync_ref_model` do it): after every `actor.ref_sync_steps`-th update every
reference weight becomes α·policy + (1 − α)·reference (α = `actor.ref_mixup_alpha`).

It runs where the reference is a frozen model in the trainer's own processes: a sink beside the policy's, so it sees
each update's weights. A whole copy (one process, or each DDP rank) mixes in the policy's full weights (gathered on
every rank from a policy an engine shards: a collective), so every rank's copy stays the same. A reference sharded over
the ranks beside a sharded policy (`placements.sharded_ref`) is mixed shard by shard: each rank moves its own rows of
each weight toward the same rows of the policy's, read from the policy's own FSDP2 shard where it splits the weight as
the reference does (both FSDP2 dim-0 shards over the same ranks: no communication at all, and the policy's fp32 shards
of a bf16 model are mixed in without first rounding them to bf16), else gathered one weight at a time (DeepSpeed
ZeRO-3) or from the engine's full state, and cut to the rank's rows.

Once moved, the reference is no longer the base model: each checkpoint holds it (`reference/model.safetensors`,
written by rank 0; a sharded one is first gathered there, one weight at a time) and a resumed run loads it back, each
rank of a sharded reference reading only its own rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from alignrl.core.ref_mix import MovingReference
from alignrl.errors import ConfigError
from alignrl.models.sharded_load import first_rows
from alignrl.train.actor import Actor
from alignrl.train.ema_shards import SavedTensors
from alignrl.utils.tracking import console

FOLDER, FILE = "reference", "model.safetensors"


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a reference weight this rank holds: its FSDP2 shard's rows, or the whole of an unsharded one."""
    return p.to_local() if isinstance(p, DTensor) else p


def _my_rows(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The rows of `full` (a full weight of reference weight `p`'s shape) that this rank's part of `p` holds: FSDP2
    splits dim 0 as torch.chunk does (the last ranks' parts may be empty); all of an unsharded weight."""
    if not isinstance(p, DTensor):
        return full
    if p.placements != (Shard(0),):
        raise RuntimeError(f"a sharded reference's weights are FSDP2 dim-0 shards, not {p.placements}")
    local = p.to_local()
    first = first_rows(p, local)
    return full[first:first + local.shape[0]]


def _same_shards(ref: torch.Tensor, policy: torch.Tensor | None) -> bool:
    """Whether the policy's weight is split as the reference's: the policy's own shard then holds this rank's rows."""
    return (isinstance(ref, DTensor) and isinstance(policy, DTensor) and policy.shape == ref.shape
            and policy.placements == ref.placements
            and policy.device_mesh.mesh.tolist() == ref.device_mesh.mesh.tolist())


class ReferenceMix:
    """WeightSink: after every `steps`-th update, the frozen `reference` takes `alpha` of the policy's weights. A
    publish of weights already mixed (the first one after a resume, a fresh run's base weights) changes nothing."""

    def __init__(self, actor: Actor, reference: torch.nn.Module, steps: int, alpha: float):
        self.actor, self.moving = actor, MovingReference(reference, alpha, steps, local=_local)
        self.sharded = any(isinstance(p, DTensor) for p in self.moving.params.values())
        self.gathered: dict[str, torch.Tensor] | None = None  # a sharded reference put together for a checkpoint

    @property
    def mixed_at(self) -> int:
        """The update the reference was last moved at (0: it is the base model)."""
        return self.moving.moved_at

    def publish(self, version: int) -> None:
        if not self.moving.due(version):
            return
        # collective either way: every rank keeps its copy, or its own rows of a sharded reference
        self.moving.mix(self._policy_rows() if self.sharded else self.actor.engine.full_state_dict(), version)

    def _policy_rows(self) -> dict[str, torch.Tensor]:
        """The policy's rows that match this rank's part of each reference weight. Every rank decides the same way
        for each weight (the engines' layouts are the same on all), so the gathers below pair up."""
        policy = dict(self.actor.engine.model.named_parameters())
        params = self.moving.params
        own = {n for n, p in params.items() if _same_shards(p, policy.get(n))}
        zero3 = {n for n in params if n not in own and hasattr(policy.get(n), "ds_tensor")}
        full = (self.actor.engine.full_state_dict() if any(n not in own | zero3 for n in params) else {})
        out = {}
        for n, p in params.items():
            if n in own:
                out[n] = policy[n].to_local()
            elif n in zero3:  # ZeRO-3 partitions: this one weight gathered, this rank's rows kept
                import deepspeed

                with deepspeed.zero.GatheredParameters([policy[n]]):
                    out[n] = _my_rows(p, policy[n].data.reshape(p.shape)).clone()
            else:
                out[n] = _my_rows(p, full[n])
        return out

    def collect(self) -> None:
        """Collective, on every rank as a checkpoint is written (before `save`, which rank 0 alone calls): a sharded
        reference that has moved is put together on rank 0, one weight at a time."""
        if not self.sharded or not self.mixed_at:
            return
        main, whole = dist.get_rank() == 0, {}
        for n, p in self.moving.params.items():
            t = p.full_tensor() if isinstance(p, DTensor) else p  # a collective on every rank
            if main:  # only rank 0 keeps a host copy: the others would hold the whole reference for nothing
                whole[n] = t.detach().cpu().contiguous()
        self.gathered = whole if main else None

    def save(self, folder: Path) -> str | None:
        """Checkpoint writer (rank 0, into the folder being written): the moved reference's weights and the update
        it was moved at (nothing while it is the base model), or why they could not be written."""
        if not self.mixed_at:
            return None
        weights, self.gathered = (self.gathered if self.sharded else self.moving.weights()), None
        if weights is None:
            return "the sharded reference was not gathered for this checkpoint (ReferenceMix.collect)"
        try:
            (folder / FOLDER).mkdir()
            save_file(weights, folder / FOLDER / FILE, metadata=self.moving.record())
        except OSError as e:
            return f"the reference's weights could not be written to {folder / FOLDER} ({e.strerror or e})"
        return None

    def load(self, checkpoint: Path) -> None:
        """The moved reference a checkpoint holds, each rank reading the rows of the weights it holds; one written
        before any sync has none, and the base model stays the reference."""
        path = checkpoint / FOLDER / FILE
        if not path.is_file():
            return
        with safe_open(path, "pt") as f:
            record = f.metadata() or {}
        saved = SavedTensors([path])
        if self.moving.mismatch({n: saved.shape(n) for n in saved.where}) is not None:
            raise ConfigError(f"{path} holds other weights than this run's reference model (its model.path): resume "
                              "with the model that wrote it, or set trainer.resume_mode=disable to start afresh")
        self.moving.take(_saved_rows(saved, self.moving.params), {"moved_at": record.get("mixed_at", "0"), **record})
        console.print(f"reference weights loaded from {path} (moved toward the policy at update {self.mixed_at})",
                      markup=False)
        change = self.moving.change(record, "update")
        if change:
            console.print(change, markup=False)


def _saved_rows(saved: SavedTensors, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each reference weight's rows that this rank holds, read from the saved full weights (only those rows of a
    sharded one)."""
    out = {}
    for n, p in params.items():
        if isinstance(p, DTensor):
            first = first_rows(p, p.to_local())
            out[n] = saved.rows(n, first, first + p.to_local().shape[0])
        else:
            out[n] = saved.full(n)
    return out


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
