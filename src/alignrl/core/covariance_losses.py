"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models"; verl's policy_loss.loss_mode=clip_cov / kl_cov): policy losses that keep the policy's entropy from
collapsing by restraining the few tokens whose log-probability moves most with their advantage.

A token's covariance term is (A - mean A) * (log pi - mean log pi), the means over this batch's counted tokens; the
paper finds entropy falls in proportion to it, concentrated on a small share of tokens.
- Clip-Cov: PPO's clipped surrogate, with the gradient of a few randomly drawn tokens whose covariance lies in
  (lb, ub) and that PPO's clip has not already cut removed (their loss is 0): max(1, ratio * counted tokens) of them.
- KL-Cov: the unclipped surrogate -A * r, plus kl_coef * |log r| on the max(1, ratio * counted tokens) tokens of
  the largest covariance.
Both share the policy losses' call (`core.losses`); as in verl, the counts and means are this micro-batch's.
"""

from __future__ import annotations

import torch

from alignrl.core.policy_terms import MAX_LOG_RATIO, finish_loss, per_token_advantages, ratio_metrics


def covariance(advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A) * (log pi - mean log pi) per token (B, T), the means over the counted tokens; no gradient."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    adv, lp = advantages.detach(), logp.detach()
    return (adv - (adv * m).sum() / n) * (lp - (lp * m).sum() / n)


def _share(mask: torch.Tensor, ratio: float) -> int:
    """How many tokens a covariance loss restrains: `ratio` of the counted ones, at least one."""
    return max(int(ratio * int(mask.bool().sum())), 1)


def _metrics(log_ratio: torch.Tensor, restrained: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor
             ) -> dict[str, float]:
    """The ratio metrics of every policy loss, and `actor/cov_frac`: the restrained tokens' share."""
    m = mask.bool()
    share = float(restrained[m].float().mean()) if m.any() else 0.0
    return {**ratio_metrics(log_ratio.detach(), log_ratio.detach().exp(), clipped, mask), "actor/cov_frac": share}


def clip_cov_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                  cov_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
                  generator: torch.Generator | None = None, is_weight: torch.Tensor | None = None,
                  loss_agg: str = "token-mean", global_seqs: float | None = None, max_len: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (module docstring). `generator` draws the restrained tokens (verl draws them with torch's global
    generator); `actor/cov_frac` is their share of the counted tokens."""
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    m = mask.bool()
    cut = (clipped > unclipped) & m
    cov = covariance(advantages, logp, mask)
    candidates = torch.nonzero((cov > cov_lb) & (cov < cov_ub) & m & ~cut)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:_share(mask, cov_ratio)]]
    restrained = torch.zeros_like(m)
    restrained[chosen[:, 0], chosen[:, 1]] = True
    per_token = torch.where(restrained, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    loss = finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, _metrics(log_ratio, restrained, mask, cut)


def kl_cov_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                cov_ratio: float = 2e-4, kl_coef: float = 1.0, is_weight: torch.Tensor | None = None,
                loss_agg: str = "token-mean", global_seqs: float | None = None, max_len: float | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (module docstring): no clip (the clip arguments are taken for the common call and unused);
    `actor/cov_frac` is the penalised tokens' share of the counted ones."""
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    per_token = -advantages * log_ratio.exp()
    m = mask.bool()
    restrained = torch.zeros_like(m)
    if m.any():
        cov = covariance(advantages, logp, mask)[m]
        top = torch.topk(cov, _share(mask, cov_ratio)).indices
        restrained[torch.nonzero(m)[top].unbind(-1)] = True
        per_token = per_token + kl_coef * log_ratio.abs() * restrained
    loss = finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len)
    return loss, _metrics(log_ratio, restrained, mask, torch.zeros_like(m))
