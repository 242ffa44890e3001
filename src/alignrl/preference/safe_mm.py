"""Safe-MM-DPO at run time: the judges' margins per micro-batch, the multiplier λ between optimizer steps, and its
state in the saved folder. The math is `alignrl.core.safe_mm_dpo`'s; this module feeds it and keeps λ identical on
every rank (the expected cost is summed over the step's micro-batches and over ranks before λ moves).

The harmlessness judge's column in the scorers' table is a cost C (higher = more harmful: a cost model's score, or
minus a harmlessness reward model's); the loss's safety score is S = -C.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from alignrl.config import ConfigError
from alignrl.core.safe_mm_dpo import LagrangeState, expected_cost

STATE_FILE = "safe_mm_dpo_state.json"  # λ and its cost average, beside the saved policy


class LambdaSchedule:
    """λ of one run: read by every micro-batch's loss, moved after every optimizer step (`after_step`)."""

    def __init__(self, cfg, env, log):
        self.cfg, self.env = cfg, env
        self.state = LagrangeState(cfg.lambda_init)
        self.sums = [0.0, 0.0]  # expected cost summed over this step's pairs, and their number
        restored = Path(cfg.model_path) / STATE_FILE
        if restored.is_file():  # a policy saved by an earlier Safe-MM-DPO run goes on with its λ
            try:
                self.state.load_state_dict(json.loads(restored.read_text()))
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{restored} is unreadable ({type(e).__name__}); delete it to start from "
                                  f"λ_init={cfg.lambda_init}") from None
            log.print(f"λ restored from {restored}: {self.state.value:.6g} after {self.state.updates} updates")

    def loss_kwargs(self, scores: torch.Tensor, pc: torch.Tensor, pr: torch.Tensor) -> dict:
        """The judges' keywords of `safe_mm_dpo_loss` for a micro-batch whose table rows are `scores` (B, 4:
        help_chosen, help_rejected, cost_chosen, cost_rejected), counting its expected cost toward this step."""
        s, n = expected_cost(pc, pr, scores[:, 2], scores[:, 3])
        self.sums[0] += s
        self.sums[1] += n
        c = self.cfg
        return dict(help_chosen=scores[:, 0], help_rejected=scores[:, 1], safety_chosen=-scores[:, 2],
                    safety_rejected=-scores[:, 3], safety_lambda=self.state.value, w=c.beta_w, k=c.beta_k,
                    kl_coeff=c.kl_coeff)

    def after_step(self, step: int) -> dict[str, float]:
        """Collective: the global batch's mean expected cost moves λ the same way on every rank."""
        from alignrl.runtime.env import all_reduce_sum

        total, n = all_reduce_sum(self.env, self.sums)
        self.sums = [0.0, 0.0]
        if n > 0:
            self.state.step(total / n, self.cfg.lambda_lr, self.cfg.cost_threshold)
        return {"lambda": self.state.value, "lambda_cost_ema": float(self.state.cost_ema or 0.0),
                "expected_cost": total / max(n, 1.0)}

    def files(self) -> dict[str, dict]:
        """The JSON files the saved folder carries."""
        return {STATE_FILE: self.state.state_dict()}
