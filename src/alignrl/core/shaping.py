"""Reward shaping that depends only on the response, not on the task: pure tensor functions."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", eq. 13), added to the reward of each response.

    lengths (B,) response lengths in tokens -> penalty (B,) float: 0 while L <= max_len - buffer_len,
    then falling linearly to -factor at L = max_len: -factor * (L - (max_len - buffer_len)) / buffer_len.
    A length past max_len (not produced by a length-capped sampler) is clamped to -factor.
    buffer_len=0 disables the penalty (all zeros). `max_len` is the longest response the run produces
    (`config.checks.response_cap`): rollout.max_new_tokens, or in a multi-turn run the episode's cap,
    whose lengths count tool observations too.
    """
    if not 0 <= buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in [0, max_len={max_len}], got {buffer_len}")
    if buffer_len == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0.0, max=float(buffer_len))
    return -factor * over / buffer_len


def truncated_reward(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's stop-properly penalty (OpenRLHF's --stop_properly_penalty_coef) on the rewards (B,) of the responses
    cut at the length cap (`truncated` (B,) bool): coef >= 0 scales their reward by coef (0: no credit for an
    answer that never ended), coef < 0 replaces it by coef; the others are unchanged."""
    cut = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(truncated.to(rewards.device), cut, rewards)


def missing_eos_penalty(rewards: torch.Tensor, truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """TRL's missing_eos_penalty: `penalty` subtracted from the reward (B,) of each response cut at the length cap
    before it ended (`truncated` (B,) bool), pushing the policy toward answers that finish."""
    return rewards - penalty * truncated.to(device=rewards.device, dtype=rewards.dtype)


def clip_outcome(rewards: torch.Tensor, baseline: torch.Tensor | None, clip: tuple | list | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """OpenRLHF's --reward_clip_range on the outcome rewards (B,) and on ReMax's greedy-response baseline (B,)
    alike: a baseline left outside the range would push every clamped reward below it. `clip`: (low, high),
    or empty / None for no clamp."""
    if not clip:
        return rewards, baseline
    return rewards.clamp(*clip), None if baseline is None else baseline.clamp(*clip)
