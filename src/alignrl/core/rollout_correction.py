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


# The fraction of tokens (or sequences) whose weight fell outside the bounds, named by what was done to them.
OUTSIDE_KEY = {"truncate": "rollout/is_truncated_frac", "mask": "rollout/is_masked_frac",
               "geo_mask": "rollout/is_masked_frac", "zero": "rollout/is_zeroed_frac"}


@torch.no_grad()
def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         level: str = "token", threshold: float = 2.0, mode: str = "truncate",
                         lower: float | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights pi_trainer / pi_rollout, truncated (TIS; Yao et al. 2025; Ionides 2008,
    "Truncated Importance Sampling") or rejected outside [lower, threshold] (verl's rollout_is_mode=mask).

    level="token": one ratio per token. level="sequence": the product of the token ratios of a
    sequence (a sum of log-ratios), shared by all its tokens. mode="truncate": min(w, threshold), and
    max(w, lower) when `lower` is given (OpenRLHF's tis clamps to [low, high]), every token kept.
    mode="mask": the tokens (or whole sequences) whose weight is above `threshold` or below
    `lower` (default 1/threshold) leave the loss mask, so they count neither in the loss nor in its
    token or sequence count; the others keep their true weight. mode="geo_mask" (level token; OpenRLHF's
    seq-mask-tis): a sequence whose geometric-mean weight (the mean token log-ratio) leaves [lower, threshold]
    leaves the mask whole; the tokens of the others keep their own true weights. mode="zero" (verl's IcePop, its
    lower_upper threshold): weights outside [lower, threshold] are 0 and every token stays in the mask, counted in
    the loss's denominators as verl's response mask keeps them.
    Returns (weights (B, T), 0 outside the kept mask; the kept mask (B, T) bool, to train on instead of
    `mask`; metrics: rollout/is_weight_mean over kept tokens, rollout/is_raw_weight_max, and the tokens or
    sequences truncated or rejected as OUTSIDE_KEY[mode]). Pass the weights as
    `is_weight` to a policy loss.
    """
    if level not in ("token", "sequence") or mode not in OUTSIDE_KEY or (mode == "geo_mask" and level != "token"):
        raise ValueError(f"level must be token|sequence and mode truncate|mask (or geo_mask at token level), got "
                         f"{level!r}, {mode!r}")
    if threshold <= 0 or (lower is not None and not (0 <= lower <= threshold if mode == "zero" else
                                                      0 <= lower < threshold)):
        raise ValueError(f"need threshold > 0 and 0 <= lower < threshold, got {threshold}, {lower}")
    m = mask.to(trainer_logp.dtype)
    log_ratio = (trainer_logp - rollout_logp.to(trainer_logp.dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m
    # a sequence's sum is clamped too: a long sequence of small log-ratios can overflow exp
    seqs = (m.sum(-1) > 0)[:, None] & (torch.arange(m.shape[-1], device=m.device) == 0)  # one unit per sequence
    if level == "sequence":
        log_w, units = log_ratio.sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(m), seqs
    else:
        log_w, units = log_ratio, m.bool()
    raw = log_w.exp()
    if mode == "truncate":
        outside = log_w > math.log(threshold)
        if lower:  # raised to the lower bound too (0 or None: from above only, as verl's TIS)
            outside = outside | (log_w < math.log(lower))
        weights, keep = raw.clamp(min=lower or None, max=threshold) * m, mask.bool()
    else:
        low = 1.0 / threshold if lower is None else lower
        # geo_mask tests each sequence's mean log-ratio, shared by its tokens; mask tests each unit's own weight
        tested = (log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(m) \
            if mode == "geo_mask" else log_w
        outside = (tested > math.log(threshold)) | (tested < (math.log(low) if low > 0 else -math.inf))
        keep = mask.bool() & ~outside
        weights = raw * keep
        if mode == "zero":
            keep = mask.bool()
    decided = seqs if mode == "geo_mask" else units  # what the bounds kept or dropped: geo_mask's are sequences
    any_ = bool(units.any())
    metrics = {
        "rollout/is_weight_mean": float(weights[keep].mean()) if bool(keep.any()) else 1.0,
        "rollout/is_raw_weight_max": float(raw[units].max()) if any_ else 1.0,
        OUTSIDE_KEY[mode]: float(outside[decided].float().mean()) if any_ else 0.0,
    }
    return weights, keep, metrics
