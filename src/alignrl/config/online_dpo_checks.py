"""algorithm.adv_estimator=online_dpo (and xpo, online DPO against the reference model's answers): the keys its update
cannot go with. Its advantages make the -A·log π update the
DPO loss's gradient at the trainer's weights (`core.online_dpo`), which holds for one optimizer step per batch, from
the trainer's own log-probs, with the plain per-token term summed per sequence."""

from __future__ import annotations

from alignrl.config.schema import PAIR_ESTIMATORS, AlgorithmConfig, RunConfig


def online_dpo_problem(cfg: RunConfig) -> str | None:
    a, default = cfg.algorithm, AlgorithmConfig()
    if a.adv_estimator not in PAIR_ESTIMATORS:
        given = [k for k in ("dpo_beta", "dpo_loss_type", "xpo_alpha", "mixture_coef")
                 if getattr(a, k) != getattr(default, k)]
        return (f"algorithm.{given[0]} sets the online DPO loss, read with algorithm.adv_estimator=online_dpo, xpo, "
                f"nash_md or spin (got adv_estimator={a.adv_estimator}): set it, or drop algorithm.{given[0]}"
                ) if given else None
    readers = {"xpo_alpha": ("xpo",), "mixture_coef": ("nash_md",), "dpo_loss_type": ("online_dpo", "xpo", "spin")}
    stray = [k for k, by in readers.items() if a.adv_estimator not in by and getattr(a, k) != getattr(default, k)]
    if stray:
        return (f"algorithm.{stray[0]} is read under algorithm.adv_estimator={' or '.join(readers[stray[0]])}, not "
                f"{a.adv_estimator}: drop it")
    what = f"algorithm.adv_estimator={a.adv_estimator}"
    if cfg.rollout.n != 2:
        return (f"{what} pairs each prompt's two answers, as TRL's online DPO samples two: set rollout.n=2 "
                f"(got {cfg.rollout.n})")
    if cfg.actor.ppo_epochs != 1 or cfg.mini_batches_per_step != 1:
        return (f"{what} takes one optimizer step per batch, as TRL's, from the weights that scored it (got "
                f"actor.ppo_epochs={cfg.actor.ppo_epochs}, {cfg.mini_batches_per_step} mini-batches): set "
                "actor.ppo_epochs=1 and actor.ppo_mini_batch_size to the batch (data.train_batch_size prompts)")
    if a.use_kl_in_reward or (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0):
        # its loss holds its own pull toward the reference (beta), and the pair is chosen by the answers' rewards
        return (f"{what}'s loss holds its own pull toward the reference (algorithm.dpo_beta), as TRL's has no other: "
                "set actor.use_kl_loss=false and algorithm.use_kl_in_reward=false")
    if a.reward_clip:  # two rewards past the bound would tie, and a tie goes to the first answer
        return (f"{what} chooses each pair's answer by its reward, which algorithm.reward_clip={a.reward_clip} "
                "could make a tie: drop it")
    if cfg.pipeline.replay_buffer_size:
        return (f"{what} pairs the answers of one batch and trains them once, from the weights that scored them: "
                "set pipeline.replay_buffer_size=0")
    return _update_problem(cfg, what) or (_reference_answer_problem(cfg, what) if a.adv_estimator != "online_dpo"
                                           else None)


def _reference_answer_problem(cfg: RunConfig, what: str) -> str | None:
    """XPO's, Nash-MD's and SPIN's second answers come from the reference model (alone, or mixed with the policy),
    sampled in the producer."""
    g = cfg.agent
    if g.max_turns or g.env_path or g.tool_config_path or g.interaction_config_path:
        return (f"{what} samples one answer of each pair with the reference model, and this run's rollouts are "
                "episodes with tools or an environment: use online_dpo, or a single-turn run")
    if cfg.services.reference_url:
        return (f"{what} samples with the reference model where the rollouts are made, and services.reference_url "
                "serves log-probs only: drop it (the reference then loads beside the policy)")
    if cfg.pipeline.placement == "zmq" and cfg.pipeline.ref_logprobs == "trainer":
        return (f"{what} samples with the reference model in the samplers, which hold no reference under "
                "pipeline.ref_logprobs=trainer: set pipeline.ref_logprobs=sampler")
    if cfg.algorithm.adv_estimator == "spin" and cfg.algorithm.dynamic_sampling:  # it drops pairs by their rewards
        return (f"{what} reads no rewards (the target is always chosen), and algorithm.dynamic_sampling would drop "
                "pairs by them: drop it")
    if cfg.algorithm.adv_estimator == "nash_md" and cfg.services.generation_url:
        return (f"{what} samples from the mixture of the policy and the reference token by token in this process, and "
                "services.generation_url generates elsewhere: drop it")
    return None


def _update_problem(cfg: RunConfig, what: str) -> str | None:
    """The actor and rollout-correction keys that would change the update away from the DPO loss's gradient."""
    a, alg = cfg.actor, cfg.algorithm
    if a.policy_loss not in ("ppo_clip", "gpg") or a.loss_agg_mode not in ("auto", "seq-mean-token-sum"):
        return (f"{what} trains with -A log pi summed over each answer (actor.policy_loss=gpg, loss_agg_mode="
                f"seq-mean-token-sum; got {a.policy_loss}, {a.loss_agg_mode}): leave both at their defaults")
    if not a.recompute_old_logprobs:
        return (f"{what} weighs each pair by the trainer's own log-probs: set actor.recompute_old_logprobs=true")
    extra = [k for k, on in (("actor.entropy_coeff", a.entropy_coeff > 0), ("ptx.data", bool(cfg.ptx.data))) if on]
    if extra:  # a term of its own beside the DPO loss: the update would no longer be that loss's gradient
        return f"{what} trains on the DPO loss alone, as TRL's, and {extra[0]} adds a term of its own: drop it"
    given = [k for k, on in (("actor.clip_ratio_delta", a.clip_ratio_delta is not None),
                             ("actor.top_entropy_quantile", a.top_entropy_quantile < 1.0),
                             ("actor.off_policy_mask_threshold", a.off_policy_mask_threshold is not None),
                             ("algorithm.mask_truncated", alg.mask_truncated),
                             ("algorithm.rollout_is", alg.rollout_is != "none"),
                             ("algorithm.rollout_rs", alg.rollout_rs != "none"),
                             ("algorithm.rollout_token_veto_threshold",
                              alg.rollout_token_veto_threshold is not None)) if on]
    if given:  # each weighs or drops tokens of one answer, which the pair's loss reads whole
        return (f"{what} reads each answer's tokens whole, and {given[0]} weighs or drops some of them: drop it "
                "(algorithm.missing_eos_penalty lowers the reward of answers cut before they ended, as TRL's)")
    return None
