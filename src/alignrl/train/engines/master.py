"""fp32 master weights for a model that trains in bf16 or fp16 (the single and DDP engines).

AdamW's update at RL learning rates (1e-6) lies far below bf16's resolution (8 bits of mantissa: a weight of
0.02 moves in steps of 1.2e-4), so stepping bf16 parameters in place rounds nearly every update away and the
model does not train. As DeepSpeed's bf16 optimizer and mixed-precision FSDP do, the optimizer here steps an
fp32 copy of the weights, and the result is copied into the model, which computes (forward, backward, and the
generation that shares it) in its own dtype. The copy is a module of the model's structure, so the optimizer
state keeps the FQN-keyed form every local engine reads.

Gradients are summed in fp32 too: each weight's bf16 gradient moves onto the copy as the backward makes it (a
bf16 running sum over many micro-batches rounds away the small ones), and under data parallelism the ranks
average the fp32 sums (DeepSpeed's fp32 gradient accumulation, FSDP's fp32 reduce_dtype), not bf16 buckets.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

LOW = (torch.bfloat16, torch.float16)
BUCKET = 1 << 25  # fp32 gradient elements per all-reduce (128 MiB)


def _buckets(tensors: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    filled = 0
    for t in tensors:
        if out[-1] and filled + t.numel() > size:
            out.append([])
            filled = 0
        out[-1].append(t)
        filled += t.numel()
    return [b for b in out if b]


def needs_master(model: torch.nn.Module) -> bool:
    return any(p.requires_grad and p.dtype in LOW for p in model.parameters())


class MasterWeights:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        # same names, same trainable set; the trainable weights in fp32, the frozen ones (a LoRA base, a frozen
        # prefix) the model's own tensors, shared rather than copied: nothing steps them
        frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
        self.shadow = copy.deepcopy(model, memo=dict(frozen))
        for p in self.shadow.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        self.pairs = [(m, p) for m, p in zip(self.shadow.parameters(), model.parameters()) if p.requires_grad]
        for m, p in self.pairs:  # each gradient leaves the model as soon as the backward has made it
            p.register_post_accumulate_grad_hook(functools.partial(self._take, m))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [m for m, _ in self.pairs]

    @staticmethod
    @torch.no_grad()
    def _take(m: torch.nn.Parameter, p: torch.nn.Parameter) -> None:
        """The model's gradient added, in fp32, to the copy's, and dropped: the bf16 gradients of a backward never
        all exist at once beside the fp32 sums."""
        m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def average_over_ranks(self, world_size: int) -> None:
        """Collective: every rank's fp32 gradient sum becomes their mean, in buckets of BUCKET elements. A weight
        that some rank's micro-batches did not reach counts as zeros there; one that no rank's did keeps no
        gradient (the optimizer leaves it alone, as it would in one process)."""
        reached = torch.tensor([float(m.grad is not None) for m, _ in self.pairs], device=self.pairs[0][0].device)
        dist.all_reduce(reached)
        grads = []
        for (m, _), anywhere in zip(self.pairs, reached.tolist()):
            if anywhere:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                grads.append(m.grad)
        for bucket in _buckets(grads, BUCKET):
            if len(bucket) == 1:  # a large tensor alone: reduced in place, not copied
                dist.all_reduce(bucket[0])
                bucket[0].div_(world_size)
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            flat.div_(world_size)
            torch._foreach_copy_(bucket, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in bucket]),
                                                                           bucket)])

    @torch.no_grad()
    def weights_out(self) -> None:
        for m, p in self.pairs:
            p.copy_(m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.shadow.state_dict().items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The fp32 weights a checkpoint kept (the model's own are those rounded to its dtype)."""
        self.shadow.load_state_dict(state)
        self.weights_out()
