"""fp32 master weights for a model that trains in bf16 or fp16 (the single and DDP engines).

AdamW's update at RL learning rates (1e-6) lies far below bf16's resolution (8 bits of mantissa: a weight of
0.02 moves in steps of 1.2e-4), so stepping bf16 parameters in place rounds nearly every update away and the
model does not train. As DeepSpeed's bf16 optimizer and mixed-precision FSDP do, the optimizer here steps an
fp32 copy of the weights, and the result is copied into the model, which computes (forward, backward, and the
generation that shares it) in its own dtype. The copy is a module of the model's structure, so the optimizer
state keeps the FQN-keyed form every local engine reads.
"""

from __future__ import annotations

import copy

import torch

LOW = (torch.bfloat16, torch.float16)


def needs_master(model: torch.nn.Module) -> bool:
    return any(p.requires_grad and p.dtype in LOW for p in model.parameters())


class MasterWeights:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.shadow = copy.deepcopy(model).float()  # same names, same trainable set, fp32
        self.pairs = [(m, p) for m, p in zip(self.shadow.parameters(), model.parameters()) if p.requires_grad]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [m for m, _ in self.pairs]

    def grads_in(self) -> None:
        """The model's (reduced) gradients, in fp32, onto the copy; the model's are dropped."""
        for m, p in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

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
