"""Tokenisation and padding shared by the trainers and the rollout engines."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignrl.data.records import Sample


def encode_prompts(tokenizer, samples: Sequence[Sample], max_prompt_length: int) -> list[list[int]]:
    """Chat-templated prompt ids, truncated from the left so the generation prompt is always kept."""
    out = []
    for s in samples:
        ids = tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        out.append(list(ids)[-max_prompt_length:])
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and bool mask, padded on the left (prompts, so generation continues at column L)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and bool mask, padded on the right (responses, SFT targets)."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on each row's first real token (left padding aware)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
