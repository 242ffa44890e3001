"""Entropy of the policy's next-token distribution from logits, chunk by chunk, and the mask of a batch's
high-entropy tokens (`high_entropy_mask`).

Upcasting all logits (N, V) to float32 at once costs N * V * 4 bytes (for N = 32k tokens and a
150k vocabulary, 19 GB); working on `chunk` rows at a time bounds that to chunk * V * 4, and
recomputing each chunk in the backward pass keeps the saved activations to the input logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    # H = logsumexp(x) - sum softmax(x) * x, stable for any logit scale
    return torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) per row (Shannon; the entropy bonus of Mnih et al. 2016, "A3C").

    logits (N, V) (or (..., V)), any float dtype -> entropy (N,) (or (...)) in float32. `chunk` rows
    are upcast at a time. Differentiable: under autograd each chunk is recomputed in backward
    (activation checkpointing) instead of storing its float32 softmax.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return torch.zeros(lead, dtype=torch.float32, device=logits.device)
    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for start in range(0, flat.shape[0], chunk):
        piece = flat[start:start + chunk]
        parts.append(checkpoint(_entropy_rows, piece, use_reentrant=False) if grad else _entropy_rows(piece))
    return torch.cat(parts).reshape(lead)


def linear_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of a 1-D tensor with linear interpolation, as torch.quantile's default, by one sort: without
    torch.quantile's limit on the input's size (2^24 entries)."""
    ordered = x.sort().values
    pos = q * (x.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, x.numel() - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top: float,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The tokens of `mask` (B, T) whose entropy (B, T) is among the top `top` share of the masked entropies, as TRL's
    top_entropy_quantile keeps them ("Beyond the 80/20 Rule", Wang et al. 2025): the threshold is the (1 - top)
    quantile of the masked entropies, over every rank when `gather` (a 1-D tensor -> its concatenation over ranks)
    is given, and a token is kept when its entropy is at least that. top = 1 keeps every masked token, top = 0 those
    of the largest entropy; no masked token anywhere keeps none. Returns bool (B, T), False outside the mask."""
    on = mask.bool()
    values = entropy.detach()[on].float()
    if gather is not None:
        values = gather(values)
    if values.numel() == 0:
        return torch.zeros_like(on)
    threshold = linear_quantile(values, 1.0 - top)
    return (entropy.detach().float() >= threshold) & on
