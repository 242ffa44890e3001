"""Advantage estimators: pure tensor functions, shapes in the docstrings."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath"; Dr.GRPO without std,
    Liu et al. 2025, "Understanding R1-Zero-Like Training").

    rewards (B,) float, group (B,) long ids -> advantages (B,). A = r - mean_group(r), divided by the
    unbiased group std when `norm_by_std`. A group of one sample has no baseline and gets 0.
    """
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, rewards)
    mean = total / count
    centred = rewards - mean[group]
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, centred**2)
    single = count[group] < 2
    if norm_by_std:
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[group] + eps)
    return centred.masked_fill(single, 0.0)


ADVANTAGES = {"grpo": grpo_advantages}
