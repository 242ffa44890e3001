"""Rule rewards under a time limit (algorithm.reward_timeout_s), as verl's prime reward manager scores them: the rows
of a batch are scored side by side in worker processes, and a row still running after the limit scores 0 while its
worker is killed and replaced. A rule that loops forever on one odd response (a regular expression's backtracking,
a symbolic comparison of huge numbers, a user's own function) then costs one row's score, not the run.

Workers are forked from this process, so a user's function loaded from its file needs no import in them: each rule is
registered here before the workers start, and a task names it by its number. A rule registered after they started
makes the next batch start fresh workers. Errors stay what they are in this process: a ScoreError raised in a worker
stops the run with its one line, naming the row.
"""

from __future__ import annotations

import atexit
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from alignrl.rewards.errors import ScoreError
from alignrl.rewards.registry import reads_prompt_text, score_row
from alignrl.runtime.cores import usable_cores
from alignrl.utils.tracking import console

_RULES: list[Callable[..., Any]] = []  # every rule a worker may be asked to run, by number; inherited at fork


def _run(number: int, args: tuple) -> Any:
    """In a worker: rule `number` on one row."""
    return score_row(_RULES[number], *args)


def _quiet_worker() -> None:
    """A worker scores text: one thread, so workers side by side do not oversubscribe the cores."""
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # torch is not needed to score text
        pass


class _Workers:
    """The process's worker pool, started at its first batch and again when rules were added since."""

    def __init__(self):
        self.pool, self.rules, self.size = None, 0, 0

    def get(self, size: int):
        from pebble import ProcessPool

        if self.pool is None or self.rules != len(_RULES) or self.size != size:
            self.close()
            self.pool = ProcessPool(max_workers=size, initializer=_quiet_worker,
                                    context=multiprocessing.get_context("fork"))
            self.rules, self.size = len(_RULES), size
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool.join(timeout=10)
            self.pool = None


_WORKERS = _Workers()
atexit.register(_WORKERS.close)


class TimedRule:
    """A rule function called as it is (one row, in this process) and, by the reward stage and the evaluation, on a
    batch of rows through `rows`: in workers, each row under `timeout_s` (`workers` of them; 0: the usable cores).
    `timed_out` counts the rows that ran past it since the last `take_timeouts`."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float, workers: int = 0):
        self.fn, self.timeout_s, self.workers = fn, timeout_s, workers
        self.number = len(_RULES)
        _RULES.append(fn)
        self.reads_prompt = reads_prompt_text(fn)
        self.__name__ = getattr(fn, "__name__", repr(fn))
        self.timed_out = 0

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def rows(self, calls: Sequence[tuple]) -> list[Any]:
        """score_row's value for each (data_source, solution_str, ground_truth, extra_info, prompt); 0.0 for a row
        that ran past the limit (verl's prime manager's score), counted. A row whose rule raised a ScoreError, or
        whose worker died (killed from outside, out of memory), holds that ScoreError for the caller to raise
        naming the row."""
        if not calls:
            return []
        pool = _WORKERS.get(self.workers or usable_cores())
        futures = [pool.schedule(_run, args=(self.number, tuple(c)), timeout=self.timeout_s) for c in calls]
        out: list[Any] = []
        for future, call in zip(futures, calls):
            try:
                out.append(future.result())
            except FutureTimeout:
                out.append(0.0)
                self.timed_out += 1
            except ScoreError as e:
                out.append(e)
            except Exception as e:
                if type(e).__name__ != "ProcessExpired":  # pebble's: the worker ended without an answer
                    raise
                out.append(ScoreError(self.__name__, f"lost its worker process ({e})", str(call[0]),
                                      "check the machine's memory, or whether something killed the worker"))
        return out

    def take_timeouts(self) -> int:
        n, self.timed_out = self.timed_out, 0
        return n


def timed(fn: Callable[..., Any], timeout_s: float, workers: int = 0) -> Callable[..., Any]:
    """`fn` under a time limit per row in worker processes (TimedRule); `fn` itself when `timeout_s` is 0, or when it
    scores a whole batch in one call (verl's batch manager: its own call is the unit)."""
    if timeout_s <= 0 or getattr(fn, "batch", None) is not None:
        return fn
    return TimedRule(fn, timeout_s, workers)


def late_rows(fns: Sequence[Callable[..., Any] | None]) -> int | None:
    """Rows of the distinct timed rules among `fns` that ran past their limit since the last call; None when none of
    them is timed."""
    timed_rules = {id(f): f for f in fns if isinstance(f, TimedRule)}.values()
    return sum(f.take_timeouts() for f in timed_rules) if timed_rules else None


def say_timeouts(where: str, late: int | None, limit_s: float) -> None:
    """One line when rows ran past the limit (`late`, from late_rows)."""
    if late:
        console.print(f"{where}: {late} row(s) ran past algorithm.reward_timeout_s={limit_s:g} s and scored 0 (their "
                      "worker processes were replaced)", markup=False)
