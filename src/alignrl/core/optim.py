"""AdamW with linear warm-up and constant, cosine (verl's, OpenRLHF's) or linear (TRL's default) decay."""

from __future__ import annotations

import math

import torch


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float):
    """Multiplier of the base lr at optimizer step `s` (0-based)."""

    def f(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_optimizer(params, lr: float, weight_decay: float, betas, warmup_steps: int, total_steps: int,
                    schedule: str = "constant", min_lr_ratio: float = 0.0, eps: float = 1e-8):
    # foreach kernels are the fastest CPU path for many small parameter tensors
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, total_steps, schedule, min_lr_ratio))
    return opt, sched
