"""What TRL's reward functions are told of the run and what they log while a step is scored: `trainer_state`
(`TrainerState`), `log_metric` (each name's values, `RewardLog.metric_means`) and `log_extra` (a column of one
value per completion), as `callbacks` hands them to each call. `logging_rewards` opens the log of one step's
scoring (the producer, the held-out evaluation); outside one (a timed rule's worker) there is no state and nothing
is logged."""

from __future__ import annotations

import contextvars
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from alignrl.rewards.errors import ScoreError
from alignrl.rewards.values import plain_number

@dataclass(frozen=True)
class TrainerState:
    """What TRL's reward functions read of transformers' TrainerState (a curriculum on `global_step / max_steps`):
    the RL steps done before the batch was generated, the run's steps, and the passes over the training data done
    (a float, as TRL's)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class RewardLog:
    """What TRL's functions log while the batches of one step are scored (`logging_rewards`): each metric's values
    in order, and, while one rollout's rows are scored (`extra_columns`), their extra columns."""

    state: TrainerState | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] | None = None  # None: no rollout whose generations are logged is being scored

    def metric_means(self) -> dict[str, float]:
        """Each metric's mean over the values logged, as TRL reports it."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}


# the log of the scoring under way in this thread: set where a step's scoring starts (the producer, the evaluation),
# read by the functions however the reward that calls them is wrapped (a format bonus, a correctness rule)
_LOG: contextvars.ContextVar[RewardLog | None] = contextvars.ContextVar("trl_reward_log", default=None)


@contextmanager
def logging_rewards(state: TrainerState | None) -> Iterator[RewardLog]:
    """TRL's functions called inside the block read `state` and log into the RewardLog given."""
    token = _LOG.set(RewardLog(state))
    try:
        yield _LOG.get()
    finally:
        _LOG.reset(token)


@contextmanager
def extra_columns() -> Iterator[dict[str, list[Any]]]:
    """The columns TRL's functions log (log_extra) while the rows of one rollout are scored inside the block, one
    value a row (a column logged twice keeps its last values); empty outside `logging_rewards`."""
    log = _LOG.get()
    if log is None:
        yield {}
        return
    saved, log.columns = log.columns, {}
    try:
        yield log.columns
    finally:
        log.columns = saved


def _number(value: Any) -> float | None:
    """A metric's value as a float (a Python or numpy number, a one-element tensor or array), else None."""
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        try:
            value = value.item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            return None
    return float(value) if isinstance(value, numbers.Real) else None


def callbacks(who: str, n: int, data_source: str) -> dict[str, Any]:
    """TRL's trainer_state, log_metric and log_extra for function `who` called on `n` completions: a bad value is a
    one-line ScoreError naming it. Outside `logging_rewards` (a timed rule's worker) no state, and nothing logged."""
    log = _LOG.get()
    if log is None:
        return {"trainer_state": None, "log_extra": _no_log, "log_metric": _no_log}

    def log_metric(name: str, value: Any) -> None:
        number = _number(value)
        if number is None:
            raise ScoreError(who, f"logged {value!r:.40} as metric {name!r} (log_metric)", data_source,
                             "log one number a call")
        log.metrics.setdefault(str(name), []).append(number)

    def log_extra(column: str, values: Any) -> None:
        values = values.tolist() if hasattr(values, "tolist") else values
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise ScoreError(who, f"logged {got} in column {column!r} (log_extra) for {n} completions", data_source,
                             "log a list with one value per completion")
        bad = next((v for v in values if not _plain(v)), _NONE_BAD)
        if bad is not _NONE_BAD:  # the column crosses processes (msgpack) and lands in JSON lines
            raise ScoreError(who, f"logged {bad!r:.40} in column {column!r} (log_extra)", data_source,
                             "log numbers, text, booleans or None")
        if log.columns is not None:  # else no generations are logged here: dropped, as TRL drops them
            log.columns[str(column)] = [plain_number(v) for v in values]

    return {"trainer_state": log.state, "log_extra": log_extra, "log_metric": log_metric}


_NONE_BAD = object()


def _plain(value: Any) -> bool:
    """Whether a logged column's value is a plain scalar JSON and msgpack both carry (an int within 64 bits)."""
    value = plain_number(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -2**63 <= value < 2**64
    return value is None or isinstance(value, (bool, float, str))


def _no_log(*args: Any, **kwargs: Any) -> None:
    """TRL's log_extra/log_metric where nothing is logged (a timed rule's worker)."""
