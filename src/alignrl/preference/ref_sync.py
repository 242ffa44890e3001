"""TR-DPO's reference syncing in `alignrl train dpo` (`sync_ref_model`, TRL's SyncRefModelCallback): after every
optimizer step whose number is a multiple of `ref_model_sync_steps`, each weight of the frozen reference copy becomes
α·policy + (1 - α)·reference, α = `ref_model_mixup_alpha` (`core.ref_mix`).

The policy's weights are read as the engine gathers them for a save (`full_state_dict`: whole tensors on every rank,
whatever the engine shards), with LoRA adapters folded in when the policy trains adapters beside a separate reference
(`ref_model_path`). Every rank holds its own full reference copy and mixes the same gathered weights into it, so the
copies stay identical without further communication. A synced reference is no longer the initial weights, so
checkpoints carry it (`preference.checkpoints`) and a resumed run goes on from it.
"""

from __future__ import annotations

import torch

from alignrl.config import ConfigError
from alignrl.core.ref_mix import MovingReference


class ReferenceSync:
    """Moves `reference` (a frozen module) toward the policy every `cfg.ref_model_sync_steps` optimizer steps."""

    def __init__(self, cfg, reference: torch.nn.Module, policy: torch.nn.Module, log):
        self.moving, self.log = MovingReference(reference, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps), log
        self.lora_policy = None  # the peft model whose adapters fold into the weights mixed in, with use_lora
        self._check_shapes(cfg, policy)

    @property
    def every(self) -> int:
        return self.moving.every

    @property
    def synced_at(self) -> int:
        """The step of the latest sync; 0: the reference is still the initial weights."""
        return self.moving.moved_at

    def _check_shapes(self, cfg, policy: torch.nn.Module) -> None:
        """Before any engine shards the policy: every reference weight has a policy weight of its name and shape."""
        shapes = {k: v.shape for k, v in policy.state_dict().items()}
        for name, p in self.moving.params.items():
            if shapes.get(name) != p.shape:
                got = "no such weight" if name not in shapes else f"shape {tuple(shapes[name])}"
                raise ConfigError(f"sync_ref_model: ref_model_path={cfg.ref_model_path} does not match model_path="
                                  f"{cfg.model_path} ({name}: {tuple(p.shape)} there, {got} in the policy), so the "
                                  "two cannot be mixed; give a reference of the policy's architecture and size")

    def after_step(self, step: int, engine) -> None:
        """Collective when it syncs (the engine gathers the policy's weights on every rank)."""
        if not self.moving.due(step):
            return
        state = engine.full_state_dict()
        if self.lora_policy is not None:
            from alignrl.models.lora import merged_state_dict

            state = merged_state_dict(self.lora_policy, state)
        self.moving.mix(state, step)
        alpha = self.moving.alpha
        self.log.print(f"step {step}: reference ← {alpha:g}·policy + {1 - alpha:g}·reference")

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The reference's weights for a checkpoint, host copies; None while it is still the initial weights."""
        return self.moving.weights()

    def record(self) -> dict[str, str]:
        """The step of the latest sync and the mix, for a checkpoint's state."""
        return self.moving.record()

    def load(self, weights: dict[str, torch.Tensor], record: dict[str, str], source: str) -> None:
        """Restores what `weights` and `record` gave a checkpoint, saying when this run mixes otherwise."""
        name = self.moving.restore(weights, record)
        if name is not None:
            raise ConfigError(f"resume_from={source}: its reference was saved from another model ({name} does not "
                              "match); resume with the config that wrote it")
        change = self.moving.change(record, "optimizer step")
        if change:
            self.log.print(change)
