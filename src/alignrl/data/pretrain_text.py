"""Pretraining texts for PPO-ptx (Ouyang et al. 2022, InstructGPT's PPO-ptx; OpenRLHF's --pretrain_data): rows of
text, each a column of a .jsonl/.json/.parquet file, tokenized whole and trained on as a language model beside the
policy loss (`train.ptx`).

As OpenRLHF's pretraining dataset, a text is tokenized without special tokens, cut to its first `max_length`
tokens, and every token of it is a target; here when it is drawn, so a large set costs its text only. Several files are blended by their weights as OpenRLHF blends them
(`blend.blend_order`), or concatenated without weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alignrl.config.checks import data_files
from alignrl.data.blend import blend_order
from alignrl.data.loaders import read_rows
from alignrl.data.row_formats import DataError

KEY = "ptx.data"


@dataclass(frozen=True)
class PretrainTexts:
    """Texts, tokenized when drawn (a step needs only its own: the set is never held as ids)."""

    texts: list[str]
    tokenizer: Any
    max_length: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.texts)

    def ids(self, row: int) -> list[int]:
        """Text `row` as OpenRLHF's pretraining rows hold it: no special tokens, its first `max_length` tokens."""
        return self.tokenizer(self.texts[row], add_special_tokens=False, truncation=True,
                              max_length=self.max_length)["input_ids"]

    def batch(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) (B, L) of texts `rows`, right-padded to the longest."""
        texts = [self.ids(r) for r in rows]
        width = max(1, max(len(t) for t in texts))
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
        if row[column].strip():  # an empty text predicts nothing
            texts.append(row[column])
    if not texts:
        raise DataError(f"{path}: no text in column {column!r}; ptx.data needs at least one")
    return texts


def load_pretrain_texts(paths: str | list[str], column: str, tokenizer, max_length: int,
                        probs: Sequence[float] = (), seed: int = 0) -> PretrainTexts:
    """The texts of `paths` (one file or a list), blended by `probs` when given (checked with the config), to be
    tokenized and cut to `max_length` tokens as they are drawn."""
    files = data_files(paths)
    per_file = [_texts_of(f, column) for f in files]
    if probs:
        texts = [per_file[f][r] for f, r in blend_order([len(t) for t in per_file], probs, seed)]
    else:
        texts = [t for part in per_file for t in part]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PretrainTexts(texts, tokenizer, max_length, int(pad))
