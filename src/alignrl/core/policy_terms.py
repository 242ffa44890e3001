"""What the policy losses share: the bound on log-ratios, per-token advantages, the ratio metrics and the weighted
aggregation of a per-token loss (`core.losses`, `core.covariance_losses`)."""

from __future__ import annotations

import torch

from alignrl.core.aggregation import aggregate_loss

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: large enough never to bind in practice, small enough to stay finite


def per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages (B, T) as given, or (B,) repeated on each of a row's tokens."""
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
                  ) -> dict[str, float]:
    """The ratio metrics every policy loss reports, over the counted tokens."""
    with torch.no_grad():
        m = mask.bool()
        if not m.any():
            return {"actor/clipfrac": 0.0, "actor/ratio_mean": 1.0, "actor/approx_kl": 0.0}
        return {
            "actor/clipfrac": float(clipped[m].float().mean()),
            "actor/ratio_mean": float(ratio[m].mean()),
            "actor/approx_kl": float((0.5 * log_ratio**2)[m].mean()),
        }


def finish_loss(per_token: torch.Tensor, mask: torch.Tensor, is_weight: torch.Tensor | None, loss_agg: str,
                global_tokens: float | None, global_seqs: float | None, max_len: float | None) -> torch.Tensor:
    """The per-token loss times its importance weights, aggregated (`core.aggregation`)."""
    if is_weight is not None:
        per_token = per_token * is_weight.detach()  # a correction constant, never a path for gradients
    return aggregate_loss(per_token, mask, loss_agg, global_tokens, global_seqs, max_len)
