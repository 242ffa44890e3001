"""`alignrl train ppo|grpo <verl overrides>` inside a Ray job (RAY_ADDRESS set, as `ray job submit` sets
it): the run is placed on the cluster the way verl's hybrid engine places it, through the same driver
as `alignrl train ppo-ray`, instead of running as one process on the node that took the job.

    trainer.nnodes × trainer.n_gpus_per_node   actor ranks, one placement group spread over that many
                                               nodes (n_gpus_per_node one-unit bundles on each node)
    one rollout engine per actor rank          colocated in the rank's unit, tensor-parallel size 1
    one reference worker per actor rank        colocated too, when a KL term needs the reference

A unit is a GPU on a cluster with GPUs, else a CPU (the GPU counts become process counts). The critic
(algorithm.adv_estimator=gae) trains inside the actor ranks and a reward model scores inside the
engines, as in the one-process loop. Checkpoints and logs go where trainer.* says: a relative
`trainer.output_dir` is taken from the job's working directory (verl's `trainer.default_local_dir` is
already made absolute the same way), so they land on the node that runs the job's driver, or on the
shared file system it names.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from alignrl.config import ConfigError, RunConfig


def placeable(cfg: RunConfig) -> str | None:
    """Why this config cannot be placed by the Ray driver (None: it can)."""
    if cfg.pipeline.placement == "zmq":
        return "pipeline.placement=zmq places its own sampler processes"
    if cfg.services.generation_url:
        return "services.generation_url generates on an outside server"
    return None


def job(cfg: RunConfig, prog: str):
    """The verl-style config as a placed run (verl's hybrid engine layout)."""
    from alignrl.algos.trainer import needs_reference
    from alignrl.cluster.driver import Job
    from alignrl.cluster.plan import Layout

    t = cfg.trainer
    cfg = replace(cfg, trainer=replace(t, output_dir=str(Path(t.output_dir).absolute()), progress_bar=False))
    reference = needs_reference(cfg) and not cfg.services.reference_url  # a service is asked from the engines
    layout = Layout.hybrid(t.nnodes, t.n_gpus_per_node, reference)
    return Job(layout, cfg, prog, threads=t.threads or 1)


def run_on_ray(cfg: RunConfig, prog: str) -> int:
    """Places and runs `cfg` on the cluster in RAY_ADDRESS; one line on failure (exit 1: a worker died or
    failed; 2: the request or the config)."""
    from alignrl.errors import user_errors
    from alignrl.cluster.channel import ClusterError
    from alignrl.cluster.driver import Driver

    why = placeable(cfg)
    if why:
        raise ConfigError(f"RAY_ADDRESS is set but {why}: unset RAY_ADDRESS to run it outside Ray")
    try:
        return Driver(job(cfg, prog)).run()
    except (ClusterError, *user_errors()) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, ClusterError) else 2
