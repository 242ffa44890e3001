"""What the policy wrote, kept for reading later, as verl keeps it: each step's rollouts (trainer.rollout_data_dir)
and each held-out evaluation's answers (trainer.validation_data_dir) as `<step>.jsonl`, one line per response with
verl's fields (input, output, gts, score, step) and the columns TRL's reward functions logged of it (log_extra), and a
few held-out answers at every evaluation in the run's logs (trainer.log_val_generations: the same problems each time,
chosen as verl chooses them; the TensorBoard text and the wandb table keep verl's columns).

Each file is written whole and renamed into place, so a reader never sees half of one. Under several ranks the
step's rollouts are gathered to rank 0, which writes them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alignrl.data.records import Sample, ScoredBatch
from alignrl.rl.scoring import decoded, logged_columns
from alignrl.runtime.env import DistEnv, gather_bytes
from alignrl.utils.atomic import atomic_write_text

VAL_GENERATIONS = "val_generations.jsonl"


def records(inputs: Sequence[str], outputs: Sequence[str], gts: Sequence[Any], scores: Sequence[float],
            columns: Sequence[dict[str, Any]] | None = None, *, step: int) -> list[dict[str, Any]]:
    """verl's fields of each response, after the columns TRL's reward functions logged of it (log_extra, as TRL adds
    them to its completions table; verl's fields keep their names in a clash)."""
    columns = columns if columns is not None else [{}] * len(inputs)
    return [{**c, "input": i, "output": o, "gts": g, "score": float(s), "step": step}
            for i, o, g, s, c in zip(inputs, outputs, gts, scores, columns)]


def jsonl(rows: Sequence[dict[str, Any]]) -> str:
    """One JSON line a row; a ground truth that is not JSON is written as its text."""
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)


def write_jsonl(folder: Path, step: int, text: str) -> None:
    """`folder/<step>.jsonl`, written whole."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{step}.jsonl", text)


class RolloutDump:
    """trainer.rollout_data_dir: every step's rollouts, gathered from the ranks, one line per response."""

    def __init__(self, folder: Path, tokenizer, train_rows: Sequence[Sample], env: DistEnv):
        self.folder, self.tokenizer, self.rows, self.env = folder, tokenizer, train_rows, env

    def __call__(self, step: int, batch: ScoredBatch) -> None:
        ro = batch.rollout
        gts = [self.rows[i].ground_truth for i in batch.prompt_index.tolist()]
        mine = records(decoded(self.tokenizer, ro.prompt_ids, ro.prompt_mask),
                       decoded(self.tokenizer, ro.response_ids, ro.response_mask), gts,
                       batch.scores.rewards.tolist(), logged_columns(ro), step=step)
        parts = gather_bytes(self.env, jsonl(mine).encode())  # collective: every rank, every step
        if self.env.is_main:
            write_jsonl(self.folder, step, b"".join(parts).decode())


def chosen_generations(rows: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` answers logged at each evaluation: sorted by input, then shuffled with seed 42 (verl's choice), so the
    same problems come back every time."""
    ordered = sorted(rows, key=lambda r: r["input"])
    random.Random(42).shuffle(ordered)
    return ordered[:n]


def log_generations(log_dir: Path, tracker, step: int, rows: Sequence[dict[str, Any]], n: int) -> None:
    """trainer.log_val_generations: `n` held-out answers as one line of <log_dir>/val_generations.jsonl, as TensorBoard
    text and as a wandb table (one row a step, verl's columns: step, input_1, output_1, score_1, ...)."""
    chosen = chosen_generations(rows, n)
    if not chosen:
        return
    path = log_dir / VAL_GENERATIONS
    old = path.read_text() if path.exists() else ""
    atomic_write_text(path, old + json.dumps({"step": step, "generations": chosen}, ensure_ascii=False,
                                             default=str) + "\n")
    tracker.log_table("val/generations", step, [[r["input"], r["output"], r["score"]] for r in chosen])
