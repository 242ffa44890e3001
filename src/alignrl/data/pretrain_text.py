"""Pretraining texts for PPO-ptx (Ouyang et al. 2022, InstructGPT's PPO-ptx; OpenRLHF's --pretrain_data): rows of
text, each a column of a .jsonl/.json/.parquet file, tokenized whole and trained on as a language model beside the
policy loss (`train.ptx`).

As OpenRLHF's pretraining dataset, a text is tokenized without special tokens, cut to its first `max_length`
tokens, and every token of it is a target. Several files are blended by their weights as OpenRLHF blends them
(`loaders.blend_order`), or concatenated without weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alignrl.config.checks import data_files
from alignrl.data.loaders import blend_order, read_rows
from alignrl.data.row_formats import DataError

KEY = "ptx.data"


@dataclass(frozen=True)
class PretrainTexts:
    """Tokenized texts, each at least two tokens (one prediction)."""

    ids: list[list[int]]
    pad_id: int

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) (B, L) of texts `rows`, right-padded to the longest."""
        texts = [self.ids[r] for r in rows]
        width = max(len(t) for t in texts)
        ids = torch.full((len(texts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, :len(t)] = 1
        return ids, mask


def _texts_of(path: str, column: str) -> list[str]:
    texts = []
    for loc, row in read_rows(path, KEY):
        if column not in row:
            raise DataError(f"{loc}: no column {column!r} (its columns: {', '.join(sorted(row))}); set ptx.key to "
                            "the column of the text (OpenRLHF's --input_key)")
        if not isinstance(row[column], str):
            raise DataError(f"{loc}: column {column!r} is {type(row[column]).__name__}, not text; pretraining rows "
                            "hold plain text (chat messages belong in the prompt data)")
        texts.append(row[column])
    if not texts:
        raise DataError(f"{path}: no rows; ptx.data needs at least one text")
    return texts


def load_pretrain_texts(paths: str | list[str], column: str, tokenizer, max_length: int,
                        probs: Sequence[float] = (), seed: int = 0) -> PretrainTexts:
    """The texts of `paths` (one file or a list), blended by `probs` when given, tokenized and cut to `max_length`
    tokens; texts of fewer than two tokens are left out (they predict nothing)."""
    files = data_files(paths)
    per_file = [_texts_of(f, column) for f in files]
    if probs:
        if len(probs) != len(files) or any(p <= 0 for p in probs):
            raise DataError(f"ptx.data_probs={list(probs)} must give one positive weight per file of ptx.data "
                            f"({len(files)})")
        texts = [per_file[f][r] for f, r in blend_order([len(t) for t in per_file], probs, seed)]
    else:
        texts = [t for part in per_file for t in part]
    ids = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
           for t in texts]
    kept = [x for x in ids if len(x) >= 2]
    if not kept:
        raise DataError(f"ptx.data ({', '.join(files)}): no text of two tokens or more in column {column!r}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PretrainTexts(kept, int(pad))
