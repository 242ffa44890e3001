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
shared file system it names. With a runtime env's `working_dir` that directory is Ray's temporary copy of it,
deleted with the Ray session, so a relative path there loses the checkpoints: one warning line says so.
"""

from __future__ import annotations

import os
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
    if cfg.actor.ref_sync_steps:  # before any worker starts; the actor ranks would refuse it (placements.local)
        return (f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} moves a reference held by the trainer, and Ray's "
                "reference log-probs come from its reference workers")
    return None


# A job with a runtime env's working_dir runs in Ray's unpacked copy of it:
# <ray temp dir>/session_<date>/runtime_resources/working_dir_files/_ray_pkg_<hash>. The temp dir may be moved
# (`ray start --temp-dir`), these two folder names are not.
RAY_WORKING_DIR = ("runtime_resources", "working_dir_files")


def in_ray_working_dir(path: Path) -> bool:
    """Whether `path` lies in the copy of a job's working_dir that Ray deletes with its session (the path as
    given and with symbolic links resolved: a link into it loses its files all the same)."""
    n = len(RAY_WORKING_DIR)
    for parts in (path.absolute().parts, Path(os.path.realpath(path)).parts):
        if any(parts[i:i + n] == RAY_WORKING_DIR for i in range(len(parts) - n + 1)):
            return True
    return False


def temporary_output_warning(cfg: RunConfig) -> str | None:
    """The one line to print when checkpoints or the run folder would land in Ray's temporary working_dir copy
    (a rerun after the cluster restarts would then find no checkpoint and start from step 0); None otherwise."""
    found = [(what, key, where) for what, key, where in
             (("checkpoints", "trainer.default_local_dir", cfg.checkpoint_root.absolute()),
              ("run folder", "trainer.output_dir", cfg.run_dir.absolute())) if in_ray_working_dir(where)]
    if not found:
        return None
    named = " and ".join(f"the {what} ({where})" for what, _, where in found)
    keys = " and ".join(key for _, key, _ in found)
    whats = [what for what, _, _ in found]
    verb = "is" if whats == ["run folder"] else "are"
    lost, keep = (("a rerun after a cluster restart starts again from step 0", "to keep checkpoints and resume")
                  if "checkpoints" in whats else ("its logs and summary.json go with it", "to keep them"))
    return (f"warning: {named} {verb} in Ray's temporary copy of the job's working_dir, which Ray deletes with its "
            f"session: {lost}; give {keys} an absolute path (e.g. on a shared file system) {keep}")


def job(cfg: RunConfig, prog: str):
    """The verl-style config as a placed run (verl's hybrid engine layout)."""
    from alignrl.config.checks import needs_reference
    from alignrl.placements.ray.driver import Job
    from alignrl.placements.ray.plan import GroupLayout

    t = cfg.trainer
    cfg = replace(cfg, trainer=replace(t, output_dir=str(Path(t.output_dir).absolute()), progress_bar=False))
    reference = needs_reference(cfg) and not cfg.services.reference_url  # a service is asked from the engines
    layout = GroupLayout.hybrid(t.nnodes, t.n_gpus_per_node, reference)
    return Job(layout, cfg, prog, threads=t.threads or 1)


def run_on_ray(cfg: RunConfig, prog: str, preflight=lambda: None) -> int:
    """Places and runs `cfg` on the cluster in RAY_ADDRESS after `preflight()` (the command line's checks); one line
    in `prog`'s name on failure (exit 1: a worker died or failed; 2: the request or the config)."""
    from alignrl.placements.ray.channel import ClusterError
    from alignrl.placements.ray.driver import Driver
    from alignrl.errors import UserError

    why = placeable(cfg)
    if why:
        raise ConfigError(f"RAY_ADDRESS is set but {why}: unset RAY_ADDRESS to run it outside Ray")
    warning = temporary_output_warning(cfg)
    if warning:  # at start, before any worker: the user can stop and rerun with a lasting path
        print(f"{prog}: {warning}", file=sys.stderr, flush=True)
    try:
        preflight()
        return Driver(job(cfg, prog)).run()
    except (ClusterError, UserError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, ClusterError) else 2
