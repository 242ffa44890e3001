"""verl's batch reward manager (reward_model.reward_manager=batch, alignrl's algorithm.reward_fn_batch): the user's
function scores a whole batch in one call, `fn(data_sources=[...], solution_strs=[...], ground_truths=[...],
extra_infos=[...])`, and returns one score per row (a float, or a dict with "score", as verl's functions may).

One call per batch is what such functions are written for: a judge model or a remote service scores many answers at
once. `BatchedReward` is also called row by row where a caller scores one row (the held-out evaluation's room, a
format bonus wrapped around it), as a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from alignrl.rewards.errors import ScoreError

FIX = "return a list with one score per row (a float, or a dict with 'score')"


class BatchedReward:
    """A user's batch function (`who`: its file and name) as the reward stage calls reward functions."""

    reads_prompt = False  # verl's batch functions take the four lists only

    def __init__(self, fn: Callable[..., Any], who: str):
        self.fn, self.who = fn, who
        self.__name__ = who

    def batch(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict | None]) -> list[Any]:
        """The function's score of each row, as it returned them (checked finite by the caller, row by row)."""
        first = data_sources[0] if data_sources else ""
        try:
            values = self.fn(data_sources=list(data_sources), solution_strs=list(solution_strs),
                             ground_truths=list(ground_truths), extra_infos=list(extra_infos))
        except Exception as exc:
            text = str(exc).strip()
            cause = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
            raise ScoreError(self.who, f"raised {cause} on a batch of {len(data_sources)} rows", first,
                             "fix it so that it " + FIX) from exc
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence) and not hasattr(values, "tolist"):
            raise ScoreError(self.who, f"returned a {type(values).__name__} for a batch", first, FIX)
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != len(data_sources):
            raise ScoreError(self.who, f"returned {len(values)} scores for {len(data_sources)} rows", first, FIX)
        return values

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                 prompt: str | None = None) -> Any:
        return self.batch([data_source], [solution_str], [ground_truth], [extra_info])[0]
