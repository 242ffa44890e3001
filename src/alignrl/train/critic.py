"""The critic of PPO: a value model with its own optimizer, trained on GAE returns with clipping."""

from __future__ import annotations

import torch

from alignrl.core.losses import value_loss
from alignrl.data.collate import per_token_in_chunks
from alignrl.data.records import Experience, Rollout
from alignrl.models.value import response_values
from alignrl.train.minibatch import minibatch_updates
from alignrl.train.optim import build_optimizer


class Critic:
    def __init__(self, model, *, lr: float, weight_decay: float, betas, warmup_steps: int, total_steps: int,
                 grad_clip: float, cliprange_value: float | None, name: str = "critic"):
        self.model, self.name = model, name  # name prefixes the metrics: critic/..., cost_critic/...
        self.optimizer, self.scheduler = build_optimizer(model.parameters(), lr, weight_decay, betas, warmup_steps,
                                                         total_steps, "constant", 0.0)
        self.grad_clip, self.cliprange_value = grad_clip, cliprange_value

    def values(self, ro: Rollout, micro_batch: int) -> torch.Tensor:
        """Values (B, R) of the rollout's states, in length-grouped, trimmed chunks."""
        return per_token_in_chunks(self.model, response_values, ro.prompt_ids, ro.prompt_mask, ro.response_ids,
                                   ro.response_mask, micro_batch)

    def update(self, exp: Experience, old_values: torch.Tensor, returns: torch.Tensor, mini_batch: int,
               micro_batch: int, epochs: int, generator: torch.Generator) -> dict[str, float]:
        """`old_values`, `returns` (B, R) aligned with `exp`'s responses."""
        self.model.train()

        def micro_loss(rows, micro: Experience, tokens: float, seqs: float):
            r1 = micro.response_ids.shape[1]
            v = response_values(self.model, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                micro.response_mask)
            loss, m = value_loss(v, old_values[rows, :r1], returns[rows, :r1], micro.response_mask.float(),
                                 self.cliprange_value, tokens)
            return loss, {self.name + k.removeprefix("critic"): x for k, x in m.items()}

        return minibatch_updates(exp, micro_loss, self.optimizer, self.scheduler, self.model.parameters(),
                                 self.grad_clip, mini_batch, micro_batch, epochs, generator, self.name)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
