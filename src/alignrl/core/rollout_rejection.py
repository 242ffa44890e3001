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


# verl's divergence filters (rollout_rs=token_k1, seq_mean_k1, ...): a statistic of each token's log-ratio, per token
# or per sequence (sum, mean, max); k1 keeps a band [log lower, log upper], the others keep values up to an upper bound
DIVERGENCE_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3", "binary_kl")


def _divergence(kind: str, trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
    """Per token: k1 = log(pi_rollout / pi_trainer), k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr of lr = log(pi_trainer /
    pi_rollout) bounded to +-MAX_LOG_RATIO, as verl's; binary_kl: the larger of the two Bernoulli KLs between the
    token's probabilities under each (KPop)."""
    lr = _log_ratio(trainer_logp, rollout_logp, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr ** 2
    if kind == "k3":
        return lr.exp() - 1 - lr
    eps = 1e-6
    p = trainer_logp.float().exp().clamp(eps, 1 - eps)
    q = rollout_logp.float().exp().clamp(eps, 1 - eps)

    def bernoulli(a, b):
        return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()
    return torch.maximum(bernoulli(p, q), bernoulli(q, p)).to(lr.dtype)


def _statistic(name: str, per_token: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The option's statistic, per token (B, T), from its kind's per-token values: a token option's own, a sequence
    option's broadcast to its tokens."""
    if name == "binary_kl" or name.startswith("token_"):
        return per_token
    values = per_token.masked_fill(~m, 0.0)
    if name.startswith("seq_sum"):
        seq = values.sum(-1)
    elif name.startswith("seq_mean"):
        seq = values.sum(-1) / m.sum(-1).clamp(min=1)
    else:  # seq_max: an empty row's is 0
        seq = per_token.masked_fill(~m, float("-inf")).max(-1).values
        seq = torch.where(torch.isinf(seq), torch.zeros_like(seq), seq)
    return seq[:, None].expand_as(values)


@torch.no_grad()
def divergence_rejection_mask(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                              options: list[tuple[str, float | None, float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's current rejection sampling: every (option, lower, upper) of `options` must pass for a token (a
    sequence option takes all of a sequence's tokens out together). k1 options keep a statistic within
    [log lower, log upper]; the others one at most upper. Returns (the kept mask (B, T) bool; metrics
    rollout/rs_masked_frac and rollout/rs_seq_masked_frac, as `rejection_mask`'s)."""
    m = mask.bool()
    inside, per_token = torch.ones_like(m), {}
    for name, lower, upper in options:
        if name not in DIVERGENCE_OPTIONS:
            raise ValueError(f"rollout_rs option must be one of {', '.join(DIVERGENCE_OPTIONS)}, got {name!r}")
        kind = "binary_kl" if name == "binary_kl" else name[-2:]
        if kind not in per_token:  # each kind once, however many options read it
            per_token[kind] = _divergence(kind, trainer_logp, rollout_logp, mask)
        stat = _statistic(name, per_token[kind], m)
        if name.endswith("k1"):
            inside &= (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            inside &= stat <= upper
    rejected = m & ~inside
    counted = int(m.sum())
    metrics = {"rollout/rs_masked_frac": float(rejected.sum()) / counted if counted else 0.0,
               "rollout/rs_seq_masked_frac": int(rejected.any(-1).sum()) / len(m) if len(m) else 0.0}
    return m & inside, metrics


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
