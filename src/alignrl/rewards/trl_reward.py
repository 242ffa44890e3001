"""TRL's reward functions (`trl grpo --reward_funcs ... --reward_weights ...`), called as alignrl's reward.

A TRL reward function takes the batch's completions and the dataset's other columns as keyword arguments and returns
one float (or None) per completion: `f(completions, prompts=..., solution=..., **kwargs) -> list[float | None]`.
Here each function is called once per rollout batch, as TRL calls it once per generation batch, in training and in
the held-out evaluation (one row at a time only in a timed rule's worker): `completions` are the responses'
texts, or lists of one assistant message where a row's prompt is a list of chat messages (TRL's conversational
rows); `prompts` the rows' prompt column as the data holds it (the templated text where a row has none); every other
column any row has, as a list over the rows (data_source, extra_info and images too, as TRL
passes them; not completion/completions/completion_ids; the by-column layout keeps a label-less row's columns beside
its extra, `WithColumns`);
`completion_ids` the responses' token ids without padding (not where one row's text is scored alone, in a timed rule's
worker). An `async def` function is run to its end on each call (asyncio.run).

`trainer_state` holds what TRL's TrainerState tells a reward function of the run (`TrainerState`: `global_step`, the
RL steps done before the batch, which is the version of the weights that generated it, `max_steps`,
trainer.total_training_steps, and `epoch`, the passes over the training data done); in the held-out evaluation, the
steps done when it runs. `log_metric(name, value)` logs a number under `name` in the step's metrics (metrics.jsonl,
the trackers): the mean of the values logged while the step's batch was scored, then the mean over the ranks, as
TRL averages them (in the held-out evaluation, `val/name`). `log_extra(column, values)` adds a column of one value
per completion to the step's logged generations (trainer.rollout_data_dir's rollouts, the held-out answers of
trainer.validation_data_dir and trainer.log_val_generations); where the run logs none, the values are dropped. In a
timed rule's worker (algorithm.reward_timeout_s), which scores one row at a time in another process, `trainer_state`
is None and `log_extra` and `log_metric` log nothing.

Several functions make one reward, their weighted sum, as TRL sums them: a None is skipped (the row then takes the
others' sum; a row every function skips scores 0, as TRL's nansum gives it). A NaN is skipped as a None is.

`algorithm.reward_fn=trl:ENTRY;ENTRY...` names them, each ENTRY a built-in name (`BUILT_IN`), `path/to/file.py:func`
or TRL's dotted `package.module.func` (imported from the current folder, as TRL's script does), with `@weight` after
it when the weight is not 1.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignrl.rewards.errors import RewardError, ScoreError
from alignrl.rewards.reward_log import callbacks

SPEC_PREFIX = "trl:"  # algorithm.reward_fn=trl:ENTRY;ENTRY names TRL reward functions
NOT_COLUMNS = ("prompt", "completion", "completions", "completion_ids")  # TRL passes these otherwise, or not at all
FIX = "return a list with one float (or None) per completion, as TRL's reward functions do"
# TRL's think_format_reward: one <think> block opening the completion, closed once, anything after it
_THINK_RE = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


class WithColumns(dict):
    """A by-column row's extra (its extra_info object, or nothing) that also keeps every column of the row, as
    `.columns`, outside its items (`data.row_formats`): TRL's reward functions read them; every other reader (verl's
    extra_info, tools_kwargs, the evaluation's groups, a verl parquet written) sees the items alone."""

    def __init__(self, items: dict[str, Any], columns: dict[str, Any]):
        super().__init__(items)
        self.columns = columns


def is_trl_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(SPEC_PREFIX)


def spec_of(entries: list[tuple[str, float]]) -> str:
    """The algorithm.reward_fn value naming `entries` ((name, weight) each)."""
    return SPEC_PREFIX + ";".join(name if weight == 1.0 else f"{name}@{weight!r}" for name, weight in entries)


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """(name, weight) of each entry of a `trl:` value."""
    out = []
    for entry in spec[len(SPEC_PREFIX):].split(";"):
        name, at, weight = entry.rpartition("@")
        if not at:
            name, weight = entry, "1"
        try:
            value = float(weight)
        except ValueError:
            raise RewardError(f"algorithm.reward_fn entry {entry!r}: the weight after @ is not a number") from None
        if not name.strip():
            raise RewardError(f"algorithm.reward_fn={spec!r} has an empty entry (give a name, file.py:function "
                              "or package.module.function between the semicolons)")
        out.append((name.strip(), value))
    return out


# ------------------------------------------------------------------------------------------------ TRL's built-ins

def _contents(completions: list[Any]) -> list[str]:
    """The texts of TRL's completions: strings, or lists of one assistant message."""
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def _solutions(solution: list[Any] | None, who: str) -> list[Any]:
    if solution is None:
        raise KeyError(f"{who} reads the dataset's 'solution' column, which these rows lack")
    return solution


def _math_or_none(content: str, solution: Any) -> float | None:
    """TRL's accuracy, with its own math_verify calls: the gold parsed as it is; the completion's first answer in
    LaTeX (a \\boxed{} first, then only an anchored one: no bare number), verified against it; None (row skipped)
    when the gold does not parse. Timeouts of 10 s to parse and 5 s to verify, none off the main thread (math_verify
    times out by signals, which work there only), as in TRL."""
    import logging
    import threading

    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    parsing_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:  # math_verify warns on every call whose timeout is off
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    gold = parse(str(solution), parsing_timeout=parsing_timeout)
    if not gold:
        return None
    config = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                   try_extract_without_anchor=False)
    answer = parse(content, extraction_config=[config], extraction_mode="first_match", parsing_timeout=parsing_timeout)
    return float(verify(gold, answer, timeout_seconds=verify_timeout))


def accuracy_reward(completions: list[Any], solution: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
    return [_math_or_none(c, s) for c, s in zip(_contents(completions), _solutions(solution, "accuracy_reward"))]


def reasoning_accuracy_reward(completions: list[Any], solution: list[Any] | None = None,
                              reasoning_delimiters: list[str] | None = None, **kwargs: Any) -> list[float | None]:
    """accuracy_reward on what follows the reasoning (after the last delimiter, `</think>` by default); 0 for a
    completion whose reasoning never ends."""
    out: list[float | None] = []
    for content, sol in zip(_contents(completions), _solutions(solution, "reasoning_accuracy_reward")):
        delimiter = next((d for d in reasoning_delimiters or ["</think>"] if d in content), None)
        out.append(0.0 if delimiter is None else _math_or_none(content.split(delimiter)[-1], sol))
    return out


def think_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 if _THINK_RE.match(c) else 0.0 for c in _contents(completions)]


BUILT_IN: dict[str, Callable[..., list]] = {
    "accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
}


# ------------------------------------------------------------------------------------------------ loading

@dataclass(frozen=True)
class Named:
    fn: Callable[..., Any]
    weight: float
    who: str  # how the errors name it: the built-in's name, file.py:function or the dotted path


def load_entry(name: str, key: str, import_file: Callable[[Path, str], Any]) -> Callable[..., Any]:
    """The function an entry names; a one-line RewardError naming `key` when it cannot be found."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    path_str, colon, attr = name.rpartition(":")
    if colon and path_str.endswith(".py"):
        if not Path(path_str).is_file():
            raise RewardError(f"{key}: reward function file not found: {path_str} (from {Path.cwd()})")
        fn = getattr(import_file(Path(path_str), key), attr, None)
    elif "." in name and not colon:  # TRL's dotted import path, the current folder importable first
        module_path, _, attr = name.rpartition(".")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            fn = getattr(importlib.import_module(module_path), attr, None)
        except Exception as e:  # an import error of the user's module: one line naming it
            raise RewardError(f"{key}: cannot import {module_path} for reward function {name} "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    else:
        raise RewardError(f"{key}: reward function {name!r} is none of TRL's built-ins alignrl has "
                          f"({', '.join(BUILT_IN)}), a path/to/file.py:function or a package.module.function")
    if not callable(fn):
        raise RewardError(f"{key}: {name} defines no function {attr!r} (fix the name after the last separator)")
    return fn


def load(spec: str, key: str, import_file: Callable[[Path, str], Any],
         kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The weighted sum of the functions a `trl:` value names, as a per-row reward (registry signature)."""
    named = [Named(load_entry(name, key, import_file), weight, name) for name, weight in parse_spec(spec)]
    return adapt(named, dict(kwargs or {}))


def adapt(named: list[Named], extra_kwargs: dict[str, Any]) -> "TrlRewards":
    return TrlRewards(named, extra_kwargs)


class TrlRewards:
    """TRL's functions as the reward stage calls rewards: `batch` scores a rollout batch with one call of each
    function, as TRL's trainer does (a judge model or a service scores many completions at once); a call on one
    row (a timed rule's worker) is a batch of one."""

    reads_prompt = True  # `prompts` falls back on the prompt's text where the row keeps no prompt column
    reads_ids = True  # TRL's `completion_ids`: the responses' token ids

    def __init__(self, named: list[Named], extra_kwargs: dict[str, Any]):
        self.named, self.extra_kwargs = named, extra_kwargs
        self.__name__ = self.__qualname__ = "+".join(one.who for one in named)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                 prompt: str | None = None) -> float:
        value = self.batch([data_source], [solution_str], [ground_truth], [extra_info], prompts=[prompt])[0]
        if isinstance(value, ScoreError):
            raise value
        return value

    @property
    def weights(self) -> list[float]:
        return [one.weight for one in self.named]

    def batch(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict | None], prompts: Sequence[str | None] | None = None,
              completion_ids: Sequence[list[int]] | None = None) -> list[float | ScoreError]:
        """Each row's weighted sum over the functions, or the ScoreError of a value a function gave it that is
        neither a finite float nor None (the caller raises it naming the row)."""
        table = self.per_function(data_sources, solution_strs, ground_truths, extra_infos, prompts, completion_ids)
        totals: list[float | ScoreError] = [0.0] * len(solution_strs)
        for one, values in zip(self.named, table):
            for i, value in enumerate(values):
                if isinstance(totals[i], ScoreError):
                    continue  # the row's first bad value is the one told
                if isinstance(value, ScoreError):
                    totals[i] = value
                elif value is not None:
                    totals[i] += one.weight * value  # TRL's nansum: a function that skips a row leaves it to others
        return totals

    def per_function(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
                     extra_infos: Sequence[dict | None], prompts: Sequence[str | None] | None = None,
                     completion_ids: Sequence[list[int]] | None = None) -> list[list[float | ScoreError | None]]:
        """Each function's values of the rows, unweighted (one list per function, in order): a finite float, None
        (skipped) or the row's ScoreError. `ground_truths` is unused (TRL reads the columns); `completion_ids` is
        passed on where the caller has the responses' ids (not where one row's text is scored alone)."""
        columns = [dict(getattr(extra, "columns", None) or extra or {}) for extra in extra_infos]
        raw = [c.get("prompt") for c in columns]
        given = list(prompts) if prompts is not None else [None] * len(columns)
        completions = [[{"role": "assistant", "content": text}] if isinstance(p, list) else text
                       for text, p in zip(solution_strs, raw)]
        # every column any row has (a datasets row holds them all, None where missing, so TRL's first row has them)
        names = [k for k in dict.fromkeys(k for c in columns for k in c) if k not in NOT_COLUMNS]
        kwargs: dict[str, Any] = {k: [c.get(k) for c in columns] for k in names}
        kwargs.update(self.extra_kwargs, prompts=[r if r is not None else p for r, p in zip(raw, given)])
        if completion_ids is not None:
            kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
        first, n = data_sources[0] if data_sources else "", len(solution_strs)
        return [batch_values(call_one(one, completions, {**kwargs, **callbacks(one.who, n, first)}, first), one.who,
                             data_sources) for one in self.named]


def call_one(one: Named, completions: list[Any], kwargs: dict[str, Any], data_source: str) -> Any:
    try:
        got = one.fn(completions=completions, **kwargs)
        # an `async def` function, which TRL awaits: run to its end here, one call at a time
        return asyncio.run(got) if inspect.iscoroutine(got) else got
    except ScoreError:  # a bad log_metric or log_extra value: already one line naming the function
        raise
    except Exception as exc:  # a user's bug ends the run in one line naming the function, never a traceback
        text = str(exc).strip()
        cause = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        raise ScoreError(one.who, f"raised {cause}", data_source,
                         "fix it so that it returns one float (or None) per completion") from exc


def batch_values(got: Any, who: str, data_sources: Sequence[str]) -> list[float | ScoreError | None]:
    """The values of a call on the completions of rows of `data_sources`: each a finite float, None (the row skipped
    by this function) or the row's ScoreError; a ScoreError raised when the call did not give one value each."""
    n, data_source = len(data_sources), data_sources[0] if data_sources else ""
    values = got.tolist() if hasattr(got, "tolist") else got
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, (list, tuple)) or len(values) != n:
        shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(got).__name__}"
        given = "one completion" if n == 1 else f"{n} completions"
        raise ScoreError(who, f"returned {shown} for {given}", data_source, FIX)
    return [_one(value, who, source) for value, source in zip(values, data_sources)]


def _one(value: Any, who: str, data_source: str) -> float | ScoreError | None:
    """A finite float, None (skipped: None or NaN, as TRL's nansum skips both), or the row's ScoreError."""
    if value is None or (isinstance(value, numbers.Real) and math.isnan(float(value))):
        return None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return ScoreError(who, f"returned {value!r:.40} for a completion", data_source, FIX)
    return float(value)
