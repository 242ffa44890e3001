"""Policy losses, value loss and KL estimators: pure tensor functions.

Shapes: B sequences, T response tokens; `mask` (B, T) is 1 on tokens that count.
Every loss returns `(loss, metrics)` with metrics as plain floats, taken over this batch's tokens.

Every policy loss shares the call `(logp, old_logp, advantages, mask, clip_low, clip_high,
global_tokens)`, plus keywords: `loss_agg` (a LOSS_AGGREGATIONS key), `global_seqs` and `max_len`
for the seq-* aggregations, and `is_weight` (B, T), a per-token importance weight (e.g. truncated
IS against the rollout engine, see `rollout_correction`) that multiplies the per-token loss.
"""

from __future__ import annotations

import torch

from alignrl.core.aggregation import LOSS_AGGREGATIONS, aggregate_loss, token_mean
from alignrl.core.covariance_losses import clip_cov_loss, kl_cov_loss
from alignrl.core.divergence_losses import dppo_kl_loss, dppo_tv_loss
from alignrl.core.policy_terms import MAX_LOG_RATIO, finish_loss, per_token_advantages, ratio_metrics
from alignrl.core.sequence_weights import vespo_loss

__all__ = ["MAX_LOG_RATIO", "K3_MAX", "masked_mean", "kl_k1", "kl_k2", "kl_k3", "kl_abs", "KL_ESTIMATORS",
           "ratio_weighted_kl", "token_mean",
           "LOSS_AGGREGATIONS", "aggregate_loss", "ppo_clip_loss", "gspo_loss", "luspo_loss", "cispo_loss", "gpg_loss",
           "gmpo_loss", "clip_cov_loss", "kl_cov_loss", "sapo_loss", "dppo_tv_loss", "dppo_kl_loss", "vespo_loss",
           "seq_ppo_clip_loss",
           "POLICY_LOSSES",
           "value_loss"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log q (Schulman 2020, "Approximating KL Divergence"): unbiased, high variance."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2 (Schulman 2020): biased, low variance; verl's 'mse'."""
    return 0.5 * (logp - ref_logp) ** 2


K3_MAX = 10.0  # verl's low_var_kl bound on the per-token k3 value (verl core_algos.kl_penalty)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(q - p) - (q - p) - 1 (Schulman 2020): unbiased, non-negative; GRPO's 'low_var_kl'.

    The value is clamped to [-K3_MAX, K3_MAX] as verl's `low_var_kl` does: k3 grows like exp(q - p),
    so one token the policy has made far less likely than the reference (e.g. an observation token
    left unmasked in a multi-turn rollout) would otherwise dominate the mean KL. A clamped token
    has zero gradient, as in verl. The lower bound never binds (k3 >= 0); it is kept to match verl.
    """
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (d.exp() - d - 1).clamp(-K3_MAX, K3_MAX)


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log p - log q| (verl's 'abs' KL penalty; Schulman 2020 for the k1 it is the magnitude of)."""
    return (logp - ref_logp).abs()


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs,
                 "kl": kl_k1, "mse": kl_k2, "low_var_kl": kl_k3}


def ratio_weighted_kl(kl: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """A per-token KL estimate (B, T) times the ratio pi / pi_old (B, T), gradient through both: sampled from the old
    policy, the KL to the reference of the current one needs that importance weight (TRL's use_bias_correction_kl,
    from DeepSeek-V3.2's unbiased KL estimate)."""
    return kl * (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _two_sided(ratio: torch.Tensor, delta: float | None) -> torch.Tensor:
    """The ratio of the unclipped surrogate term, capped at `delta` when given (two-sided GRPO clipping)."""
    if delta is None:
        return ratio
    if delta <= 1.0:
        raise ValueError(f"two-sided clipping's delta must be > 1, got {delta}")
    return ratio.clamp(max=delta)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                  clip_c: float | None = None, delta: float | None = None, is_weight: torch.Tensor | None = None,
                  loss_agg: str = "token-mean", global_seqs: float | None = None, max_len: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high bounds (DAPO clip-higher).

    logp, old_logp (B, T); advantages (B, T) or (B,) broadcast per token; mask (B, T).
    `clip_c` (> 1) adds the dual clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning"): for A < 0 the per-token loss is capped at -A * clip_c, so a
    huge ratio on a bad token cannot blow the loss up. `delta` (> 1 + clip_high) is TRL's two-sided clipping:
    the unclipped term's ratio is capped at delta, so a token with A < 0 whose ratio passed delta has the loss
    -A * delta and no gradient. `is_weight` (B, T) multiplies the per-token loss.
    """
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * _two_sided(ratio, delta)
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = ratio_metrics(log_ratio, ratio, clipped > unclipped, mask)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
        cap = -advantages * clip_c
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        m = mask.bool()
        metrics["actor/dualclip_frac"] = float(dual[m].float().mean()) if m.any() else 0.0
    loss = finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, metrics


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, global_tokens: float | None = None, *,
              delta: float | None = None, is_weight: torch.Tensor | None = None, loss_agg: str = "seq-mean-token-mean",
              global_seqs: float | None = None, max_len: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence Policy Optimization"),
    in its GSPO-token form.

    logp, old_logp (B, T); advantages (B, T) or (B,); mask (B, T). The ratio is sequence-level,
    s_i = exp(mean_t log(pi/pi_old)) (length-normalised), clipped to [1 - clip_low, 1 + clip_high]
    (the paper's 3e-4 / 4e-4 by default). Per token s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: equal
    to s_i in value, with gradient s_i * grad log pi(y_t), so with the paper's seq-mean-token-mean
    aggregation and a sequence advantage the gradient is exactly GSPO's. `delta`: two-sided clipping of the
    sequence ratio, as `ppo_clip_loss`'s of the token ratio.
    """
    advantages = per_token_advantages(advantages, logp)
    m = mask.to(logp.dtype)
    token_lr = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_lr = (token_lr * m).sum(-1) / m.sum(-1).clamp(min=1)
    # the clamp acts on the stop-gradient part only, so a clamped sequence keeps its token gradients
    log_ratio = seq_lr.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)[:, None] + (logp - logp.detach())
    ratio = log_ratio.exp()
    unclipped = -advantages * _two_sided(ratio, delta)
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = ratio_metrics(token_lr, ratio, clipped > unclipped, mask)
    loss = finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, metrics


def luspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
               delta: float | None = None, is_weight: torch.Tensor | None = None, loss_agg: str = "seq-mean-token-sum",
               global_seqs: float | None = None, max_len: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Length-Unbiased Sequence Policy Optimization (LUSPO; TRL's loss_type luspo): GSPO's sequence-ratio term,
    each sequence's loss times its token count, averaged over sequences, i.e. `gspo_loss` aggregated by
    seq-mean-token-sum whatever `loss_agg` says. Per sequence the value is n_i * L_i and the gradient
    -A_i s_i * sum_t grad log pi(y_t) where unclipped, as TRL's (per_token_loss * mask.sum(-1, keepdim=True)).mean()
    with importance_sampling_level sequence: a long sequence no longer weighs less per token."""
    return gspo_loss(logp, old_logp, advantages, mask, clip_low, clip_high, global_tokens, delta=delta,
                     is_weight=is_weight, loss_agg="seq-mean-token-sum", global_seqs=global_seqs, max_len=max_len)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               clip_low: float = 1.0, clip_high: float = 0.28, global_tokens: float | None = None, *,
               is_weight: torch.Tensor | None = None, loss_agg: str = "token-mean",
               global_seqs: float | None = None, max_len: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped IS-weight Policy Optimization (CISPO; MiniMax 2025, "MiniMax-M1: Scaling Test-Time
    Compute Efficiently with Lightning Attention").

    logp, old_logp (B, T); advantages (B, T) or (B,); mask (B, T). Per token
    -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log pi: the IS weight is clipped, not the
    update, so clipped tokens still get a gradient (weighted by the clipped ratio). MiniMax put no
    lower bound on the weight: clip_low >= 1 by default. The loss value is not a surrogate value;
    only its gradient sg[w] * A * grad log pi is meaningful.
    """
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max(0.0, 1 - clip_low), 1 + clip_high).detach()
    per_token = -weight * advantages * logp
    metrics = ratio_metrics(log_ratio, ratio, weight != ratio.detach(), mask)
    loss = finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, metrics


def gpg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
             is_weight: torch.Tensor | None = None, loss_agg: str = "token-mean",
             global_seqs: float | None = None, max_len: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG's policy gradient (verl's compute_policy_loss_gpg): -A * log pi per token, no ratio and no clip (the clip
    arguments are taken for the common signature and unused). The ratio is still reported, for the same metrics."""
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    metrics = ratio_metrics(log_ratio, ratio, torch.zeros_like(mask, dtype=torch.bool), mask)
    loss = finish_loss(-advantages * logp, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, metrics


def gmpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.4, clip_high: float = 0.4, global_tokens: float | None = None, *,
              is_weight: torch.Tensor | None = None, loss_agg: str = "seq-mean-token-mean",
              global_seqs: float | None = None, max_len: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Geometric-Mean Policy Optimization (GMPO; Zhao et al. 2025, "Geometric-Mean Policy Optimization"), as verl's
    compute_policy_loss_geo_mean: each token's log-ratio is clipped to [-clip_low, clip_high] in log space, on the
    side the advantage's sign makes pessimistic; a sequence's ratio is the exponential of their mean (the geometric
    mean of its token ratios) and its loss -mean(A) * ratio, times the geometric mean of its IS weights; the loss is
    the mean over sequences, whatever `loss_agg` (as verl's)."""
    adv_tok = per_token_advantages(advantages, logp)
    m = mask.to(logp.dtype)
    n = m.sum(-1) + 1e-8
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    sign = torch.sign(adv_tok)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    per_seq = -((adv_tok * m).sum(-1) / n) * torch.exp((pessimistic * m).sum(-1) / n)
    if is_weight is not None:  # a correction constant: its geometric mean over the sequence
        per_seq = per_seq * torch.exp((torch.log(is_weight.detach() + 1e-10) * m).sum(-1) / n)
    metrics = ratio_metrics(log_ratio, log_ratio.exp(), clamped != log_ratio, mask)
    # the sequence's loss on each of its tokens: their token-mean is it, the sequence mean the batch's
    loss = finish_loss(per_seq[:, None].expand_as(logp), mask, None, "seq-mean-token-mean", global_tokens,
                       global_seqs, max_len)
    return loss, metrics


def sapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05, is_weight: torch.Tensor | None = None,
              loss_agg: str = "seq-mean-token-mean", global_seqs: float | None = None, max_len: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Soft Adaptive Policy Optimization (SAPO; Gao et al. 2025, arXiv:2511.20347), as verl's compute_policy_loss_
    sapo: PPO's hard clip replaced by a smooth gate of the token ratio, -A * (4 / tau) * sigmoid(tau * (r - 1)), with
    tau = tau_pos where A > 0 and tau_neg elsewhere. At r = 1 its gradient is PPO's (A * grad log pi); far from 1 it
    fades instead of stopping. No clip (the clip arguments are taken for the common call and unused)."""
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=logp.dtype, device=logp.device),
                      torch.as_tensor(tau_neg, dtype=logp.dtype, device=logp.device))
    per_token = -advantages * torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    metrics = ratio_metrics(log_ratio, ratio, torch.zeros_like(mask, dtype=torch.bool), mask)
    return finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len), metrics


def seq_ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                      is_weight: torch.Tensor | None = None, loss_agg: str = "seq-mean-token-mean",
                      global_seqs: float | None = None, max_len: float | None = None
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clip on each sequence's full likelihood ratio, as TRL's RLOOTrainer computes its loss (after Ahmadian
    et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"): r_i = exp(sum_t log pi - sum_t log
    pi_old) over the sequence's counted tokens (a product of token ratios, not GSPO's geometric mean), the sequence
    loss -min(r_i A_i, clip(r_i, 1 - clip_low, 1 + clip_high) A_i), averaged over the sequences with a counted token
    (`global_seqs`: the mini-batch's, so micro-batches add up). With pi == pi_old the gradient is -A_i sum_t grad
    log pi per sequence. A sequence's advantage is the mean of its tokens' (a sequence-level estimator's one
    value); `is_weight` (B, T) may only hold one weight per sequence (their token mean multiplies its loss).
    `loss_agg` and `max_len` are taken for the common call and unused; the log-ratio is bounded by MAX_LOG_RATIO,
    as every loss here bounds it."""
    m = mask.to(logp.dtype)
    counted = (m.sum(-1) > 0).to(logp.dtype)
    n = m.sum(-1).clamp(min=1)
    adv = (per_token_advantages(advantages, logp) * m).sum(-1) / n
    seq_lr = ((logp - old_logp) * m).sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = seq_lr.exp()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_seq = torch.maximum(unclipped, clipped) * counted
    if is_weight is not None:  # a correction constant per sequence, never a path for gradients
        per_seq = per_seq * (is_weight.detach() * m).sum(-1) / n
    metrics = ratio_metrics(seq_lr.detach()[:, None], ratio.detach()[:, None], (clipped > unclipped)[:, None],
                            counted[:, None])
    count = counted.sum() if global_seqs is None else torch.as_tensor(global_seqs, dtype=logp.dtype, device=logp.device)
    return per_seq.sum() / count.clamp(min=1), metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "gpg": gpg_loss,
                 "gmpo": gmpo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss, "sapo": sapo_loss,
                 "dppo_tv": dppo_tv_loss, "dppo_kl": dppo_kl_loss, "luspo": luspo_loss, "vespo": vespo_loss,
                 "seq_ppo_clip": seq_ppo_clip_loss}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float | None = 0.2, global_tokens: float | None = None, *, loss_agg: str = "token-mean",
               global_seqs: float | None = None, max_len: float | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of PPO (Schulman et al. 2017; the clipping as in OpenAI baselines):
    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2). `clip_range=None` drops the clip.

    values, old_values, returns, mask (B, T) -> (loss, metrics: critic/vf_loss, critic/vf_clipfrac,
    critic/vpred_mean).
    """
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token, clip_active = unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clipped - returns) ** 2
        per_token, clip_active = torch.maximum(unclipped, clipped), clipped > unclipped
    per_token = 0.5 * per_token
    loss = aggregate_loss(per_token, mask, loss_agg, global_tokens, global_seqs, max_len)
    with torch.no_grad():
        m = mask.bool()
        any_ = bool(m.any())
        metrics = {
            "critic/vf_loss": float(per_token[m].mean()) if any_ else 0.0,
            "critic/vf_clipfrac": float(clip_active[m].float().mean()) if any_ else 0.0,
            "critic/vpred_mean": float(values[m].mean()) if any_ else 0.0,
        }
    return loss, metrics
