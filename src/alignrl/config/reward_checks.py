"""Checks of the reward settings that another would leave without effect: the rule rewards' time limit
(algorithm.reward_timeout_s) and the normalization of the reward model's scores and the critic's values."""

from __future__ import annotations

from alignrl.config.schema import RunConfig


def reward_limit_problem(cfg: RunConfig) -> str | None:
    a = cfg.algorithm
    if a.reward_workers and not a.reward_timeout_s:
        return (f"algorithm.reward_workers={a.reward_workers} is read only with algorithm.reward_timeout_s > 0 "
                "(without a limit the rows are scored in the trainer's process): set a limit, or drop it")
    if a.reward_timeout_s and a.reward_fn_batch:
        return ("algorithm.reward_timeout_s limits each row's call, and algorithm.reward_fn_batch scores a whole "
                "batch in one call: drop one of them")
    # the critic normalizes its values whatever gives the reward (a remote reward, rule rewards), as OpenRLHF's does
    if a.reward_model_normalize and not a.reward_model and not cfg.critic.enable:
        return ("algorithm.reward_model_normalize normalizes the scores of algorithm.reward_model (a folder whose "
                "config.json holds their mean and std) and the critic's values (critic.enable), and this run has "
                "neither: give the folder, or drop it")
    return None
