"""DPPO (Divergence-bounded policy optimization, arXiv:2602.04879; verl's policy_loss.loss_mode=dppo_tv / dppo_kl):
a token keeps its policy gradient while the new policy's probability of it stays within a divergence of the old
one's, instead of while the ratio stays within PPO's clip.

Per token: -A * sg[min(r, c)] * log pi on the tokens inside the bound, 0 outside (their gradient is stopped), with r
the ratio and c a truncation of it (truncated importance sampling; c = actor.clip_ratio_c, 20 when unset, as verl's
default reads it). The bound, with p and q the new and old probabilities of the token and the thresholds
clip_ratio_high for A > 0 and clip_ratio_low otherwise:
- dppo_tv: the total variation of the token's binary distribution, p - q <= high (A > 0), q - p <= low (A <= 0);
- dppo_kl: its KL, q log(q / p) + (1 - q) log((1 - q) / (1 - p)) <= the threshold, or p moving the way the
  advantage does not push it (p <= q for A > 0, p >= q otherwise).
"""

from __future__ import annotations

import torch

from alignrl.core.policy_terms import MAX_LOG_RATIO, finish_loss, per_token_advantages, ratio_metrics

DEFAULT_TRUNCATION = 20.0  # the truncation of r where clip_ratio_c is not given (verl's config.get default)


def _inside_tv(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, low: float, high: float
               ) -> torch.Tensor:
    moved = logp.exp() - old_logp.exp()
    return torch.where(advantages > 0, moved <= high, moved >= -low)


def _inside_kl(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, low: float, high: float
               ) -> torch.Tensor:
    p, q = logp.exp(), old_logp.exp()
    binary_kl = q * (old_logp - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return torch.where(advantages > 0, (binary_kl <= high) | (p <= q), (binary_kl <= low) | (p >= q))


def _dppo(inside, logp, old_logp, advantages, mask, clip_low, clip_high, global_tokens, clip_c, is_weight, loss_agg,
          global_seqs, max_len) -> tuple[torch.Tensor, dict[str, float]]:
    advantages = per_token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=DEFAULT_TRUNCATION if clip_c is None else clip_c).detach()
    keep = inside(logp.detach(), old_logp, advantages, clip_low, clip_high)
    per_token = -advantages * weight * logp * keep
    metrics = ratio_metrics(log_ratio.detach(), ratio.detach(), ~keep, mask)  # clipfrac: the tokens out of bounds
    return finish_loss(per_token, mask, is_weight, loss_agg, global_tokens, global_seqs, max_len), metrics


def dppo_tv_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                 clip_c: float | None = None, is_weight: torch.Tensor | None = None, loss_agg: str = "token-mean",
                 global_seqs: float | None = None, max_len: float | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO with the total-variation bound (module docstring); clip_low/high are its thresholds."""
    return _dppo(_inside_tv, logp, old_logp, advantages, mask, clip_low, clip_high, global_tokens, clip_c, is_weight,
                 loss_agg, global_seqs, max_len)


def dppo_kl_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip_low: float = 0.2, clip_high: float = 0.2, global_tokens: float | None = None, *,
                 clip_c: float | None = None, is_weight: torch.Tensor | None = None, loss_agg: str = "token-mean",
                 global_seqs: float | None = None, max_len: float | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO with the binary-KL bound (module docstring); clip_low/high are its thresholds."""
    return _dppo(_inside_kl, logp, old_logp, advantages, mask, clip_low, clip_high, global_tokens, clip_c, is_weight,
                 loss_agg, global_seqs, max_len)
