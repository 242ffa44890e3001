"""KL to the reference policy as a per-token reward penalty, and its coefficient controllers.

The other use of KL, as a loss term, is `losses.KL_ESTIMATORS` averaged with a loss aggregation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from alignrl.core.losses import KL_ESTIMATORS


@torch.no_grad()
def kl_penalty_rewards(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                       coef: float, estimator: str | Callable = "k1") -> tuple[torch.Tensor, dict[str, float]]:
    """r_t - coef * KL_t on every masked token (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences"; Ouyang et al. 2022, InstructGPT).

    token_rewards, logp, ref_logp, mask (B, T) -> (rewards (B, T), metrics). `estimator` is a
    KL_ESTIMATORS key or a function (logp, ref_logp) -> (B, T). Rewards are constants: no gradient.
    metrics: actor/reward_kl_penalty (per-sequence token mean of KL, averaged over sequences: the
    value to feed a KL controller) and actor/reward_kl_penalty_coeff.
    """
    fn = KL_ESTIMATORS[estimator] if isinstance(estimator, str) else estimator
    m = mask.to(token_rewards.dtype)
    kl = fn(logp, ref_logp) * m
    has_tokens = m.sum(-1) > 0
    per_seq = kl.sum(-1) / m.sum(-1).clamp(min=1)
    current = float(per_seq[has_tokens].mean()) if has_tokens.any() else 0.0
    return token_rewards - coef * kl, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": coef}


class FixedKLController:
    """A constant KL coefficient (Ziegler et al. 2019); `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {}  # nothing moves: a resumed run takes its coefficient from its own config, changed or not

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        pass


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", section 2.2): beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon).

    `n_steps` is the number of samples (or steps) since the last update; `horizon` sets how fast
    beta moves.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """The coefficient reached so far; none saved (the run had no KL penalty until now): the initial one."""
        if state and "value" in state:
            self.value = float(state["value"])

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

