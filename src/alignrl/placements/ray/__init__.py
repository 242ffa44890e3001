"""Ray placement of the one RL loop: OpenRLHF-style flags, placement groups, worker-group actors.

    flags (OpenRLHF 0.6 spelling) -> Plan (groups, bundles, colocation) -> placement groups on the cluster
    actor group (Ray actors, torch.distributed inside)  <- RaySource  <- rollout engines (Ray actors)
    actor rank 0 -> bucketed collective broadcast (own process group) -> rollout engines

The trainer side is `alignrl.runner.train_grpo` run in every actor-group rank with a Ray
`RemoteProducers` (`channel.RayProducers`); the producer side is `RolloutMaker` (`build_maker`) run in
the rollout-engine actors. Entry points, one driver (`driver.Driver` runs a `Job`: a `plan.GroupLayout` and
the resolved run config): `alignrl train ppo-ray <flags>` / `python -m alignrl.compat.openrlhf_ppo_ray`
(`train_ppo_ray`), and `alignrl train ppo <verl overrides>` inside a Ray job (`verl_job`: verl's hybrid
engine layout from trainer.nnodes × trainer.n_gpus_per_node).
"""
