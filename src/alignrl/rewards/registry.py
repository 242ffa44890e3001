"""Choose the reward function for a sample, by its `data_source` or a user-supplied file.

The calling convention is verl's `compute_score(data_source, solution_str, ground_truth,
extra_info)`, so reward files written for verl work here unchanged via `algorithm.reward_fn`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from alignrl.rewards import code, geo3k, gsm8k, math_dapo, prime_math
from alignrl.rewards import math as math_reward
from alignrl.rewards import openrlhf_reward, qa_em, think_answer, trl_reward, verl_reward_modules
from alignrl.rewards.batch_reward import BatchedReward
from alignrl.rewards.errors import RewardError, ScoreError
from alignrl.rewards.values import RowScore, TimedOut, plain_number
from alignrl.utils.user_files import import_user_file


def finite_score(value: Any, who: str, data_source: str) -> float:
    """`value` as a float when it is a finite real number (bool, int, float, numpy scalar); else a
    ScoreError: a NaN reward trains every weight into NaN, and a string or None fails far from its cause.
    A dict with a "score" (verl's functions may return one, with extra information beside it) gives its score, with
    its "filter_score" (an OpenRLHF reward file's "scores"), "acc" (verl's: whether the answer is right) and all its
    numbers by key (the components verl's GDPO reads) riding along as a RowScore."""
    if isinstance(value, RowScore):
        return value  # checked when it was made
    if isinstance(value, dict):
        if "score" not in value:
            raise ScoreError(who, f"returned a dict without a 'score' key (keys {sorted(map(str, value))[:5]})",
                             data_source, "return a finite float, or {'score': float, ...} as verl's functions do")
        filtered, acc = value.get("filter_score"), solved(value.get("acc"))
        parts = _numbers(value)
        if filtered is not None or acc is not None or parts:
            return RowScore(finite_score(value["score"], who, data_source),
                            None if filtered is None else finite_score(filtered, who, data_source), acc, parts)
        value = value["score"]
    if not isinstance(value, (numbers.Real, np.bool_)):  # numpy's bool is not registered as Real
        shown = "None" if value is None else f"a {type(value).__name__} ({value!r:.40})"
        raise ScoreError(who, f"returned {shown}", data_source, "return a finite float")
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        x = math.inf
    if not math.isfinite(x):
        raise ScoreError(who, f"returned {x}", data_source, "return a finite float")
    return x


def _numbers(value: dict) -> dict[str, float]:
    """The dict's real numbers by key (as floats; an int too large for one is inf, for its user to be told)."""
    out = {}
    for k, v in value.items():
        v = plain_number(v)
        if isinstance(v, (numbers.Real, np.bool_)):
            try:
                out[str(k)] = float(v)
            except OverflowError:
                out[str(k)] = math.inf
    return out


def solved(acc: Any) -> bool | None:
    """Whether verl's "acc" beside a score says the answer is right: a bool, or a number (1 or more: right, as a
    score of 1 is); None for anything else, which is then information beside the score, as verl logs it."""
    acc = plain_number(acc)
    if isinstance(acc, bool):
        return acc
    if isinstance(acc, numbers.Real) and math.isfinite(float(acc)):
        return float(acc) >= 1.0
    return None


class RewardFn(Protocol):
    """Scores one completion against its reference answer (verl's `compute_score` signature)."""

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict[str, Any] | None = None,
    ) -> float: ...


class RewardTable(dict):
    """{data_source: reward}, also answering for the names that start with one of `prefixes`' keys (verl scores every
    data_source starting with "aime" by the DAPO rule): `in`, `[]` and `get` see them, so the data checks made before
    a run and the evaluator read the same table as the reward stage."""

    def __init__(self, exact: dict[str, Callable[..., Any]], prefixes: dict[str, Callable[..., Any]]):
        super().__init__(exact)
        self.prefixes = prefixes

    def by_prefix(self, key: object) -> Callable[..., Any] | None:
        """The reward of the first prefix `key` starts with (None: none)."""
        if isinstance(key, str):
            for prefix, fn in self.prefixes.items():
                if key.startswith(prefix):
                    return fn
        return None

    def __missing__(self, key: object) -> Callable[..., Any]:
        fn = self.by_prefix(key)
        if fn is None:
            raise KeyError(key)
        return fn

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or self.by_prefix(key) is not None

    def get(self, key: object, default: Any = None) -> Any:
        return self[key] if key in self else default


QA_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")  # Search-R1's
# A reward returns a float, or verl's dict whose "score" is the reward (the DAPO rule's: score, acc, pred).
REWARDS: RewardTable = RewardTable({
    "gsm8k": gsm8k.compute_score,
    "openai/gsm8k": gsm8k.compute_score,
    "synthetic_arith": gsm8k.compute_score,
    "math": math_reward.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "math_dapo": math_dapo.compute_score,  # verl's DAPO rule: the last "Answer:" line, +1 right, -1 otherwise
    think_answer.DATA_SOURCE: think_answer.compute_score,  # R1 format bonus + math accuracy (LMM-R1's rule)
    # Search-R1's QA sets (its data_source names); ground truth may be {"target": [...]}, a list or a string
    **{name: qa_em.compute_score for name in QA_SETS},
    # verl's Search-R1-like example tags them searchR1_<set> and quarters a correct answer among > 10 answer tags
    **{f"searchR1_{name}": qa_em.compute_score_tag_capped for name in QA_SETS},
    # verl's code sets: the response's program run on the row's test cases (locally unless a sandbox is set)
    **{name: code.LOCAL for name in code.DATA_SOURCES},
    # verl's vision-language examples' data: 0.9 x a right \boxed{} answer + 0.1 x the <think>...</think> format
    geo3k.DATA_SOURCE: geo3k.graded,  # a right answer counts as solved with or without the format
    # PRIME's NuminaMath sets: 1.0 for a right answer, picked as verl's prime_math picks it, else 0.0
    **{name: prime_math.score for name in prime_math.DATA_SOURCES},
}, prefixes={"aime": math_dapo.compute_score})  # AIME sets: aime_2024, aime2025, ... (verl's routing)
# rules whose reference is an answer's text (or a number): (reward, why a ground truth is not one, the rule's name)
TEXT_REFERENCES: tuple[tuple[Callable[..., Any], Callable[[Any], str | None], str], ...] = (
    (geo3k.graded, math_dapo.text_reference_problem, "geo3k"),
    (prime_math.score, math_dapo.text_reference_problem, "PRIME math"),
)


def ground_truth_problem(data_source: str, ground_truth: Any) -> str | None:
    """Why the built-in reward of `data_source` cannot read `ground_truth` (None: it can), asked as the data loads:
    the reward meets it only once a sampled answer reaches it, steps into a run."""
    if REWARDS.get(data_source) in (qa_em.compute_score, qa_em.compute_score_tag_capped):
        try:
            qa_em.targets(ground_truth)
        except ValueError as e:
            return (f"{e}; Search-R1's QA rewards read reward_model.ground_truth as {{'target': [...]}}, a list or "
                    "a string")
    if data_source in code.DATA_SOURCES:
        try:
            code.parse_cases(ground_truth)
        except ValueError as e:
            return f"{e} (the code reward of data_source {data_source!r} runs the response on them)"
    for reward, reference_problem, rule in TEXT_REFERENCES:
        if REWARDS.get(data_source) is reward and (problem := reference_problem(ground_truth)) is not None:
            return (f"{problem}; the {rule} reward of data_source {data_source!r} reads reward_model.ground_truth "
                    "as the answer's text")
    if REWARDS.get(data_source) is math_dapo.compute_score:
        problem = math_dapo.reference_problem(ground_truth)
        if problem is not None:
            return (f"{problem}; the DAPO math reward of data_source {data_source!r} reads reward_model.ground_truth "
                    "as the answer's text")
    return None


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
) -> float:
    """Score with the built-in rule for `data_source`; unknown sources are an error, not a 0 reward,
    because silently rewarding nothing would make a run train on pure noise."""
    fn = REWARDS.get(data_source)
    if fn is None:
        raise RewardError(
            f"no built-in reward for data_source {data_source!r} (known: {', '.join(sorted(REWARDS))}, and names "
            f"starting with {', '.join(map(repr, REWARDS.prefixes))}; "
            "for other data pass algorithm.reward_fn=path/to/file.py:function)"
        )
    # a dict's "acc" and a RowScore's correctness ride along (finite_score): the accuracy counts by them
    return finite_score(fn(solution_str, ground_truth), "the built-in reward", data_source)


def with_code_reward(code_reward: code.CodeReward) -> RewardFn:
    """The built-in rules with the code sets scored by `code_reward` (a run's sandbox and limits)."""

    def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict[str, Any] | None = None) -> float:
        if data_source in code.DATA_SOURCES:
            return code_reward(solution_str, ground_truth)
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)

    return compute_score


ZERO = "zero"  # algorithm.reward_fn=zero: no task reward (on-policy distillation's reward is the KL term alone)


def zero_reward(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: dict[str, Any] | None = None) -> float:
    """0.0 for every row, whatever its data_source or answer: the run's reward is its KL term alone."""
    return 0.0


def load_reward_fn(spec: str | None, key: str = "algorithm.reward_fn", code_reward: code.CodeReward | None = None,
                   kwargs: dict[str, Any] | None = None, batched: bool = False) -> RewardFn:
    """`None` gives `default_compute_score`; "zero" `zero_reward`; "path/to/file.py:function" loads that function,
    `checked`;
    "openrlhf:path/to/file.py" the file's OpenRLHF `reward_func(queries, prompts, labels)`, called one row at a time
    (alignrl.rewards.openrlhf_reward); "trl:..." TRL's reward functions, weighted (alignrl.rewards.trl_reward).
    `key`: the config key that named it, for the errors. A relative path is taken from the current folder, as verl's
    custom_reward_function.path. `code_reward`: how the built-in rules run code;
    `kwargs`: keyword arguments the user's function is called with (verl's reward_kwargs); `batched`: it scores a whole
    batch in one call (`batch_reward`, verl's batch manager)."""
    if batched and (spec in (None, ZERO) or openrlhf_reward.is_openrlhf_spec(spec) or trl_reward.is_trl_spec(spec)):
        raise RewardError(f"algorithm.reward_fn_batch needs {key}=path/to/file.py:function, a function taking "
                          "data_sources=, solution_strs=, ground_truths=, extra_infos= (verl's reward_manager=batch)")
    if spec is None:
        return default_compute_score if code_reward is None else with_code_reward(code_reward)
    if spec == ZERO:  # a name, not a file: nothing to import, nothing a row's data_source must match
        return zero_reward
    if openrlhf_reward.is_openrlhf_spec(spec):
        path_str = spec[len(openrlhf_reward.SPEC_PREFIX):]
        return checked(openrlhf_reward.load(path_str, key, import_file), f"{path_str}:{openrlhf_reward.FUNCTION}")
    if trl_reward.is_trl_spec(spec):  # TRL's reward functions, weighted; each names itself in its one-line errors
        return trl_reward.load(spec, key, import_file, kwargs)
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str or not name:
        raise RewardError(
            f"{key}={spec!r} is not of the form path/to/file.py:function"
        )
    path = Path(path_str)
    if not path.is_file():
        raise RewardError(f"{key} file not found: {path_str} (from {Path.cwd()}; give an existing .py file, "
                          "relative to the folder the run starts in, or an absolute path)")
    module = import_file(path, key)
    if not hasattr(module, name):
        raise RewardError(f"{key} file {path_str} has no function {name!r} "
                          "(define it or fix the name after the colon)")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"{key} {path_str}:{name} is a {type(fn).__name__}, not a function")
    if kwargs:  # verl binds its reward_kwargs to the function the same way
        fn = functools.partial(fn, **kwargs)
    return BatchedReward(fn, spec) if batched else checked(fn, spec)


def import_file(path: Path, key: str):
    """The user's Python file `path` imported as a module; a failure is one RewardError line naming `key`. verl's
    reward_score modules are importable by it, verl's own when installed, else alignrl's (`provide_verl_rewards`,
    which `import_user_file` calls)."""
    return import_user_file(path, key, RewardError, "alignrl_custom_reward_")


def provide_verl_rewards() -> None:
    """verl's reward_score modules scoring by the built-in rules, where verl is not installed (verl_reward_modules)."""
    verl_reward_modules.provide(REWARDS)


def user_fn_options(algorithm) -> dict[str, Any]:
    """How a run's algorithm section calls its reward function: load_reward_fn's kwargs and batched."""
    return {"kwargs": dict(algorithm.reward_fn_kwargs), "batched": algorithm.reward_fn_batch}


def run_rule(cfg, which: str) -> RewardFn:
    """A run's rule (`cfg` a RunConfig): "reward", algorithm.reward_fn or the built-in rules (code on the sandbox
    section's runner), or "cost", safety.cost_fn. The reward stage, the held-out evaluation and the workers of a
    timed rule (`timed_rules`, which call it by name) each load theirs with it."""
    if which == "cost":
        return load_reward_fn(cfg.safety.cost_fn, "safety.cost_fn")
    return load_reward_fn(cfg.algorithm.reward_fn, code_reward=code.code_reward(cfg.sandbox),
                          **user_fn_options(cfg.algorithm))


def check_user_fns(cfg) -> None:
    """The user's reward and cost functions of a RunConfig import and exist (RewardError naming the key if not):
    checked before a launch, ahead of any model load."""
    load_reward_fn(cfg.algorithm.reward_fn, **user_fn_options(cfg.algorithm))
    if cfg.safety.cost_fn:
        load_reward_fn(cfg.safety.cost_fn, "safety.cost_fn")


def checked(fn: Callable[..., Any], who: str) -> RewardFn:
    """`fn` (a user's function, named `who`) with whatever it raises, and any return that is not a finite
    real number, turned into a one-line ScoreError: a user's bug must not end a run in a traceback."""

    def call(data_source: str, solution_str: str, ground_truth: Any,
             extra_info: dict[str, Any] | None = None, prompt: str | None = None) -> float:
        try:
            value = score_row(fn, data_source, solution_str, ground_truth, extra_info, prompt)
        except Exception as exc:
            text = str(exc).strip()
            cause = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
            raise ScoreError(who, f"raised {cause}", data_source,
                             "fix it so that it returns a float (e.g. 0.0 for answers it cannot score)") from exc
        return finite_score(value, who, data_source)

    call.__name__ = call.__qualname__ = who
    call.reads_prompt = reads_prompt_text(fn)
    return call


def reads_prompt_text(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes the prompt's text (a `prompt=` keyword) beside verl's four arguments: OpenRLHF's reward
    files read the query, the prompt followed by the response."""
    return bool(getattr(fn, "reads_prompt", False))


def score_row(fn: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any,
              extra_info: dict[str, Any] | None, prompt: str | None) -> Any:
    """`fn` on one row, given the prompt's text only when it reads it (verl's functions take four arguments)."""
    if reads_prompt_text(fn):
        return fn(data_source, solution_str, ground_truth, extra_info, prompt=prompt)
    return fn(data_source, solution_str, ground_truth, extra_info)


def make_reward(spec: str | None, format_weight: float = 0.0, code_reward: code.CodeReward | None = None,
                **options: Any) -> RewardFn:
    """The reward from `spec` (the built-in rules scoring code with `code_reward` when given), plus `format_weight`
    times the `#### N` format bonus when nonzero (`with_format_bonus`)."""
    return with_format_bonus(load_reward_fn(spec, code_reward=code_reward, **options), format_weight)


def with_format_bonus(base: RewardFn, format_weight: float) -> RewardFn:
    """`base` plus `format_weight` times the `#### N` format bonus; `base` itself when the weight is 0, so that a
    reward stage given both sees they are one function and scores each row once (the correctness is the reward).

    The bonus gives a shaped signal early in training, before correct answers are common.
    """
    if format_weight == 0.0:
        return base

    def reward(
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict[str, Any] | None = None,
        prompt: str | None = None,
    ) -> float:
        correctness = score_row(base, data_source, solution_str, ground_truth, extra_info, prompt)
        return float(correctness) + format_weight * gsm8k.format_reward(solution_str)

    reward.reads_prompt = reads_prompt_text(base)
    who = getattr(base, "__name__", repr(base))

    def plus_bonus(values: list[Any], texts: Sequence[str], data_sources: Sequence[str]) -> list[Any]:
        return [_plus_bonus(v, who, ds, format_weight * gsm8k.format_reward(text))
                for v, text, ds in zip(values, texts, data_sources)]

    if getattr(base, "rows", None) is not None:  # a timed rule scores a batch in its workers: the bonus is added here
        reward.rows = lambda calls: plus_bonus(base.rows(calls), [c[1] for c in calls], [c[0] for c in calls])
    if getattr(base, "batch", None) is not None:  # a batch function (a judge) keeps its one call per batch
        reward.batch = lambda sources, texts, truths, extras, **more: plus_bonus(
            base.batch(sources, texts, truths, extras, **more), texts, sources)
        reward.reads_ids = bool(getattr(base, "reads_ids", False))
    return reward


def _plus_bonus(value: Any, who: str, data_source: str, bonus: float) -> Any:
    """A batch's value of one row plus its format bonus; a failed row's error (its own, or a bad value's) stays
    the row's value, for the caller to raise with the row's place."""
    if isinstance(value, (ScoreError, TimedOut)):
        return value
    try:
        return finite_score(value, who, data_source) + bonus
    except ScoreError as e:
        return e
