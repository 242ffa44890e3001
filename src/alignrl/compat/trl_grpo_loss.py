"""TRL's GRPO loss flags (`trl_grpo_flags`) as alignrl's actor and advantage keys: --loss_type, --scale_rewards,
--importance_sampling_level and the loss options (--delta, --use_bias_correction_kl, --top_entropy_quantile,
--off_policy_mask_threshold, VESPO's --vespo_*). `trl_grpo_keys` adds them to the rest of a line's keys."""

from __future__ import annotations

from alignrl.compat.trl_grpo_flags import TrlFlagError

# TRL's loss_type -> (actor.policy_loss, actor.loss_agg_mode)
LOSS_TYPES = {"grpo": ("ppo_clip", "seq-mean-token-mean"), "dapo": ("ppo_clip", "token-mean"),
              "bnpo": ("ppo_clip", "token-mean"), "dr_grpo": ("ppo_clip", "seq-mean-token-sum-norm"),
              "cispo": ("cispo", "token-mean"), "sapo": ("sapo", "auto"),
              # luspo: GSPO's sequence term weighed by the length (its KL and entropy terms are refused below)
              "luspo": ("luspo", "seq-mean-token-sum"),
              "vespo": ("vespo", "token-mean")}  # TRL normalises vespo as dapo
# TRL's scale_rewards -> (algorithm.norm_adv_by_std_in_grpo, algorithm.grpo_std_scope)
SCALE_REWARDS = {"group": (True, "group"), "true": (True, "group"), "batch": (True, "batch"),
                 "none": (False, "group"), "false": (False, "group")}
DELTA_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "luspo")  # the loss types TRL caps the ratio of with --delta


def _scaling(args) -> tuple[bool, str]:
    scaling = SCALE_REWARDS.get(str(args.scale_rewards).lower())
    if scaling is None:
        raise TrlFlagError(f"--scale_rewards {args.scale_rewards}: alignrl's GRPO scales by the group's std (group), "
                           "the whole batch's (batch) or not at all (none)")
    if args.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise TrlFlagError(f"--multi_objective_aggregation {args.multi_objective_aggregation}: give "
                           "sum_then_normalize or normalize_then_sum")
    if args.multi_objective_aggregation == "normalize_then_sum":  # TRL then divides by the batch's std, always
        return True, "batch"
    return scaling


def _policy(args) -> str:
    """actor.policy_loss for --loss_type at --importance_sampling_level."""
    if args.loss_type not in LOSS_TYPES:
        raise TrlFlagError(f"--loss_type {args.loss_type}: alignrl has {', '.join(LOSS_TYPES)}")
    if args.importance_sampling_level not in ("token", "sequence"):
        raise TrlFlagError(f"--importance_sampling_level {args.importance_sampling_level}: give token or sequence")
    policy, sequence = LOSS_TYPES[args.loss_type][0], args.importance_sampling_level == "sequence"
    if args.loss_type == "luspo" and not sequence:
        # TRL's token-level luspo sums every position of the padded width, padding included, over B x T
        raise TrlFlagError("--loss_type luspo with --importance_sampling_level token: TRL then averages each token's "
                           "loss over the padded width; add --importance_sampling_level sequence (as TRL advises)")
    if sequence and args.loss_type not in ("grpo", "luspo", "vespo"):
        # TRL aggregates the sequence ratio's loss by loss_type (dapo, bnpo, dr_grpo weigh it by length); alignrl's
        # GSPO averages the sequences whatever actor.loss_agg_mode says: TRL's grpo only (luspo is its own)
        raise TrlFlagError(f"--importance_sampling_level sequence with --loss_type {args.loss_type}: alignrl's "
                           "GSPO averages the completions, as TRL's loss_type grpo does; add --loss_type grpo")
    # vespo's term reads the token log-ratios whatever the level (TRL warns and computes the same)
    return "gspo" if sequence and args.loss_type == "grpo" else policy


def loss_keys(args) -> list[str]:
    scale, scope = _scaling(args)
    policy, agg = _policy(args), LOSS_TYPES[args.loss_type][1]
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    low = args.epsilon
    if policy == "cispo":  # TRL's epsilon_high is CISPO's bound on the IS weight itself, with no lower bound
        if high <= 1.0:
            raise TrlFlagError(f"--loss_type cispo bounds the IS weight by --epsilon_high ({high}), which must be "
                               "above 1 (5.0 in the ScaleRL recipe)")
        low, high = 1.0, high - 1.0
    out = [f"actor.policy_loss={policy}", f"actor.loss_agg_mode={agg}", f"actor.clip_ratio_low={low}",
           f"actor.clip_ratio_high={high}", f"algorithm.norm_adv_by_std_in_grpo={str(scale).lower()}",
           f"algorithm.grpo_std_scope={scope}", "algorithm.adv_estimator=grpo",
           f"algorithm.multi_objective_aggregation={args.multi_objective_aggregation}",
           f"algorithm.mask_truncated={str(args.mask_truncated_completions).lower()}",
           f"actor.use_kl_loss={str(args.beta > 0).lower()}", f"actor.kl_loss_coef={args.beta}",
           "actor.kl_loss_type=k3", "algorithm.use_kl_in_reward=false", "actor.entropy_coeff=0.0"]
    if policy == "sapo":
        out += [f"actor.tau_pos={args.sapo_temperature_pos}", f"actor.tau_neg={args.sapo_temperature_neg}"]
    if policy == "vespo":
        out += [f"actor.vespo_k_pos={args.vespo_k_pos}", f"actor.vespo_lambda_pos={args.vespo_lambda_pos}",
                f"actor.vespo_k_neg={args.vespo_k_neg}", f"actor.vespo_lambda_neg={args.vespo_lambda_neg}"]
    return out + option_keys(args, policy)


def ref_sync_keys(args, steps_per_round: int) -> tuple[list[str], list[str]]:
    """TRL's sync_ref_model (keys, start lines): its reference moves every ref_model_sync_steps optimizer steps;
    alignrl's after RL steps of `steps_per_round` optimizer steps each, so the count becomes RL steps, rounded (at
    least 1, said when it does not divide)."""
    if not args.sync_ref_model:
        return [], []
    n = args.ref_model_sync_steps
    if n < 1:
        raise TrlFlagError(f"--ref_model_sync_steps {n} with --sync_ref_model: give 1 or more optimizer steps")
    every = max(1, round(n / steps_per_round))
    lines = [] if n % steps_per_round == 0 else [
        f"--ref_model_sync_steps {n}: the reference moves after every {every} RL step(s) of {steps_per_round} "
        f"optimizer steps ({every * steps_per_round} optimizer steps, where TRL's moves it after {n})"]
    return [f"actor.ref_sync_steps={every}", f"actor.ref_mixup_alpha={args.ref_model_mixup_alpha}"], lines


def _luspo_problem(args) -> str | None:
    """TRL's luspo keeps the (B, 1) sequence loss only without a per-token term; one turns it (B, T), and its
    .mean() then runs over the padded width, padding included: a weighting alignrl does not copy."""
    if args.beta > 0:
        return ("--loss_type luspo with --beta above 0: TRL then weighs each completion's KL by its length over the "
                "padded width, padding included; give --beta 0.0 (TRL's default), or alignrl's own line "
                "(actor.policy_loss=luspo, its KL aggregated by actor.loss_agg_mode)")
    if args.top_entropy_quantile < 1.0:
        return ("--loss_type luspo with --top_entropy_quantile: TRL then averages the kept tokens over the padded "
                "width; drop it, or use alignrl's own line (actor.policy_loss=luspo actor.top_entropy_quantile)")
    return None


def option_keys(args, policy: str) -> list[str]:
    """Two-sided clipping, the ratio-weighted KL, the high-entropy tokens' policy term and the off-policy mask."""
    out = [f"actor.top_entropy_quantile={args.top_entropy_quantile}"]
    problem = _luspo_problem(args) if policy == "luspo" else None
    if problem:
        raise TrlFlagError(problem)
    if args.delta is not None:
        if args.loss_type not in DELTA_TYPES:
            raise TrlFlagError(f"--delta caps the ratio of --loss_type {', '.join(DELTA_TYPES[:-1])} and luspo; TRL "
                               f"leaves {args.loss_type}'s alone: drop it")
        out.append(f"actor.clip_ratio_delta={args.delta}")
    if args.use_bias_correction_kl:
        if args.beta == 0:
            raise TrlFlagError("--use_bias_correction_kl weighs the KL term, which --beta 0.0 leaves out: give "
                               "--beta above 0, or drop it")
        if args.importance_sampling_level == "sequence":
            raise TrlFlagError("--use_bias_correction_kl with --importance_sampling_level sequence: TRL weighs the KL "
                               "by the sequence's ratio, alignrl by each token's; drop one of them")
        out.append("actor.kl_loss_ratio_weighted=true")
    if args.off_policy_mask_threshold is not None:
        out.append(f"actor.off_policy_mask_threshold={args.off_policy_mask_threshold}")
    return out
