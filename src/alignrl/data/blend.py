"""Several files' rows as one list: concatenated, or blended by weight as OpenRLHF blends its datasets (HF
`datasets.interleave_datasets` with `stopping_strategy="all_exhausted"`). Pure Python and numpy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from alignrl.data.row_formats import DataError


def blend_order(lengths: Sequence[int], probs: Sequence[float], seed: int) -> list[tuple[int, int]]:
    """(file, row) pairs in the order HF `datasets.interleave_datasets(probabilities=probs, seed=seed,
    stopping_strategy="all_exhausted")` reads them, which is how OpenRLHF blends --prompt_data files: each draw
    picks a file by weight and takes its next row; a file that runs out starts again from its first row, and the
    blend ends once every file has run out once. The draws are numpy's `default_rng(seed).choice`, 1000 at a time,
    as datasets makes them, so the same seed gives OpenRLHF's order."""
    import numpy as np

    p = np.asarray(probs, dtype=np.float64)
    if abs(p.sum() - 1.0) > 1e-8:  # numpy refuses weights off 1 by more than ~1e-8: any positive weights are taken
        p = p / p.sum()
    rng = np.random.default_rng(seed)
    at, exhausted, order = [0] * len(lengths), [False] * len(lengths), []
    while not all(exhausted):
        for f in map(int, rng.choice(len(lengths), size=1000, p=p)):
            if all(exhausted):
                break
            order.append((f, at[f]))
            at[f] += 1
            if at[f] >= lengths[f]:
                exhausted[f], at[f] = True, 0
    return order


def blended_units(per_file: Sequence[Sequence[Any]], probs: Sequence[Any], seed: int, limit: int | None,
                  key: str = "train_files") -> list[tuple[int, Any]]:
    """(file index, unit) of each file's units (rows, pairs, a line's rows) blended by `probs` as OpenRLHF's
    --dataset_probs blends its datasets (`blend_order`), the first `limit` of the blend (None: all). One weight per
    file, each a number above 0: else a DataError naming the key."""
    try:
        weights = [float(p) for p in probs]
    except (TypeError, ValueError):
        weights = []
    if len(weights) != len(per_file) or not all(0 < w < float("inf") for w in weights):
        raise DataError(f"{key}_probs={list(probs)}: give one weight above 0 per {key} file ({len(per_file)} "
                        f"file(s)), e.g. [{', '.join(['0.5'] * max(len(per_file), 2))}]")
    order = blend_order([len(units) for units in per_file], weights, seed)
    return [(f, per_file[f][i]) for f, i in order[:limit]]


def read_files(files: Sequence[Any], read: Callable[[Any, int | None], list], limit: int | None,
               probs: Sequence[Any] = (), seed: int = 42, key: str = "train_files") -> list[tuple[int, Any]]:
    """(file index, unit) of `files`, each read by `read(file, at most n units or None)`: concatenated, the first
    `limit` units of them all (a file past the limit is not read); with `probs`, each file's first `limit` blended
    (`blended_units`). One file with one weight is read as it is (OpenRLHF's --dataset_probs 1.0)."""
    if probs and not (len(files) == 1 and len(probs) == 1):
        return blended_units([read(f, limit) for f in files], probs, seed, limit, key)
    out: list[tuple[int, Any]] = []
    for i, f in enumerate(files):
        if limit and len(out) >= limit:
            break
        out += [(i, unit) for unit in read(f, limit - len(out) if limit else None)]
    return out
