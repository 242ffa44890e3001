"""The sampling parameters an environment's `step` reads and may change (OpenRLHF's states["sampling_params"]).

OpenRLHF hands `step` the vLLM SamplingParams the turn was sampled with and, when `step` returns a "sampling_params",
samples that episode's next turns with it. Here `step` gets a `StepSampling`: vLLM's attribute names for the fields
alignrl's SamplingParams has (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, stop, seed, and n,
which stays 1). What `step` changes, on that object in place or in the one it returns (that object, a vLLM
SamplingParams, or a dict with those names), applies to the episode's following turns; a field left as it was given
changes nothing, so an environment that hands the object back unchanged (as OpenRLHF's examples do) samples as before.
`max_tokens` caps each following turn, never past the room left under the episode's response cap; None lifts the
per-turn cap (the room left).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from alignrl.interfaces import SamplingParams
from alignrl.rollout.environments import EnvironmentStepError

_BAD = object()


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def _whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _stop(v: Any) -> Any:
    items = [v] if isinstance(v, str) else [] if v is None else v
    return tuple(items) if isinstance(items, (list, tuple)) and all(isinstance(x, str) for x in items) else _BAD


# vLLM's name -> (alignrl's SamplingParams field, the value in alignrl's form or _BAD, what the field takes)
FIELDS = {
    "temperature": ("temperature", lambda v: float(v) if _real(v) and v >= 0 else _BAD, "a number >= 0 (0: greedy)"),
    "top_p": ("top_p", lambda v: float(v) if _real(v) and 0 < v <= 1 else _BAD, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: (int(v) if v >= 1 else -1) if _whole(v) and v >= -1 else _BAD,
              "an integer >= 1, or -1 or 0 for no top-k"),
    "min_p": ("min_p", lambda v: float(v) if _real(v) and 0 <= v <= 1 else _BAD, "a number in [0, 1] (0: off)"),
    "repetition_penalty": ("repetition_penalty", lambda v: float(v) if _real(v) and v > 0 else _BAD,
                           "a number > 0 (1: off)"),
    "max_tokens": ("max_new_tokens", lambda v: None if v is None else int(v) if _whole(v) and v >= 1 else _BAD,
                   "an integer >= 1, or None for the room left"),
    "stop": ("stop", _stop, "a string or a list of strings"),
    "seed": ("seed", lambda v: None if v is None else int(v) if _whole(v) else _BAD, "an integer or None"),
    "n": ("n", lambda v: 1 if _whole(v) and v == 1 else _BAD, "1 (each turn samples one response per episode)"),
}


class StepSampling:
    """The turn's sampling parameters under vLLM's names, as `step` reads them; setting a name vLLM has but alignrl
    cannot apply (presence_penalty, logprobs, ...) is refused at once rather than ignored."""

    def __init__(self, owner: str, **values):
        object.__setattr__(self, "_owner", owner)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise EnvironmentStepError(f"{self._owner}.step set sampling_params.{name}, which alignrl does not apply; "
                                       f"set only {', '.join(FIELDS)}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return "SamplingParams(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in FIELDS) + ")"


def for_step(params: SamplingParams, max_tokens: int, owner: str) -> tuple[StepSampling, dict[str, Any]]:
    """The object `step` gets for a turn sampled with `params` and at most `max_tokens` tokens, and its values as
    given (alignrl's form), to tell what `step` changed."""
    given = {"temperature": params.temperature, "top_p": params.top_p, "top_k": max(params.top_k, 0) or -1,
             "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
             "max_tokens": max_tokens, "stop": tuple(params.stop), "seed": params.seed, "n": 1}
    return StepSampling(owner, **dict(given, stop=list(params.stop))), given


def changes(got: Any, passed: StepSampling, given: dict[str, Any], owner: str) -> dict[str, Any]:
    """alignrl's fields (SamplingParams names) that `step` changed: in `got`, the "sampling_params" it returned, else
    (None) in the object it was given. One line for a name or value alignrl cannot apply."""
    source = passed if got is None else got
    if isinstance(source, dict):
        unknown = [str(k) for k in source if k not in FIELDS]
        if unknown:
            raise EnvironmentStepError(f"{owner}.step returned sampling_params with {unknown[0]!r}, which alignrl "
                                       f"does not apply; use only {', '.join(FIELDS)}")
        values = source
    else:  # the object given, or another with vLLM's attributes (a vLLM SamplingParams): its other fields unread
        values = {k: getattr(source, k) for k in FIELDS if hasattr(source, k)}
        if not values:
            raise EnvironmentStepError(f"{owner}.step returned a {type(source).__name__} as 'sampling_params'; return "
                                       "the states' sampling_params (changed) or a dict such as {'temperature': 0.5}")
    out = {}
    for name, value in values.items():
        try:
            key, value_here = vllm_setting(name, value)
        except ValueError as e:
            raise EnvironmentStepError(f"{owner}.step gave sampling_params {name}={value!r}; give {e}") from None
        if value_here != given[name]:
            out[key] = value_here
    return out


def vllm_setting(name: str, value: Any) -> tuple[str, Any]:
    """(alignrl's SamplingParams field, the value in alignrl's form) of one of vLLM's sampling settings (`FIELDS`); a
    ValueError saying what the setting takes when the value is none of that."""
    key, norm, takes = FIELDS[name]
    value_here = norm(value)
    if value_here is _BAD:
        raise ValueError(takes)
    return key, value_here


def applied(params: SamplingParams, over: dict[str, Any], most: int) -> SamplingParams:
    """`params` with an episode's changes (alignrl's names); max_tokens None is `most` (the room left decides)."""
    if not over:
        return params  # the run's own object: episodes without changes share one generate call, as before
    fields = dict(over)
    if "max_new_tokens" in fields and fields["max_new_tokens"] is None:
        fields["max_new_tokens"] = most
    return dataclasses.replace(params, **fields)
