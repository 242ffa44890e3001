"""algorithm.adv_estimator: the estimators a run's other keys cannot go with, and verl's estimators alignrl cannot
compute, each refused with one line naming what is missing and what to use instead."""

from __future__ import annotations

from alignrl.config.schema import RunConfig

# each sample is measured against the others of its prompt: alone, every advantage would be 0 (grpo_passk: verl's
# raises) and the run would train on nothing but its KL and entropy terms
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gdpo", "grpo_passk", "rloo_vectorized",
                    "grpo_vectorized")

_SUM_PI_SQUARED = ("needs each generated token's sum of squared probabilities over the whole vocabulary (verl's "
                   "actor.calculate_sum_pi_squared), which alignrl's actor does not compute: use grpo, or rloo")
# (key, value) -> why the value is refused, for values of a choice that a verl script can name
UNAVAILABLE = {
    ("algorithm.adv_estimator", "optimal_token_baseline"):
        f"algorithm.adv_estimator=optimal_token_baseline (verl's per-token optimal baseline) {_SUM_PI_SQUARED}",
    ("algorithm.adv_estimator", "tir_optimal_token_baseline"):
        f"algorithm.adv_estimator=tir_optimal_token_baseline (verl's multi-turn optimal token baseline) "
        f"{_SUM_PI_SQUARED}",
}


def estimator_problem(cfg: RunConfig) -> str | None:
    alg = cfg.algorithm
    if cfg.rollout.n < 2 and alg.adv_estimator in GROUP_ESTIMATORS:
        return (f"algorithm.adv_estimator={alg.adv_estimator} compares the samples of each prompt: "
                f"rollout.n={cfg.rollout.n} leaves none to compare with; set rollout.n >= 2 (verl's "
                "actor_rollout_ref.rollout.n), or use reinforce_plus_plus or remax")
    if alg.outcome_baseline != "none" and alg.adv_estimator != "reinforce_plus_plus":
        return (f"algorithm.outcome_baseline={alg.outcome_baseline} shapes REINFORCE++'s outcome rewards: "
                f"set algorithm.adv_estimator=reinforce_plus_plus, or outcome_baseline=none")
    if alg.outcome_baseline != "none" and cfg.rollout.n < 2:
        return (f"algorithm.outcome_baseline={alg.outcome_baseline} compares the samples of each prompt: "
                f"set rollout.n >= 2, or outcome_baseline=none")
    if alg.whiten_advantages != "std" and alg.adv_estimator not in ("reinforce_plus_plus", "gae"):
        return (f"algorithm.whiten_advantages={alg.whiten_advantages} applies to reinforce_plus_plus and "
                f"gae (got {alg.adv_estimator}): drop it, or pick one of those estimators")
    return None
