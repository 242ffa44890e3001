"""Constrained RL (Safe RLHF): a Lagrange multiplier on the expected cost and the combined advantage.

PPO-Lagrangian (Ray et al. 2019, "Benchmarking Safe Exploration in Deep RL"; used for LLMs by Dai et
al. 2024, "Safe RLHF"): maximise E[reward] subject to E[cost] <= threshold. The multiplier follows
projected gradient ascent on the constraint violation, lambda <- max(0, lambda + lr (J_c - d)), and the
policy climbs the combined advantage (A_r - lambda A_c) / (1 + lambda), whose scale stays bounded as
lambda grows.
"""

from __future__ import annotations

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
