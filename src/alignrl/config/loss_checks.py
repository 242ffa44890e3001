"""Checks of the GRPO loss options that another key would leave without effect or cannot go with: the batch-wide
std of the advantages (algorithm.grpo_std_scope), two-sided clipping (actor.clip_ratio_delta), the ratio-weighted
KL term (actor.kl_loss_ratio_weighted), the high-entropy tokens' policy term (actor.top_entropy_quantile), VESPO's
sequence weight (actor.policy_loss=vespo) and the clip of a sequence's likelihood ratio (actor.policy_loss=
seq_ppo_clip)."""

from __future__ import annotations

from alignrl.config.schema import RunConfig

DELTA_LOSSES = ("ppo_clip", "gspo", "luspo")  # the losses with an unclipped ratio term to cap
# one advantage per sequence, what seq_ppo_clip's ratio weighs
SEQUENCE_ESTIMATORS = ("rloo", "grpo", "gpg", "opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized")


def loss_option_problem(cfg: RunConfig) -> str | None:
    a = cfg.algorithm
    if a.multi_objective_aggregation == "normalize_then_sum":
        return _normalize_each_problem(cfg)
    if a.adv_estimator == "gdpo" or a.gdpo_reward_keys or a.gdpo_reward_weights:
        return _gdpo_problem(cfg)
    if a.grpo_std_scope == "batch" and a.adv_estimator not in ("grpo", "rloo"):
        return (f"algorithm.grpo_std_scope=batch scales GRPO's or RLOO's advantages (got adv_estimator="
                f"{a.adv_estimator}): set algorithm.adv_estimator=grpo or rloo, or grpo_std_scope=group")
    if a.grpo_std_scope == "batch" and not a.norm_adv_by_std_in_grpo:
        return ("algorithm.grpo_std_scope=batch picks the std the advantages are divided by, and "
                "norm_adv_by_std_in_grpo=false divides by none: set one of them back")
    return _actor_problem(cfg)


def _gdpo_problem(cfg: RunConfig) -> str | None:
    """verl's GDPO reads each named component of a rule reward's dict apart; the advantage whitens their sum."""
    a = cfg.algorithm
    if a.adv_estimator != "gdpo":
        return (f"algorithm.gdpo_reward_keys/gdpo_reward_weights act with algorithm.adv_estimator=gdpo (got "
                f"{a.adv_estimator}): set it, or drop them")
    if not a.gdpo_reward_keys or not all(isinstance(k, str) and k for k in a.gdpo_reward_keys):
        return ("algorithm.adv_estimator=gdpo normalizes each reward component apart: name them, e.g. "
                "algorithm.gdpo_reward_keys=[format_reward,accuracy_reward] (keys of the dict compute_score returns)")
    if a.gdpo_reward_weights and len(a.gdpo_reward_weights) != len(a.gdpo_reward_keys):
        return (f"algorithm.gdpo_reward_weights has {len(a.gdpo_reward_weights)} weight(s) for "
                f"{len(a.gdpo_reward_keys)} gdpo_reward_keys: give one each, or none (1 each)")
    shaped = [k for k, on in (("algorithm.reward_model", a.reward_model), ("services.reward_url",
                                                                             cfg.services.reward_url),
                              ("agent.env_path", cfg.agent.env_path), ("algorithm.use_kl_in_reward",
                                                                         a.use_kl_in_reward),
                              ("algorithm.overlong_buffer_len", a.overlong_buffer_len),
                              ("algorithm.format_reward_weight", a.format_reward_weight),
                              ("algorithm.truncated_reward_coef", a.truncated_reward_coef is not None),
                              ("algorithm.missing_eos_penalty", a.missing_eos_penalty),
                              ("algorithm.reward_clip", a.reward_clip),
                              ("algorithm.grpo_std_scope=batch", a.grpo_std_scope == "batch")) if on]
    if shaped:  # verl's GDPO reads the components alone: what these add to the reward would change nothing
        return (f"algorithm.adv_estimator=gdpo trains on the reward function's components alone, which {shaped[0]} "
                "would not reach: drop it")
    return _actor_problem(cfg)


def _normalize_each_problem(cfg: RunConfig) -> str | None:
    """normalize_then_sum (TRL's GDPO) reads each of a TRL reward's functions apart, then whitens the batch."""
    a, what = cfg.algorithm, "algorithm.multi_objective_aggregation=normalize_then_sum"
    if not (a.reward_fn or "").startswith("trl:") or a.reward_model or cfg.services.reward_url:
        return (f"{what} normalizes each of a TRL reward's functions (algorithm.reward_fn=trl:f;g), with no reward "
                "model: name the functions, or drop it")
    if a.format_reward_weight or a.reward_timeout_s:
        return (f"{what} reads each function's values as they are: drop algorithm.format_reward_weight and "
                "algorithm.reward_timeout_s")
    shaped = [k for k, on in (("algorithm.overlong_buffer_len", a.overlong_buffer_len),
                              ("algorithm.truncated_reward_coef", a.truncated_reward_coef is not None),
                              ("algorithm.missing_eos_penalty", a.missing_eos_penalty),
                              ("algorithm.reward_clip", a.reward_clip), ("agent.env_path", cfg.agent.env_path)) if on]
    if shaped:  # each reads or shapes the reward in its own units, where this one is normalized
        return f"{what} leaves the reward normalized, which {shaped[0]} would shape or replace in its units: drop it"
    if (a.adv_estimator, a.grpo_std_scope, a.norm_adv_by_std_in_grpo) != ("grpo", "batch", True):
        return (f"{what} ends, as TRL's, by dividing by the whole batch's std: set algorithm.adv_estimator=grpo, "
                "grpo_std_scope=batch and norm_adv_by_std_in_grpo=true")
    return _actor_problem(cfg)


def _actor_problem(cfg: RunConfig) -> str | None:
    a = cfg.actor
    if a.clip_ratio_delta is not None and a.policy_loss not in DELTA_LOSSES:
        return (f"actor.clip_ratio_delta caps the unclipped ratio term of actor.policy_loss={', '.join(DELTA_LOSSES)} "
                f"({a.policy_loss} has none): drop it, or pick one of them")
    if a.clip_ratio_delta is not None and a.clip_ratio_delta <= 1 + a.clip_ratio_high:
        return (f"actor.clip_ratio_delta={a.clip_ratio_delta} must be above 1 + actor.clip_ratio_high "
                f"({1 + a.clip_ratio_high:g}), or the cap binds before the clip does")
    if a.kl_loss_ratio_weighted and not (a.use_kl_loss and a.kl_loss_coef > 0):
        return ("actor.kl_loss_ratio_weighted weighs the KL loss term, which this run leaves out: set "
                "actor.use_kl_loss=true with actor.kl_loss_coef > 0, or drop it")
    if a.top_entropy_quantile < 1.0 and a.policy_loss == "gmpo":
        return ("actor.top_entropy_quantile leaves tokens out of the policy term per token, and gmpo's is a "
                "geometric mean over each sequence: drop it, or pick another actor.policy_loss")
    if a.policy_loss == "vespo" and cfg.algorithm.rollout_is == "sequence":  # TRL refuses its sequence modes too
        return ("actor.policy_loss=vespo folds the rollout-correction weights of each token into its sequence "
                "weight, and algorithm.rollout_is=sequence gives one per sequence: set algorithm.rollout_is=token")
    rejecting = _rejecting(cfg)
    if a.policy_loss == "seq_ppo_clip":
        return _sequence_ratio_problem(cfg, rejecting)
    if a.policy_loss == "vespo" and rejecting:  # TRL's token_mask folds a 0 weight into phi; here the token leaves
        return (f"actor.policy_loss=vespo folds each token's rollout-correction weight into its sequence weight, "
                f"and {rejecting} takes rejected tokens out of the loss instead: use algorithm.rollout_is_mode="
                "truncate, or another loss")
    if a.off_policy_mask_threshold is not None and (a.policy_loss == "gmpo" or cfg.critic.enable):
        return ("actor.off_policy_mask_threshold leaves whole sequences of negative advantage out, which "
                + ("gmpo's geometric mean over each sequence" if a.policy_loss == "gmpo" else
                   "a critic's per-token advantages") + " cannot keep apart: drop it")
    return None


def _rejecting(cfg: RunConfig) -> str | None:
    """The rollout-correction key that takes tokens or sequences out of the loss, if any."""
    a = cfg.algorithm
    if a.rollout_is != "none" and a.rollout_is_mode not in ("truncate", "zero"):
        return f"algorithm.rollout_is_mode={a.rollout_is_mode}"
    if a.rollout_rs != "none":
        return f"algorithm.rollout_rs={a.rollout_rs}"
    return "algorithm.rollout_token_veto_threshold" if a.rollout_token_veto_threshold is not None else None


def _sequence_ratio_problem(cfg: RunConfig, rejecting: str | None) -> str | None:
    """seq_ppo_clip's ratio is the product of a sequence's token ratios and its advantage one per sequence: what
    weighs or drops single tokens, or gives each token its own advantage, would change what the ratio means."""
    a, what = cfg.actor, "actor.policy_loss=seq_ppo_clip clips each sequence's likelihood ratio"
    if a.top_entropy_quantile < 1.0:
        return f"{what}, and actor.top_entropy_quantile leaves single tokens out of it: drop one of them"
    if cfg.algorithm.rollout_is == "token":
        return (f"{what}, and algorithm.rollout_is=token weighs each token apart: set algorithm.rollout_is=sequence, "
                "or none")
    if rejecting:
        return f"{what}, and {rejecting} takes tokens out of the loss: drop it (algorithm.rollout_is_mode=truncate)"
    if cfg.critic.enable:
        return (f"{what} with one advantage per sequence, and a critic gives each token its own: use "
                "actor.policy_loss=ppo_clip with critic.enable=true")
    estimator = cfg.algorithm.adv_estimator
    if estimator not in SEQUENCE_ESTIMATORS:  # their advantages differ along a sequence (returns-to-go, whitening)
        return (f"{what} with one advantage per sequence, and algorithm.adv_estimator={estimator} gives each token its "
                f"own: use one of {', '.join(SEQUENCE_ESTIMATORS)}")
    return None
