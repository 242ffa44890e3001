"""Rollout/trainer mismatch: the inference engine (vLLM, SGLang, a sampler in another precision)
samples from pi_rollout while the trainer computes pi_trainer; the two differ, so the samples are
slightly off-policy even on the first PPO epoch. These functions measure the gap and return
importance weights that correct for it (Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", truncated importance sampling).

Shapes: trainer_logp, rollout_logp, mask (B, T). Everything here is a constant: no gradient.
"""

from __future__ import annotations

import math

import torch

from alignrl.core.losses import KL_ESTIMATORS, MAX_LOG_RATIO


@torch.no_grad()
def rollout_kl(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """KL(pi_rollout || pi_trainer) per token, from tokens sampled by the rollout engine
    (Schulman 2020, "Approximating KL Divergence": k1 = log p - log q, k3 = exp(q - p) - (q - p) - 1
    with p = rollout, q = trainer). (B, T) x 3 -> scalar tensor, the mean over masked tokens.
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")
    m = mask.to(trainer_logp.dtype)
    kl = KL_ESTIMATORS[estimator](rollout_logp.to(trainer_logp.dtype), trainer_logp)
    return (kl * m).sum() / m.sum().clamp(min=1)


@torch.no_grad()
def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         level: str = "token", threshold: float = 2.0, mode: str = "truncate"
                         ) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_trainer / pi_rollout, truncated (TIS; Yao et al. 2025; Ionides 2008,
    "Truncated Importance Sampling") or masked above `threshold`.

    level="token": one ratio per token. level="sequence": the product of the token ratios of a
    sequence (a sum of log-ratios), shared by all its tokens. mode="truncate": min(w, threshold);
    mode="mask": weights above the threshold become 0 (the token or whole sequence is dropped).
    Returns (weights (B, T), 0 outside the mask; metrics: rollout_corr/is_weight_mean after the
    correction, rollout_corr/raw_is_weight_max, rollout_corr/over_threshold_frac over tokens or
    sequences). Pass the weights as `is_weight` to a policy loss.
    """
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        raise ValueError(f"level must be token|sequence and mode truncate|mask, got {level!r}, {mode!r}")
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    m = mask.to(trainer_logp.dtype)
    log_ratio = (trainer_logp - rollout_logp.to(trainer_logp.dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    if level == "sequence":
        # clamp the sum too: a long sequence of small log-ratios can overflow exp
        log_w = log_ratio.sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(m)
        units = m.sum(-1) > 0  # one weight per non-empty sequence
        per_unit = log_w[:, 0][units]
    else:
        log_w = log_ratio
        units = m.bool()
        per_unit = log_w[units]
    over = log_w > math.log(threshold)
    raw = log_w.exp()
    weights = raw.clamp(max=threshold) if mode == "truncate" else raw.masked_fill(over, 0.0)
    weights = weights * m
    any_ = per_unit.numel() > 0
    metrics = {
        "rollout_corr/is_weight_mean": float(weights[m.bool()].mean()) if any_ else 1.0,
        "rollout_corr/raw_is_weight_max": float(per_unit.exp().max()) if any_ else 1.0,
        "rollout_corr/over_threshold_frac": float((per_unit > math.log(threshold)).float().mean()) if any_ else 0.0,
    }
    return weights, metrics
