"""algorithm.adv_estimator: the estimators a run's other keys cannot go with, and verl's estimators alignrl cannot
compute, each refused with one line naming what is missing and what to use instead. The optimal token baselines ask
nothing of rollout.n: as in verl, a response alone in its group keeps its reward-to-go."""

from __future__ import annotations

from alignrl.config.schema import RunConfig

# each sample is measured against the others of its prompt: alone, every advantage would be 0 (grpo_passk: verl's
# raises) and the run would train on nothing but its KL and entropy terms
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gdpo", "grpo_passk", "rloo_vectorized",
                    "grpo_vectorized")

# (key, value) -> why the value is refused, for values of a choice that a verl script can name; none at present: every
# verl estimator in algorithm.adv_estimator's choices is computed (the optimal token baselines: core.token_baseline)
UNAVAILABLE: dict[tuple[str, str], str] = {}


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
