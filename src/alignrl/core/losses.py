"""Policy loss, KL estimators and loss aggregation: pure tensor functions.

Shapes: B sequences, T response tokens; `mask` (B, T) is 1 on tokens that count.
Every loss returns `(loss, metrics)` with metrics as plain floats.
"""

from __future__ import annotations

import torch

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: large enough never to bind in practice, small enough to stay finite


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log q (Schulman 2020, "Approximating KL Divergence"): unbiased, high variance."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2 (Schulman 2020): biased, low variance; verl's 'mse'."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(q - p) - (q - p) - 1 (Schulman 2020): unbiased, non-negative; GRPO's 'low_var_kl'."""
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return d.exp() - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "kl": kl_k1, "mse": kl_k2, "low_var_kl": kl_k3}


def token_mean(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float | None = None) -> torch.Tensor:
    """Sum of masked token losses over `global_tokens` (default: this batch's token count).

    Passing the token count of the whole mini-batch makes micro-batch losses add up to exactly the
    mini-batch loss, however the mini-batch is split (DAPO, Yu et al. 2025, token-level loss).
    """
    denom = mask.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=loss.dtype)
    return (loss * mask).sum() / denom.clamp(min=1)


LOSS_AGGREGATIONS = {"token-mean": token_mean}


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high bounds (DAPO clip-higher).

    logp, old_logp (B, T); advantages (B, T) or (B,) broadcast per token; mask (B, T).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = token_mean(per_token, mask, global_tokens)
    with torch.no_grad():
        m = mask.bool()
        metrics = {
            "actor/clipfrac": float((clipped > unclipped)[m].float().mean()) if m.any() else 0.0,
            "actor/ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "actor/approx_kl": float((0.5 * log_ratio**2)[m].mean()) if m.any() else 0.0,
        }
    return loss, metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss}
