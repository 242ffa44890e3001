"""Resumable epoch-shuffled batch order over a dataset of known size.

The order of epoch e is a permutation seeded by (seed, e), so the whole position is two integers:
saving them in a checkpoint resumes the exact same batches.
"""

from __future__ import annotations

import torch

from alignrl.data.loaders import DataError


class BatchSampler:
    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool = True):
        if size < batch_size:
            raise DataError(f"training data has {size} rows but a step draws {batch_size} prompts "
                            "(data.train_batch_size, or data.gen_batch_size with dynamic sampling); lower it or add data")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch, self.offset = 0, 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))

    def next(self) -> list[int]:
        """Indices of the next batch; a partial batch at the end of an epoch is skipped (drop_last)."""
        if self.offset + self.batch_size > self.size:
            self.epoch, self.offset = self.epoch + 1, 0
        batch = self._order()[self.offset:self.offset + self.batch_size].tolist()
        self.offset += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
