"""Constrained RL (Safe RLHF): a Lagrange multiplier on the expected cost and the combined advantage.

PPO-Lagrangian (Ray et al. 2019, "Benchmarking Safe Exploration in Deep RL"; used for LLMs by Dai et
al. 2024, "Safe RLHF"): maximise E[reward] subject to E[cost] <= threshold. The multiplier follows
projected gradient ascent on the constraint violation, lambda <- max(0, lambda + lr (J_c - d)), and the
policy climbs the combined advantage (A_r - lambda A_c) / (1 + lambda), whose scale stays bounded as
lambda grows.
"""

from __future__ import annotations

import torch


def safe_advantages(reward_adv: torch.Tensor, cost_adv: torch.Tensor, lam: float) -> torch.Tensor:
    """(A_r - lambda A_c) / (1 + lambda); any matching shapes, e.g. (B, T)."""
    return (reward_adv - lam * cost_adv) / (1.0 + lam)


class LagrangeMultiplier:
    """lambda >= 0, updated from the mean episode cost against `threshold`."""

    def __init__(self, init: float = 0.0, lr: float = 0.05, threshold: float = 0.0, max_value: float = 100.0):
        self.value, self.lr, self.threshold, self.max_value = max(0.0, init), lr, threshold, max_value

    def update(self, mean_cost: float) -> float:
        """One ascent step on (J_c - d); returns the new lambda (clamped to [0, max_value])."""
        self.value = min(self.max_value, max(0.0, self.value + self.lr * (mean_cost - self.threshold)))
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
