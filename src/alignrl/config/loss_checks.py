"""Checks of the GRPO loss options that another key would leave without effect or cannot go with: the batch-wide
std of the advantages (algorithm.grpo_std_scope)."""

from __future__ import annotations

from alignrl.config.schema import RunConfig


def loss_option_problem(cfg: RunConfig) -> str | None:
    a = cfg.algorithm
    if a.grpo_std_scope == "batch" and a.adv_estimator != "grpo":
        return (f"algorithm.grpo_std_scope=batch scales GRPO's advantages (got adv_estimator={a.adv_estimator}): "
                "set algorithm.adv_estimator=grpo, or grpo_std_scope=group")
    if a.grpo_std_scope == "batch" and not a.norm_adv_by_std_in_grpo:
        return ("algorithm.grpo_std_scope=batch picks the std the advantages are divided by, and "
                "norm_adv_by_std_in_grpo=false divides by none: set one of them back")
    return None
