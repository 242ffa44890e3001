"""The reference update of TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"):
every reference weight moves toward the policy's, θ_ref ← α·θ_policy + (1 - α)·θ_ref (α = 1: a hard copy)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def mix_into_reference(reference: Iterable[torch.Tensor], policy: Iterable[torch.Tensor], alpha: float) -> None:
    """Sets each reference tensor, in place, to alpha·policy + (1 - alpha)·reference, pairing the two sequences in
    order. A policy tensor may sit on another device or in another dtype (a gathered full weight in host memory, an
    fp32 policy beside a bf16 reference): the sum is formed in fp32 at least and stored in the reference's own dtype,
    so a bf16 reference is rounded once, not at each of the two terms."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: the mix weight lies in [0, 1]")
    reference, policy = list(reference), list(policy)
    if len(reference) != len(policy):
        raise ValueError(f"{len(reference)} reference tensors but {len(policy)} policy tensors")
    for i, (ref, pol) in enumerate(zip(reference, policy)):
        if ref.shape != pol.shape:
            raise ValueError(f"tensor {i}: reference shape {tuple(ref.shape)} is not the policy's {tuple(pol.shape)}")
        wide = torch.promote_types(ref.dtype, torch.float32)
        if ref.dtype == wide:  # no upcast needed: mix in place without a temporary of the reference
            ref.mul_(1.0 - alpha).add_(pol.to(ref.device, wide), alpha=alpha)
        else:
            mixed = ref.to(wide).mul_(1.0 - alpha).add_(pol.to(ref.device, wide), alpha=alpha)
            ref.copy_(mixed)
