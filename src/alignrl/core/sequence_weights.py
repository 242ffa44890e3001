"""Per-sequence weights and masks on the policy term: VESPO's gamma weight of the sequence's importance ratio and its
loss, and the off-policy sequence mask of DeepSeek-V3.2 (OPSM). Pure tensor functions.

Shapes: B sequences, T response tokens; `mask` (B, T) is 1 on the tokens that count; advantages (B, T), or (B, 1)
for one per sequence (both broadcast against the (B, 1) sequence quantities).
"""

from __future__ import annotations

import math

import torch

from alignrl.core.policy_terms import MAX_LOG_RATIO, finish_loss, per_token_advantages, ratio_metrics

LOG_W_FLOOR = math.log(1e-8)  # the bound below of VESPO's log sequence weight (TRL's get_gamma_weights)
LAMBDA_FLOOR = 1e-4  # VESPO's rate is kept above this, as TRL's


def gamma_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  shape_rate: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
                  sampling_weight: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's detached weight phi(w) = e^lambda * w^k * e^(-lambda w), 1 at w = 1, from the sequence's importance
    ratio w = exp(sum of its token log-ratios), the sum clamped to [log 1e-8, 20] (each token's to +-20 first).

    log_ratio (B, T): log pi - log pi_old; advantages (B, T) or (B, 1); `shape_rate` = (k, lambda) where the
    advantage is >= 0, then (k, lambda) elsewhere. `sampling_weight` (B, T): a rollout-correction weight pi_old /
    pi_rollout per token, folded into w in log space (TRL folds its vLLM IS ratio in so) instead of multiplying the
    loss. Returns (B, T) or (B, 1) as the advantages broadcast; never a path for gradients.
    """
    k_pos, lam_pos, k_neg, lam_neg = shape_rate
    with torch.no_grad():
        m = mask.float()
        seq = (log_ratio.float().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * m).sum(-1, keepdim=True)
        if sampling_weight is not None:  # clamped before the mask: a rejected token's 0 weight is no -inf * 0
            seq = seq + (sampling_weight.float().log().clamp(LOG_W_FLOOR, MAX_LOG_RATIO) * m).sum(-1, keepdim=True)
        log_w = seq.clamp(LOG_W_FLOOR, MAX_LOG_RATIO)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg).float()
        lam = torch.where(nonneg, lam_pos, lam_neg).float().clamp(min=LAMBDA_FLOOR)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).to(log_ratio.dtype)


def vespo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
               shape_rate: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
               sampling_weight: torch.Tensor | None = None, is_weight: torch.Tensor | None = None,
               loss_agg: str = "token-mean", global_seqs: float | None = None, max_len: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """VESPO's policy term, as TRL's loss_type vespo: -sg[phi(w)] * A * log pi per token (`gamma_weights`), no
    ratio and no clip (the clip arguments are taken for the common call and unused). Its value is not a surrogate's;
    its gradient is phi * A * grad log pi. `sampling_weight`: the rollout-correction weights, which enter phi rather
    than the per-token loss; `is_weight` (B, T) multiplies the per-token loss (here the masks of the policy term)."""
    adv = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    phi = gamma_weights(log_ratio, adv, mask, shape_rate, sampling_weight)
    metrics = ratio_metrics(log_ratio, log_ratio.exp(), torch.zeros_like(mask, dtype=torch.bool), mask)
    m = mask.to(logp.dtype)
    rows = m.sum(-1) > 0
    per_row = (phi * m).sum(-1) / m.sum(-1).clamp(min=1)
    metrics["actor/vespo_phi_mean"] = float(per_row[rows].mean()) if rows.any() else 1.0
    return finish_loss(-phi * adv * logp, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len), metrics


def sampling_gap(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean over its counted tokens of log pi_rollout - log pi_old (B,): what the off-policy mask
    adds to the mean of log pi_old - log pi it measures in each micro-batch, so that it reads the rollout engine's
    log-probs as TRL reads vLLM's (0 where old_logp are the rollout's own)."""
    m = mask.to(old_logp.dtype)
    return ((rollout_logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)


def off_policy_keep(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    threshold: float, gap: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's get_off_policy_mask): 0 where the advantage is negative and
    the sequence's mean over its counted tokens of log pi_sampling - log pi (detached) exceeds `threshold`, 1
    elsewhere. log pi_sampling = old_logp + `gap` (B,) (`sampling_gap`; None: old_logp are the sampler's).

    logp, old_logp, mask (B, T); advantages (B,), (B, 1) or (B, T) -> (B, 1) for sequence advantages, else (B, T)."""
    m = mask.to(logp.dtype)
    seq_kl = ((old_logp - logp.detach()) * m).sum(-1) / m.sum(-1).clamp(min=1)
    if gap is not None:
        seq_kl = seq_kl + gap.to(seq_kl.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    return ((adv >= 0) | (seq_kl[:, None] <= threshold)).to(logp.dtype)


def masked_share(keep: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of the sequences with counted tokens that the mask `keep` (B, 1) or (B, T) leaves a token out of."""
    rows = mask.sum(-1) > 0
    if not rows.any():
        return 0.0
    dropped = ((keep.expand_as(mask) == 0) & mask.bool()).any(-1)
    return float(dropped[rows].float().mean())
