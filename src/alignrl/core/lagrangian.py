"""Constrained RL (Safe RLHF): a Lagrange multiplier on the expected cost and the combined advantage.

PPO-Lagrangian (Ray et al. 2019, "Benchmarking Safe Exploration in Deep RL"; used for LLMs by Dai et
al. 2024, "Safe RLHF"): maximise E[reward] subject to E[cost] <= threshold. The multiplier ascends the
constraint violation in log space, as Safe RLHF's trainer does, log lambda <- log lambda + lr (J_c - d) lambda
(one SGD step on -(J_c - d) lambda), with J_c the mean cost of the latest episodes; the policy climbs the
combined advantage (A_r - lambda A_c) / (1 + lambda), whose scale stays bounded as lambda grows.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from alignrl.core.advantages import SumRanks, gae_advantages, masked_whiten


def safe_advantages(reward_adv: torch.Tensor, cost_adv: torch.Tensor, lam: float) -> torch.Tensor:
    """(A_r - lambda A_c) / (1 + lambda); any matching shapes, e.g. (B, T)."""
    return (reward_adv - lam * cost_adv) / (1.0 + lam)


def safe_gae_advantages(reward_tokens: torch.Tensor, cost_tokens: torch.Tensor, kl_tokens: torch.Tensor | None,
                        values: torch.Tensor, cost_values: torch.Tensor, mask: torch.Tensor, lam: float,
                        gamma: float = 1.0, gae_lambda: float = 1.0, whiten: bool = True, sum_ranks: SumRanks = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-Lagrangian's advantages (B, T), and the returns of the reward and cost critics.

    `kl_tokens` is the KL penalty per token already in `reward_tokens` (-beta KL), or None. It is taken
    out of the cost too, as Safe RLHF does, so the combined advantage carries the penalty at weight beta
    whatever lambda is: in the reward alone it was divided by 1 + lambda, and the KL term weakened just as
    the constraint started to bind. (Safe RLHF puts half in each, so its `kl_coeff` weighs beta / 2 here.)
    The two advantages are combined raw and whitened once: whitening the cost advantage alone blew the
    cost critic's noise up to unit scale when the costs carried no signal (every row safe)."""
    if kl_tokens is not None:
        cost_tokens = cost_tokens - kl_tokens
    adv, returns = gae_advantages(reward_tokens, values, mask, gamma, gae_lambda)
    cost_adv, cost_returns = gae_advantages(cost_tokens, cost_values, mask, gamma, gae_lambda)
    adv = safe_advantages(adv, cost_adv, lam)
    if whiten:
        adv = masked_whiten(adv, mask.to(adv.dtype), sum_ranks=sum_ranks)
    return adv, returns, cost_returns


class LagrangeMultiplier:
    """lambda > 0 as Safe RLHF keeps it (`log_lambda`, its SGD optimizer, `lambda_max`,
    `lambda_update_delay_steps`, `episode_cost_window_size`): once `delay_steps` steps have passed, each step
    takes one step of size `lr` on log lambda against the mean cost of the last `window` episodes, then caps
    lambda at `max_value` (None: at e^LOG_CAP, where exp would soon overflow: the step grows with lambda, so a
    constraint violated for a few dozen steps would otherwise end the run)."""

    LOG_CAP = 50.0

    def __init__(self, init: float = 1.0, lr: float = 0.1, threshold: float = 0.0, max_value: float | None = 100.0,
                 delay_steps: int = 0, window: int = 128):
        if init <= 0:
            raise ValueError(f"init must be > 0 (lambda is kept as log lambda), got {init}")
        self.log_init, self.lr, self.threshold = math.log(init), lr, threshold
        self.log_value = self.log_init
        self.log_max = self.LOG_CAP if max_value is None else min(math.log(max_value), self.LOG_CAP)
        self.delay_steps, self.costs = delay_steps, deque(maxlen=window)

    @property
    def value(self) -> float:
        return math.exp(self.log_value)

    def update(self, step: int, costs: list[float]) -> float:
        """`costs`: the episode costs of RL step `step` (1-based; every rank's). Returns lambda for this
        step's advantages."""
        self.costs.extend(costs)
        if step > self.delay_steps and self.costs:
            violation = sum(self.costs) / len(self.costs) - self.threshold
            self.log_value += self.lr * violation * self.value  # d/d(log lambda) of (J_c - d) * lambda
            self.log_value = min(self.log_value, self.log_max)
        return self.value

    def state_dict(self) -> dict:
        return {"log_value": self.log_value, "costs": list(self.costs)}

    def load_state_dict(self, state: dict) -> None:
        if "log_value" not in state:  # a checkpoint of the linear multiplier, which kept lambda >= 0: its 0 (the
            value = float(state["value"])  # constraint inactive) cannot be a log, and a tiny lambda would never move
            state = {"log_value": math.log(value) if value > 0 else self.log_init, "costs": []}
        self.log_value = float(state["log_value"])
        self.costs.clear()
        self.costs.extend(float(c) for c in state["costs"])
