"""`alignrl train ppo-ray` (OpenRLHF's `train_ppo_ray` flags): places the worker groups on a Ray
cluster and runs the one RL loop on them.

Here: the flags' checks and their translation into a `Job` (layout and run config); the placing and
running is `alignrl.placements.ray.driver`, shared with `alignrl train ppo` inside a Ray job. Attaches to
RAY_ADDRESS (set inside `ray job submit`, or by hand: `RAY_ADDRESS=HOST:8100`), else starts a local Ray.
`--load_checkpoint` resumes from the newest checkpoint in `--ckpt_path` (default <save_path>/checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from alignrl.compat import openrlhf_dotted as D
from alignrl.compat import openrlhf_flags as F
from alignrl.compat import openrlhf_keys as K
from alignrl.config import ConfigError, load_config

PROG = F.PROG


def training_steps(args) -> int:
    """OpenRLHF's count: episodes × full rollout batches in the (capped) prompt data. The rows are counted, not
    read: the driver's input check reads the file once, after this."""
    if args.total_steps:
        return args.total_steps
    from alignrl.compat.openrlhf_sources import prompt_rows

    rows = prompt_rows(args)  # each file capped, concatenated or blended (a blend repeats rows), capped again
    steps = args.num_episodes * (rows // args.rollout_batch_size)
    if steps < 1:
        raise ConfigError(f"--prompt_data has {rows} prompt(s), fewer than --rollout_batch_size "
                          f"{args.rollout_batch_size}: lower it or give more data")
    return steps


def wandb_env(args, prog: str = PROG) -> dict[str, str]:
    """--use_wandb KEY as the run's WANDB_API_KEY (OpenRLHF logs in with it): set in this process, whose
    local Ray's workers inherit it, and returned for the actor ranks, which log (on a cluster they were not
    started from here). As OpenRLHF's wandb.login(key=...), it wins over a WANDB_API_KEY already set. The key
    lives in process environments only: never in the config, the run folder or a printed line."""
    key = F.wandb_key(args)
    if key is None:
        return {}
    if os.environ.get("WANDB_API_KEY", key) != key:
        print(f"{prog}: --use_wandb: its key is used, not the WANDB_API_KEY of the environment", flush=True)
    os.environ["WANDB_API_KEY"] = key
    return {"WANDB_API_KEY": key}  # actor ranks on other nodes lack this process's environment


def unused_lines(args, gpus: bool, typed: list[str]) -> list[str]:
    """The flags given that change nothing here (K.unused_here), each named as the user typed it (dotted or not)."""
    return [D.in_typed_words(line, typed) for line in K.unused_here(args, gpus)]


def job(args, prog: str = PROG, env: dict[str, str] | None = None, typed: list[str] | None = None):
    """The checked flags as a placed run (a driver.Job): their layout and the run config they translate to;
    `env` (wandb_env's) goes to the actor ranks' environment; `typed`: the command line as given, whose spelling
    the list of flags not used here keeps."""
    import torch

    from alignrl.placements.ray.driver import Job
    from alignrl.placements.ray.plan import GroupLayout

    cuda = torch.cuda.is_available()
    cfg = load_config(None, K.overrides(args, cuda, training_steps(args)))
    if args.load_checkpoint:  # asked for, and a mistyped --ckpt_path would otherwise start over without a word
        from alignrl.train.checkpoint import latest_checkpoint

        if latest_checkpoint(cfg.checkpoint_root)[0] is None:
            print(f"{prog}: --load_checkpoint: no checkpoint in {cfg.checkpoint_root} yet; starting from step 0",
                  flush=True)
    return Job(GroupLayout.from_flags(args), cfg, prog, args.threads, args.peer_timeout, args.placement_timeout,
               args.vllm_sync_backend, unused=unused_lines(args, cuda, typed or []),
               gpu_memory_utilization=args.vllm_gpu_memory_utilization, rank_env=env or {})


EXPORTED = ".exported.json"  # the files the last export put in --save_path: a new export replaces exactly those


def export_model(save: Path, ckpt_root: Path, step: int, prog: str = PROG) -> None:
    """OpenRLHF leaves the trained model in --save_path, an HF folder that eval and serving read: step `step`'s
    checkpoint model files, copied (a link would let a later save into --save_path rewrite the checkpoint), each
    put in place by a rename so no file there is ever half-written; files of an earlier export that this one
    lacks go. A failure is one line: the checkpoint itself is the trained model."""
    from alignrl.train.checkpoint import manifest_problem
    from alignrl.utils.atomic import atomic_write, atomic_write_text

    final = ckpt_root / f"global_step_{step}"
    if manifest_problem(final) is not None:  # on several nodes without a shared file system,
        print(f"{prog}: step {step}'s checkpoint is not under {ckpt_root} on this node: --save_path holds no "
              "model (the final checkpoint's model/ folder on actor rank 0's node is the trained model)", flush=True)
        return
    try:
        files = sorted(p for p in (final / "model").iterdir() if p.is_file())
        for src in files:
            atomic_write(save / src.name, lambda tmp: shutil.copy2(src, tmp))
        names = [p.name for p in files]
        try:
            before = json.loads((save / EXPORTED).read_text())
        except (OSError, ValueError):
            before = []
        for old in set(before if isinstance(before, list) else []) - set(names):
            if isinstance(old, str) and "/" not in old:
                (save / old).unlink(missing_ok=True)
        atomic_write_text(save / EXPORTED, json.dumps(names))
    except OSError as e:
        print(f"{prog}: could not put the trained model in {save} ({e.strerror or e}): it is in {final / 'model'}",
              flush=True)
        return
    print(f"{prog}: the trained model ({final.name}) is in {save}", flush=True)


def _error(prog: str, e: Exception, code: int, args=None, typed: list[str] | None = None) -> int:
    print(f"{prog}: error: {D.in_typed_words(F.in_flag_terms(str(e), args), typed or [])}", file=sys.stderr,
          flush=True)
    return code


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    from alignrl.errors import UserError

    typed = list(sys.argv[1:] if argv is None else argv)
    try:  # OpenRLHF's current dotted spelling, as its 0.6-era underscore one
        args = F.parser(prog).parse_args(D.to_underscore(typed))
    except D.DottedFlagError as e:
        return _error(prog, e, 2)
    try:
        F.check(args)
    except ConfigError as e:  # the flags' own checks answer before torch, Ray and the models are imported
        return _error(prog, e, 2, args, typed)
    from alignrl.placements.ray.channel import ClusterError
    from alignrl.placements.ray.driver import Driver

    try:
        placed = job(args, prog, wandb_env(args, prog), typed)
        code = Driver(placed).run()
        if code == 0:
            export_model(placed.cfg.run_dir, placed.cfg.checkpoint_root, placed.cfg.trainer.total_training_steps, prog)
        return code
    except (ClusterError, UserError) as e:
        return _error(prog, e, 1 if isinstance(e, ClusterError) else 2, args, typed)
    except KeyboardInterrupt:  # the driver's finally has released the workers and placement groups
        print(f"{prog}: interrupted; the same command with --load_checkpoint continues from the last checkpoint",
              file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m alignrl.compat.openrlhf_ppo_ray"))
