"""The reference update of TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"):
every reference weight moves toward the policy's, θ_ref ← α·θ_policy + (1 - α)·θ_ref (α = 1: a hard copy)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

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


class MovingReference:
    """A frozen reference copy that moves toward the policy every `every` steps (updates in RL, optimizer steps in
    DPO), and what a checkpoint keeps of it: its weights, the step it last moved at (0: still the initial weights)
    and the mix that moved it. `local`: the part of a weight this process holds and moves (the identity for a whole
    copy; a sharded reference's own rows of each weight)."""

    def __init__(self, reference: torch.nn.Module, alpha: float, every: int,
                 local: Callable[[torch.Tensor], torch.Tensor] = lambda p: p):
        self.params = dict(reference.named_parameters())  # tied weights (input and output embeddings) once
        self.alpha, self.every, self.moved_at, self.local = alpha, every, 0, local

    def due(self, step: int) -> bool:
        """Whether `step` moves it: a multiple of `every` past the last move (a step replayed after a resume, or a
        fresh run's step 0, does not move it twice)."""
        return step > self.moved_at and step % self.every == 0

    def mix(self, policy: Mapping[str, torch.Tensor], step: int) -> None:
        """Moves every weight toward the policy's of its name (`policy`: the same part of each weight as `local`
        gives, e.g. an engine's gathered full state for a whole copy) and records `step`."""
        names = list(self.params)
        mix_into_reference([self.local(self.params[n]) for n in names], [policy[n] for n in names], self.alpha)
        self.moved_at = step

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Host copies of the weights for a checkpoint; None while they are the initial ones."""
        if not self.moved_at:
            return None
        return {n: p.detach().cpu().contiguous().clone() for n, p in self.params.items()}

    def record(self) -> dict[str, str]:
        """What a checkpoint notes beside the weights: the step they moved at and the mix that moved them."""
        return {"moved_at": str(self.moved_at), "alpha": repr(self.alpha), "every": str(self.every)}

    def restore(self, weights: Mapping[str, torch.Tensor], record: Mapping[str, str]) -> str | None:
        """Takes a checkpoint's weights and record; returns the name of a weight the two models do not share (or
        share in another shape; the caller says what to do), else None."""
        other = self.mismatch({n: tuple(w.shape) for n, w in weights.items()})
        if other is None:
            self.take(weights, record)
        return other

    def mismatch(self, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """The name of a weight that a checkpoint (its weights' full shapes by name) and this reference do not
        share, or share in another shape; None when they hold the same weights."""
        if set(shapes) != set(self.params):
            return sorted(set(shapes) ^ set(self.params))[0]
        return next((n for n, p in self.params.items() if tuple(shapes[n]) != tuple(p.shape)), None)

    def take(self, parts: Mapping[str, torch.Tensor], record: Mapping[str, str]) -> None:
        """Sets each weight's `local` part from `parts` (checked with `mismatch`) and the step of `record`."""
        with torch.no_grad():
            for n, p in self.params.items():
                self.local(p).copy_(parts[n])
        self.moved_at = int(record.get("moved_at", 0))

    def change(self, record: Mapping[str, str], unit: str = "step") -> str | None:
        """A line saying how this run's mix differs from the one a checkpoint's record names (a resume may change
        it; the reference it goes on from was moved by the old one), or None when they agree or the record predates
        the mix being kept."""
        if "alpha" not in record or "every" not in record:
            return None
        alpha, every = float(record["alpha"]), int(record["every"])
        if (alpha, every) == (self.alpha, self.every):
            return None
        def steps(n: int) -> str:
            return f"{n} {unit}" + ("s" if n != 1 else "")

        return (f"the reference moved by alpha={alpha:g} every {steps(every)} until {unit} {self.moved_at}; it moves "
                f"by alpha={self.alpha:g} every {steps(self.every)} from here")
