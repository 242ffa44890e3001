"""The critic of PPO: a value model with its own optimizer, trained on GAE returns with clipping."""

from __future__ import annotations

import torch

from alignrl.core.losses import value_loss
from alignrl.data.collate import per_token_in_chunks
from alignrl.data.records import Experience, Rollout
from alignrl.models.value import response_values
from alignrl.runtime.lanes import lane_count
from alignrl.train.minibatch import TokenBudget, minibatch_updates
from alignrl.interfaces import TrainEngine


class Critic:
    def __init__(self, engine: TrainEngine, *, cliprange_value: float | None, name: str = "critic",
                 remove_padding: bool = False, lanes: int = 1, normalization: tuple[float, float] = (0.0, 1.0)):
        """`lanes`: micro-batches side by side on a CPU (trainer.cpu_lanes, `runtime.lanes`). `normalization`:
        (mean, std) the head's outputs are normalized by, in training as in scoring (OpenRLHF's critic with
        --normalize_reward: a critic initialised from a reward model predicts on its normalized scale)."""
        self.engine, self.model, self.name = engine, engine.model, name  # name prefixes metrics: critic/...
        self.cliprange_value, self.remove_padding, self.lanes = cliprange_value, remove_padding, lanes
        self.shift, self.scale = normalization

    def _values(self, model, *tensors, images=None) -> torch.Tensor:
        v = response_values(model, *tensors, remove_padding=self.remove_padding, images=images)
        return v if (self.shift, self.scale) == (0.0, 1.0) else (v - self.shift) / self.scale

    def values(self, ro: Rollout, micro_batch: int) -> torch.Tensor:
        """Values (B, R) of the rollout's states, in length-grouped, trimmed chunks."""
        return per_token_in_chunks(self.model, self._values, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask, micro_batch, images=ro.images,
                                   lanes=lane_count(self.lanes, self.engine.env.device))

    def update(self, exp: Experience, old_values: torch.Tensor, returns: torch.Tensor, mini_batch: int,
               micro_batch: int | TokenBudget, epochs: int, generator: torch.Generator) -> dict[str, float]:
        """`old_values`, `returns` (B, R) aligned with `exp`'s responses."""
        self.engine.module.train()

        def micro_loss(rows, micro: Experience, tokens: float, seqs: float):
            r1 = micro.response_ids.shape[1]
            # observations are attended; the loss mask leaves them out
            v = self._values(self.engine.module, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                             micro.attended, images=micro.images)
            loss, m = value_loss(v, old_values[rows, :r1].to(v.device), returns[rows, :r1].to(v.device),
                                 micro.response_mask.float(),
                                 self.cliprange_value, tokens)
            return loss, {self.name + k.removeprefix("critic"): x for k, x in m.items()}

        return minibatch_updates(exp, micro_loss, self.engine, mini_batch, micro_batch, epochs, generator, self.name,
                                 lanes=lane_count(self.lanes, self.engine.env.device))
