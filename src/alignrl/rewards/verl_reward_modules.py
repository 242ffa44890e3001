"""verl's reward functions under verl's module names, for users' reward files written for verl
(`from verl.utils.reward_score import default_compute_score, math_dapo`, `from verl.utils.reward_score.math import
compute_score`): when verl is not installed, `provide` registers alignrl's rules as

* `verl.utils.reward_score`: `default_compute_score(data_source, solution_str, ground_truth, extra_info=None,
  sandbox_fusion_url=None, concurrent_semaphore=None, memory_limit_mb=None, **kwargs)`, by the built-in rules of
  the registry (a dict result, as the DAPO rule's, is returned as it is, as verl does);
* `.gsm8k`, `.math`, `.math_dapo`, `.search_r1_like_qa_em`, `.geo3k` (`compute_score(predict_str, ground_truth,
  use_boxed=True, format_score=0.1)`, `format_reward`, `acc_reward`) and `.prime_math` (`compute_score(model_output,
  ground_truth)` returning verl's (right, well formatted, answer), `match_answer`, `grade_answer`), each with verl's
  `compute_score` signature.

verl's other modules (prime_code, sandbox_fusion, ...) have no alignrl equivalent and are not provided: a file
importing them fails to import, naming the module. An installed verl's modules are used as they are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from alignrl.config.sandbox_schema import SandboxConfig
from alignrl.rewards import code, geo3k, gsm8k, math_dapo, prime_math, qa_em
from alignrl.rewards import math as math_reward
from alignrl.utils.user_files import provide_modules

PACKAGE = "verl.utils.reward_score"
DOC = "verl's reward_score modules, as alignrl provides them (verl is not installed)"
MATH_DAPO_NAMES = ("compute_score", "verify", "is_correct_minerva", "is_correct_strict_box", "normalize_final_answer",
                   "last_boxed_only_string", "remove_boxed")


def provide(rewards: Mapping[str, Callable[..., Any]]) -> None:
    """Registers the modules above, scoring `default_compute_score` by `rewards` ({data_source: reward}), unless
    verl's own import. Repeated calls find them registered and change nothing."""
    if not verl_missing():
        return
    default_compute_score = make_default_compute_score(rewards)
    provide_modules({
        PACKAGE: {"default_compute_score": default_compute_score,
                  "_default_compute_score": default_compute_score},  # verl's older, deprecated name
        f"{PACKAGE}.gsm8k": {"compute_score": gsm8k.compute_score},
        f"{PACKAGE}.math": {"compute_score": math_reward.compute_score},
        f"{PACKAGE}.math_dapo": {name: getattr(math_dapo, name) for name in MATH_DAPO_NAMES},
        f"{PACKAGE}.search_r1_like_qa_em": {"compute_score": search_r1_compute_score, "em_check": qa_em.em_check,
                                            "normalize_answer": qa_em.normalize_answer,
                                            "extract_solution": qa_em.extract_answer},
        f"{PACKAGE}.geo3k": {name: getattr(geo3k, name) for name in ("compute_score", "format_reward", "acc_reward")},
        f"{PACKAGE}.prime_math": {name: getattr(prime_math, name)
                                  for name in ("compute_score", "match_answer", "grade_answer")},
    }, DOC)


def verl_missing() -> bool:
    """Whether `verl.utils.reward_score` cannot be imported because verl (or its utils: the repository's own `verl`
    package holds only the trainer's entry point) is absent. An installed verl that fails to import for another
    reason is left alone: the user's file then reports that failure as its own import error."""
    try:
        importlib.import_module(PACKAGE)
    except ModuleNotFoundError as exc:
        return (exc.name or "").startswith("verl")
    except Exception:  # a broken installed verl: not ours to replace
        return False
    return False


def make_default_compute_score(rewards: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    """verl's `default_compute_score` over `rewards`; verl's code sets run the response's program on their cases, on
    the SandboxFusion service at `sandbox_fusion_url` when given, else on this machine (as verl's prime_code)."""

    def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                              extra_info: dict[str, Any] | None = None, sandbox_fusion_url: str | None = None,
                              concurrent_semaphore: Any = None, memory_limit_mb: int | None = None,
                              **kwargs: Any) -> float | dict[str, Any]:
        # concurrent_semaphore bounds verl's calls to its sandbox across threads; the code reward bounds its own
        # runs, so it (and any keyword of a newer verl that no alignrl rule reads) is accepted and unused.
        if data_source in code.DATA_SOURCES:
            return float(code_reward(sandbox_fusion_url, memory_limit_mb)(solution_str, ground_truth))
        fn = rewards.get(data_source)
        if fn is None:  # verl's exception, so that a file catching it keeps working
            raise NotImplementedError(f"Reward function is not implemented for data_source={data_source!r} "
                                      "(no built-in rule of alignrl scores it)")
        value = fn(solution_str, ground_truth)
        return value if isinstance(value, dict) else float(value)

    return default_compute_score


def code_reward(sandbox_fusion_url: str | None, memory_limit_mb: int | None) -> code.CodeReward:
    """The code reward of one sandbox URL and memory limit (made once: `code.code_reward` keeps it)."""
    if sandbox_fusion_url is None:
        return code.LOCAL
    return code.code_reward(SandboxConfig(url=sandbox_fusion_url,
                                          memory_limit_mb=memory_limit_mb or code.CodeSettings().memory_mb))


def search_r1_compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                            score: float = 1.0) -> float:
    """verl's `search_r1_like_qa_em.compute_score`: exact match on the last <answer>, a correct one among more than
    10 answer tags earning a quarter. verl accepts `method` and reads it nowhere; so does this."""
    return qa_em.compute_score_tag_capped(solution_str, ground_truth, format_score, score)
