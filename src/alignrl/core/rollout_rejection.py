"""Rollout/trainer mismatch, the rejection side (verl 0.7's rollout_corr_helper; Liu, Li, Fu et al. 2025, "When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"): tokens or sequences whose
ratio pi_trainer / pi_rollout leaves a band are taken out of the loss mask, whatever the importance weights do, and
a sequence holding one token the trainer finds far less likely than the engine did is dropped whole (the veto).
Also the batch normalisation of the IS weights (`core.rollout_correction.truncated_is_weights`) to mean 1.

Shapes: trainer_logp, rollout_logp, mask (B, T). Everything here is a constant: no gradient. Left out: the sums of
the batch normalisation across data-parallel ranks, which the caller reduces (`weight_sums` -> `batch_normalized`).
"""

from __future__ import annotations

import math

import torch

from alignrl.core.policy_terms import MAX_LOG_RATIO

REJECTION_LEVELS = ("token", "sequence", "geometric")


def _log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_trainer / pi_rollout) per token, unclamped, 0 off the mask (padding may hold anything)."""
    lr = trainer_logp - rollout_logp.to(trainer_logp.dtype)
    return torch.where(mask.bool(), lr, torch.zeros_like(lr))


@torch.no_grad()
def rejection_mask(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str = "token",
                   threshold: float = 2.0, lower: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rejection sampling (rollout_rs): the ratio of each token (level token), of each sequence (the product
    of its token ratios, level sequence) or the geometric mean of a sequence's token ratios (level geometric), each
    taken as exp of its log bounded to +-MAX_LOG_RATIO as verl's, must lie in [lower, threshold] (lower defaults to
    1/threshold), or the token, or the whole sequence, leaves the mask.

    Returns (the kept mask (B, T) bool; metrics: rollout/rs_masked_frac, the counted tokens rejected, and
    rollout/rs_seq_masked_frac, the sequences of the batch with a rejected token).
    """
    if level not in REJECTION_LEVELS:
        raise ValueError(f"rejection level must be one of {', '.join(REJECTION_LEVELS)}, got {level!r}")
    low = 1.0 / threshold if lower is None else lower
    if threshold <= 0 or low < 0:
        raise ValueError(f"need threshold > 0 and lower >= 0, got {threshold}, {lower}")
    m = mask.bool()
    lr = _log_ratio(trainer_logp, rollout_logp, mask)
    if level == "token":
        log_w = lr
    else:
        log_w = lr.sum(-1, keepdim=True)
        if level == "geometric":
            log_w = log_w / m.sum(-1, keepdim=True).clamp(min=1)  # an empty row: mean 0, ratio 1
        log_w = log_w.expand_as(lr)
    w = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    inside = (w >= low) & (w <= threshold)
    keep = m & inside
    rejected = m & ~inside
    counted = int(m.sum())
    metrics = {"rollout/rs_masked_frac": float(rejected.sum()) / counted if counted else 0.0,
               "rollout/rs_seq_masked_frac": int(rejected.any(-1).sum()) / len(m) if len(m) else 0.0}
    return keep, metrics


@torch.no_grad()
def token_veto(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, threshold: float
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's catastrophic-outlier veto (rollout_token_veto_threshold): a sequence with any counted token whose
    unbounded ratio pi_trainer / pi_rollout is below `threshold` leaves the mask whole; one such token means the
    trainer would push hard on an action the engine, not the policy, chose.

    Returns (the kept mask (B, T) bool; metrics: rollout/veto_frac, the batch's sequences vetoed, and
    rollout/veto_token_frac, the counted tokens below the threshold).
    """
    if threshold <= 0:
        raise ValueError(f"the veto threshold must be > 0, got {threshold}")
    m = mask.bool()
    catastrophic = (_log_ratio(trainer_logp, rollout_logp, mask) < math.log(threshold)) & m
    vetoed = catastrophic.any(-1)
    counted = int(m.sum())
    metrics = {"rollout/veto_frac": int(vetoed.sum()) / len(m) if len(m) else 0.0,
               "rollout/veto_token_frac": float(catastrophic.sum()) / counted if counted else 0.0}
    return m & ~vetoed[:, None], metrics


@torch.no_grad()
def weight_sums(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[float, float]:
    """The sum of the IS weights over the counted units and their number: tokens (level token), or sequences with a
    counted token, each weighing its tokens' mean weight (level sequence), as verl's rollout_is_batch_normalize
    averages them. Summed over ranks, they give the global batch's mean (`batch_normalized`)."""
    m = mask.to(weights.dtype)
    if level == "token":
        return float((weights * m).sum()), float(m.sum())
    rows = m.sum(-1)
    per_seq = (weights * m).sum(-1) / rows.clamp(min=1)
    return float(per_seq[rows > 0].sum()), float((rows > 0).sum())


@torch.no_grad()
def batch_normalized(weights: torch.Tensor, total: float, count: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The IS weights divided by the batch's mean weight total / count (from `weight_sums`, summed over ranks), so
    they average 1 over the batch; a mean of 1e-8 or less (no counted unit) leaves them, as verl's. Returns (weights,
    metrics: rollout/is_batch_norm_factor, the mean divided by)."""
    mean = total / count if count > 0 else 0.0
    if mean <= 1e-8:
        return weights, {"rollout/is_batch_norm_factor": 1.0}
    return weights / mean, {"rollout/is_batch_norm_factor": mean}
