"""Which worker groups a Ray run places beside the actor, read from OpenRLHF's flags: a reference group, a
critic group, a reward-model group. Kept apart from `plan` (which needs Ray) so that the flag checks, which ask
the same questions, load without it."""


def uses_reference(args) -> bool:
    """OpenRLHF's flags run a reference group when their KL coefficient is positive."""
    return args.init_kl_coef > 0


def uses_critic(args) -> bool:
    """... a critic group with the GAE estimator."""
    return args.advantage_estimator == "gae"


def uses_reward_model(args) -> bool:
    """... a reward-model group with --reward_pretrain, unless the rewards come from --remote_rm_url."""
    return bool(args.reward_pretrain) and not args.remote_rm_url
