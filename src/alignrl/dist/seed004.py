"""Seed 004's commands, as its users type them from the repository root:

    python communication_test.py
    python sampling_worker.py --gpu-id 0 --data-port 5555 --sync-port 5556
    python training_worker.py --gpu-id 1 --data-port 5555 --sync-port 5556 [--no-deepspeed]
    python run_distributed.py --sampling-gpu 0 --training-gpus "1,2,3"

The trainer is `alignrl train grpo pipeline.placement=zmq` (DeepSpeed ZeRO-2 from an editable, generated
`deepspeed.json`, or DDP / one process with --no-deepspeed); the sampler is `alignrl sample`. On a machine
without GPUs the device ids only count processes. Flags the seed lacks map onto config keys; any
`key.sub=value` after the flags is passed on as a config override.

`deepspeed.json` is written on the first run with that run's batch numbers; the batch numbers of a file the user
edited are the run's (train_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size, train_batch_size and
gradient_accumulation_steps -> the mini-batch), said in one line at start. alignrl drives the accumulation itself,
so the engine hands DeepSpeed nominal batch numbers (alignrl.train.engines.deepspeed.load_ds_config).

communication_test.py is two processes, as seed 004's pair: this one binds --data-port and --sync-port as the
trainer does, and starts `python -m alignrl.dist.seed004 comm-peer`, which connects as the sampler does.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

from alignrl.dist.launch import OneLineParser, wait_interruptible

DS_FILE = "deepspeed.json"
SAVE_STEPS = 1000  # seed 004: "每1000步保存一次" (the final step is always saved)
DS_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class Seed004Error(ValueError):
    """A mistake in seed 004's flags or deepspeed.json, said in one line before anything starts."""


def training_parser(prog: str = "training_worker.py") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="GRPO trainer fed by ZeroMQ samplers (seed 004).")
    p.add_argument("--gpu-id", type=int, default=0, metavar="N", help="CUDA device of the (single-process) trainer")
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="training processes (run_distributed.py sets it)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the two ports on")
    p.add_argument("--data-port", type=int, default=5555, metavar="PORT")
    p.add_argument("--sync-port", type=int, default=5556, metavar="PORT")
    p.add_argument("--no-deepspeed", action="store_true", help="plain DDP (or one process) instead of ZeRO-2")
    p.add_argument("--model-path", default="demo", metavar="DIR",
                   help="HF model folder (default: the embedded demo model)")
    p.add_argument("--data-path", default=None, metavar="FILE",
                   help="training data (.jsonl/.json/.parquet); default: synthetic arithmetic")
    p.add_argument("--max-steps", type=int, default=None, metavar="N", help="RL steps (trainer.total_training_steps)")
    p.add_argument("--output-dir", default="output", metavar="DIR", help="run folders go here (default: output)")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="0: on-policy; k: batches up to k versions old")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="prompts per step (data.train_batch_size)")
    p.add_argument("--group-size", type=int, default=None, metavar="N", help="samples per prompt (rollout.n)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (actor.lr)")
    p.add_argument("--save-steps", type=int, default=SAVE_STEPS, metavar="N",
                   help=f"checkpoint every N steps (trainer.save_freq; seed 004: {SAVE_STEPS}); the final step is "
                        "always saved")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads per process (0: torch's default)")
    return p


def training_overrides(a: argparse.Namespace, extra: list[str], ds_json: str | None = None) -> list[str]:
    """The trainer's config overrides; `ds_json` is the DeepSpeed file to name (None: leave it out)."""
    o = ["pipeline.placement=zmq", f"pipeline.host={a.host}", f"pipeline.data_port={a.data_port}",
         f"pipeline.sync_port={a.sync_port}", f"model.path={a.model_path}", f"trainer.output_dir={a.output_dir}",
         "trainer.experiment_name=grpo_zmq"]
    for key, value in (("data.train_files", a.data_path), ("trainer.total_training_steps", a.max_steps),
                       ("pipeline.max_staleness", a.max_staleness), ("data.train_batch_size", a.batch_size),
                       ("actor.ppo_mini_batch_size", a.batch_size), ("rollout.n", a.group_size),
                       ("actor.lr", a.lr), ("trainer.save_freq", a.save_steps)):
        if value is not None:
            o.append(f"{key}={value}")
    if a.threads:
        o.append(f"trainer.threads={a.threads}")
    if not a.no_deepspeed:
        o += ["trainer.strategy=deepspeed", "trainer.zero_stage=2"]
        o += [f"trainer.deepspeed_config={ds_json}"] if ds_json else []
    return o + extra


def data_path_problem(path: str | None, side: str) -> str | None:
    """A --data-path that names no readable data file, in the flag's own words (`side`: what leaving it out means)."""
    if path is None or path == "synthetic":
        return None
    if not Path(path).is_file():
        return f"--data-path {path}: no such file; give the training data (.jsonl, .json or .parquet), or {side}"
    if Path(path).suffix.lower() not in DATA_SUFFIXES:
        return f"--data-path {path}: a {Path(path).suffix or 'suffix-less'} file; give a .jsonl, .json or .parquet file"
    return None


def ports_problem(host: str, data_port: int, sync_port: int, whose: str = "") -> str | None:
    """The first mistake in a host and the two ports (`whose`: "the trainer's " on a sampler), or None."""
    import socket

    for flag, port in (("--data-port", data_port), ("--sync-port", sync_port)):
        if not 1 <= port <= 65535:
            return f"{flag} {port} is not a TCP port: give {whose or 'one '}in 1..65535 (seed 004: 5555 and 5556)"
    if data_port == sync_port:
        return (f"--data-port and --sync-port are both {data_port}: give {whose}two different ports "
                "(seed 004: --data-port 5555 --sync-port 5556)")
    try:
        socket.getaddrinfo(host, sync_port)
    except (OSError, UnicodeError):
        return f"--host {host!r} does not resolve to an address: give {whose or 'a '}host name or IP"
    return None


def run_batch(cfg, world: int) -> dict[str, int]:
    """DeepSpeed's three batch numbers of a run: sequences per optimizer step over all ranks, per forward/backward
    on each rank, and micro-batches per optimizer step (the micro-batch a divisor of each rank's share, so that
    train = micro × world × accumulation holds as DeepSpeed requires)."""
    seqs = cfg.mini_batch_sequences
    per_rank = max(1, seqs // world)
    micro = min(cfg.actor.ppo_micro_batch_size, per_rank)
    micro = max(d for d in range(1, micro + 1) if per_rank % d == 0)
    return {"train_batch_size": micro * world * (per_rank // micro), "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": per_rank // micro}


def ds_problem(ds: object) -> str | None:
    """Obviously wrong values of a DeepSpeed JSON file (each a 51-line ValidationError on every rank otherwise)."""
    if not isinstance(ds, dict):
        return 'must be a JSON object like {"zero_optimization": {"stage": 2}}'
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    for key in DS_BATCH:
        v = ds.get(key, "auto")
        if v != "auto" and not (whole(v) and v >= 1):
            unit = "micro-batches" if key == "gradient_accumulation_steps" else "sequences"
            return f"{key} {json.dumps(v)}: give a whole number of {unit}, 1 or more (or leave it out)"
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return 'zero_optimization must be an object like {"stage": 2}'
    stage = zero.get("stage", 0)
    if not (whole(stage) and 0 <= stage <= 3):
        return (f"zero_optimization.stage {json.dumps(stage)}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3 (seed 004: 2; "
                "3 also shards the parameters when memory runs out)")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is not None and not (isinstance(off, dict) and off.get("device", "none") in ("cpu", "nvme", "none")):
            return (f'zero_optimization.{key} {json.dumps(off)}: give an object like {{"device": "cpu"}} '
                    "(cpu, nvme or none)")
    for key in ("bf16", "fp16"):
        prec = ds.get(key, {})
        if not (isinstance(prec, dict) and prec.get("enabled", False) in (True, False, "auto")):
            return f'{key} {json.dumps(prec)}: give an object like {{"enabled": true}} (true, false or "auto")'
    if ds.get("bf16", {}).get("enabled") is True and ds.get("fp16", {}).get("enabled") is True:
        return "bf16 and fp16 are both enabled: enable one of them"
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        return f"gradient_clipping {json.dumps(clip)}: give the largest gradient norm, a number >= 0 (0: no clipping)"
    return None


def ds_batch_overrides(ds: dict, cfg, world: int, given: set[str], batch_flag: bool) -> tuple[list[str], str | None]:
    """The config overrides that make the run follow the batch numbers of a DeepSpeed file `ds` (train_batch_size:
    sequences per optimizer step over all ranks -> the mini-batch; train_micro_batch_size_per_gpu: sequences per
    forward/backward on a rank -> actor.ppo_micro_batch_size; gradient_accumulation_steps: micro-batches per
    optimizer step), and one line naming what came from the file (None when it agrees with the run).
    A key left out (or "auto") is worked out from the other two, keeping the run's mini-batch where that is not
    fixed. Seed004Error in one line when the numbers disagree with each other or with the run."""
    run = run_batch(cfg, world)
    t, m, g = (ds.get(k) if ds.get(k) != "auto" else None for k in DS_BATCH)
    if (t, m, g) == (None, None, None) or (t, m, g) == tuple(run[k] for k in DS_BATCH):
        return [], None
    procs = f"{world} training process{'es' if world > 1 else ''}"
    if t is not None and m is not None and g is not None and t != m * g * world:
        raise Seed004Error(f"train_batch_size {t} is not train_micro_batch_size_per_gpu {m} × "
                           f"gradient_accumulation_steps {g} × {procs} = {m * g * world}: make it so, or leave "
                           "one of the three out (it is then worked out from the others)")
    if t is None:
        t = m * g * world if m is not None and g is not None else run["train_batch_size"]
    if t % world:
        raise Seed004Error(f"train_batch_size {t} does not split evenly over {procs}: make it a multiple of {world}")
    per_rank = t // world
    for have, name in ((m, "train_micro_batch_size_per_gpu"), (g, "gradient_accumulation_steps")):
        if have is not None and per_rank % have:
            raise Seed004Error(f"{name} {have} does not divide the {per_rank} sequences each of {procs} takes per "
                               f"optimizer step (train_batch_size {t}): give a divisor of {per_rank}")
    from_file = m is not None or g is not None  # else the run's own micro-batch, made a divisor of per_rank
    if m is None:
        cap = min(cfg.actor.ppo_micro_batch_size, per_rank)
        m = per_rank // g if g is not None else max(d for d in range(1, cap + 1) if per_rank % d == 0)
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    by_prompts = cfg.actor.ppo_mini_batch_unit == "prompts"
    if by_prompts and t % n:
        raise Seed004Error(f"train_batch_size {t} is not a whole number of prompt groups of {n} samples "
                           f"(--group-size): make it a multiple of {n}")
    if (prompts * n) % t:
        raise Seed004Error(f"train_batch_size {t} must divide the {prompts * n} sequences of one RL step ({prompts} "
                           f"prompts × {n} samples, --batch-size and --group-size): give a divisor of {prompts * n}")
    if by_prompts and world > 1 and (t // n) % world:
        raise Seed004Error(f"train_batch_size {t} is {t // n} prompt groups, which do not split evenly over {procs}: "
                           f"make it a multiple of {n * world}")
    o, said = [], []
    mini = t // n if by_prompts else t
    if t != run["train_batch_size"]:
        if "actor.ppo_mini_batch_size" in given or batch_flag:
            flag = "--batch-size" if batch_flag else "actor.ppo_mini_batch_size"
            raise Seed004Error(f"train_batch_size {t} (sequences per optimizer step) differs from the "
                               f"{run['train_batch_size']} that {flag} gives: change one of them, or delete "
                               f"{DS_FILE} to have it written again with this run's values")
        o.append(f"actor.ppo_mini_batch_size={mini}")
        said.append(f"train_batch_size {t} -> actor.ppo_mini_batch_size={mini}")
    if m != min(cfg.actor.ppo_micro_batch_size, per_rank):
        if from_file and "actor.ppo_micro_batch_size" in given:
            raise Seed004Error(f"train_micro_batch_size_per_gpu {m} differs from actor.ppo_micro_batch_size="
                               f"{cfg.actor.ppo_micro_batch_size}: change one of them")
        o.append(f"actor.ppo_micro_batch_size={m}")
        said.append(f"train_micro_batch_size_per_gpu {m} -> actor.ppo_micro_batch_size={m}")
    if not o:  # the file's numbers are this run's, spelled otherwise
        return [], None
    if g is not None:
        said.append(f"gradient_accumulation_steps {g}")
    return o, (f"{DS_FILE}: " + ", ".join(said) + f"; each update: {m} sequence(s) × {procs} × {per_rank // m} "
               f"accumulation step(s) = {t} sequences")


def read_ds_json(path: Path) -> dict:
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Seed004Error(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): fix it, or delete it to have it "
                           "written again") from None
    except OSError as e:
        raise Seed004Error(f"{path}: cannot read it ({e.strerror})") from None
    problem = ds_problem(ds)
    if problem:
        raise Seed004Error(f"{path}: {problem}")
    return ds


def prepare_training(a: argparse.Namespace, extra: list[str], write: bool, say=None) -> list[str]:
    """The trainer's config overrides once its flags, its config and `deepspeed.json` are checked: ConfigError or
    Seed004Error in one line otherwise. `write`: generate a missing deepspeed.json (with this run's batch numbers)
    and say, through `say`, what it wrote and which values came from the user's file."""
    from alignrl.config import check_world_size, keys_given, load_config

    problem = data_path_problem(a.data_path, "leave it out for synthetic arithmetic")
    if problem:
        raise Seed004Error(problem)
    cfg = load_config(None, training_overrides(a, extra))
    check_world_size(cfg, a.nproc)  # what the launch checks too: before deepspeed.json is written for the split
    if a.no_deepspeed:
        return training_overrides(a, extra)
    path = Path(DS_FILE)
    if path.is_file():
        ds = read_ds_json(path)
        try:
            more, line = ds_batch_overrides(ds, cfg, a.nproc, keys_given(None, extra), a.batch_size is not None)
        except Seed004Error as e:
            raise Seed004Error(f"{path}: {e}") from None
        if more:
            load_config(None, training_overrides(a, extra) + more)
        if line and say:
            say(line)
    elif write:
        from alignrl.dist.env import cuda_bf16

        bf16, run = cuda_bf16(), run_batch(cfg, a.nproc)
        more = ([f"actor.ppo_micro_batch_size={run['train_micro_batch_size_per_gpu']}"]
                if run["train_micro_batch_size_per_gpu"] != min(cfg.actor.ppo_micro_batch_size,
                                                            run["train_batch_size"] // a.nproc)
                else [])
        ds = {**run, "zero_optimization": {"stage": 2}, "bf16": {"enabled": bf16},
              "gradient_clipping": cfg.actor.grad_clip}
        path.write_text(json.dumps(ds, indent=4) + "\n")
        if say:
            say(f"wrote {path} (ZeRO-2, bf16 {'on' if bf16 else 'off'}; this run's batch: "
                f"train_batch_size {run['train_batch_size']} = {run['train_micro_batch_size_per_gpu']} per "
                f"micro-batch × {a.nproc} process(es) × {run['gradient_accumulation_steps']} accumulation step(s)); "
                "edit it to change DeepSpeed and the batch")
    else:
        more = []
    return training_overrides(a, extra, str(path.resolve()) if (path.is_file() or write) else None) + more


def parse_training(argv: list[str] | None, prog: str = "training_worker.py") -> tuple[argparse.Namespace, list[str]]:
    """The trainer's flags, and the `key.sub=value` overrides after them."""
    p = training_parser(prog)
    a, extra = p.parse_known_args(argv)
    bad = [x for x in extra if "=" not in x or x.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    if a.nproc < 1:
        p.error(f"--nproc {a.nproc}: give the number of training processes, 1 or more")
    if a.gpu_id < 0:
        p.error(f"--gpu-id {a.gpu_id}: give a CUDA device id from 0")
    if a.save_steps < 0:
        p.error(f"--save-steps {a.save_steps}: give the steps between checkpoints (seed 004: {SAVE_STEPS}), or 0 for "
                "the final one only")
    return a, extra


def training_main(argv: list[str] | None = None, prog: str = "training_worker.py") -> int:
    a, extra = parse_training(argv, prog)
    from alignrl.config import ConfigError

    try:  # a mistaken value is named before anything is written (deepspeed.json) or started
        overrides = prepare_training(a, extra, write=True,
                                     say=lambda line: print(f"training_worker: {line}", file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"alignrl: error: {e}", file=sys.stderr)
        return 2
    except Seed004Error as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if a.nproc == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(a.gpu_id)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    from alignrl.cli import main

    # DeepSpeed wants a process group even for one process: run under torchrun whenever it is used
    launch = ["--nproc", str(a.nproc)] if a.nproc > 1 or not a.no_deepspeed else []
    if launch and a.nproc == 1 and "LOCAL_RANK" not in os.environ:
        from alignrl.dist.launch import torchrun

        return torchrun(1, ["alignrl", "train", "grpo", *overrides])
    return main([*launch, "train", "grpo", *overrides])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sampling_parser(prog: str = "alignrl sample") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Sampler of the ZeroMQ pipeline: generates, scores and "
                                "streams rollouts to a trainer (alignrl train grpo pipeline.placement=zmq).")
    p.add_argument("--host", default="127.0.0.1", help="the trainer's host")
    p.add_argument("--data-port", type=int, default=5555, help="the trainer's data port")
    p.add_argument("--sync-port", type=int, default=5556, help="the trainer's weight/work port")
    p.add_argument("--model-path", default="demo", help="HF folder of the base policy (the trainer's model.path)")
    p.add_argument("--data-path", default=None, help="training data file (.jsonl/.json/.parquet), if the trainer's "
                                                    "path differs here")
    p.add_argument("--gpu-id", type=int, default=None, help="CUDA device to generate on (CPU when none is there)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--sampler-id", default=None, help="name in the trainer's logs (default: host:pid)")
    p.add_argument("--peer-timeout", type=float, default=600.0, help="seconds to wait for an absent trainer")
    return p


def sampling_main(argv: list[str] | None = None, prog: str = "sampling_worker.py") -> int:
    """sampling_worker.py and `alignrl sample`: the flags are checked before torch and the models are imported, so a
    mistake in them answers at once. --gpu-id picks the device without hiding the others: the trainer's GPU must
    stay visible for its weights to be mapped (pipeline.weight_transport)."""
    p = sampling_parser(prog)
    args = p.parse_args(argv)
    problem = sampling_args_problem(args)
    if problem:
        p.error(problem)
    from alignrl.dist.sampler import run

    return run(args, prog)


def sampling_args_problem(a: argparse.Namespace) -> str | None:
    """The first mistake in a sampler's flags, or None: named at once, where the sampler would otherwise load
    its model and then wait --peer-timeout seconds for a trainer it can never reach."""
    import socket

    for flag, port in (("--data-port", a.data_port), ("--sync-port", a.sync_port)):
        if not 1 <= port <= 65535:
            return f"{flag} {port} is not a TCP port: give the trainer's, 1..65535 (seed 004: 5555 and 5556)"
    if a.data_port == a.sync_port:
        return (f"--data-port and --sync-port are both {a.data_port}: give the trainer's two ports "
                "(seed 004: --data-port 5555 --sync-port 5556)")
    if a.threads < 0:
        return f"--threads {a.threads}: give the torch threads of this process, or 0 for torch's default"
    if a.gpu_id is not None and a.gpu_id < 0:
        return f"--gpu-id {a.gpu_id}: give a CUDA device id from 0"
    if not a.peer_timeout > 0:
        return f"--peer-timeout {a.peer_timeout:g}: give the seconds to wait for an absent trainer, above 0"
    try:
        socket.getaddrinfo(a.host, a.sync_port)
    except (OSError, UnicodeError):
        return f"--host {a.host!r} does not resolve to an address: give the trainer's host name or IP"
    # before the model loads and the trainer is asked (the file was read only once a trainer answered)
    return data_path_problem(a.data_path, "leave --data-path out to read the trainer's data.train_files")


def sample_main(argv: list[str] | None = None) -> int:
    """`alignrl sample ...`: the same sampler under the package's own name."""
    return sampling_main(argv, prog="alignrl sample")


# the trainer's flags run_distributed.py sets itself (from its own flags): the others are passed on
LAUNCHER_SETS = ("--gpu-id", "--nproc", "--host", "--data-port", "--sync-port", "--model-path")


def passed_on_help() -> str:
    """run_distributed.py --help's list of the trainer flags it passes on (training_worker.py's, from its parser)."""
    import textwrap

    lines = ["flags passed on to the trainer (as training_worker.py takes them):"]
    for act in training_parser()._actions:
        flag = act.option_strings[-1] if act.option_strings else None
        if flag is None or flag in LAUNCHER_SETS or flag == "--help":
            continue
        left = flag if act.nargs == 0 else f"{flag} {act.metavar or act.dest.upper()}"
        lines += textwrap.wrap(act.help or "", 96, initial_indent=f"  {left:<22}", subsequent_indent=" " * 24)
    lines += ["  key.sub=value         any alignrl config override (e.g. trainer.test_freq=0), after the flags", "",
              *textwrap.wrap(f"The trainer reads {DS_FILE} in this folder unless --no-deepspeed: written on the first "
                             "run with that run's batch numbers; edit it to change DeepSpeed and the batch "
                             "(train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size).", 96)]
    return "\n".join(lines)


def launcher_main(argv: list[str] | None = None) -> int:
    """run_distributed.py: one sampler on --sampling-gpu, a trainer over --training-gpus; stops both."""
    p = OneLineParser(prog="run_distributed.py", description="Sampler + multi-process trainer (seed 004).",
                      epilog=passed_on_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sampling-gpu", type=int, default=0, metavar="N", help="CUDA device of the sampler")
    p.add_argument("--training-gpus", default="1", metavar="IDS",
                   help='comma-separated device ids of the trainer\'s processes, e.g. "1,2,3" (on CPU: their number)')
    p.add_argument("--data-port", type=int, default=5555, metavar="PORT",
                   help="port the samples travel on, sampler -> trainer (default: 5555)")
    p.add_argument("--sync-port", type=int, default=5556, metavar="PORT",
                   help="port the weights travel on, trainer -> sampler (default: 5556)")
    p.add_argument("--model-path", default="demo", metavar="DIR",
                   help="HF model folder (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1", help="the address the trainer binds and the sampler connects to")
    a, rest = p.parse_known_args(argv)
    try:
        gpus = [int(g) for g in a.training_gpus.split(",") if g.strip()]
    except ValueError:
        p.error(f"--training-gpus {a.training_gpus!r}: give comma-separated device ids, e.g. \"1,2,3\"")
    if not gpus:
        p.error("--training-gpus needs at least one device id")
    if a.sampling_gpu < 0 or min(gpus) < 0:
        p.error(f"--sampling-gpu {a.sampling_gpu} --training-gpus {a.training_gpus!r}: give CUDA device ids from 0")
    problem = ports_problem(a.host, a.data_port, a.sync_port)  # once here, not by the sampler and the trainer each
    if problem:
        p.error(problem)
    # the trainer's flags, config and deepspeed.json: a mistake is named now, once, before anything starts
    t, extra = parse_training(rest, "run_distributed.py")
    t.nproc, t.host, t.data_port, t.sync_port, t.model_path = len(gpus), a.host, a.data_port, a.sync_port, a.model_path
    from alignrl.config import ConfigError

    try:
        prepare_training(t, extra, write=False)
    except (ConfigError, Seed004Error) as e:
        p.error(str(e))
    threads = max(1, (os.cpu_count() or 1) // (len(gpus) + 1))  # processes sharing a machine split its cores
    ports = ["--host", a.host, "--data-port", str(a.data_port), "--sync-port", str(a.sync_port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    trainer_env = {**env, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if _has_cuda() else {})}
    this = [sys.executable, "-m", "alignrl.dist.seed004"]
    trainer = subprocess.Popen([*this, "train", *ports, "--nproc", str(len(gpus)),
                                "--model-path", a.model_path, "--threads", str(threads), *rest], env=trainer_env)
    sampler = subprocess.Popen([*this, "sample", *ports, "--gpu-id",
                                str(a.sampling_gpu), "--model-path", a.model_path, "--threads", str(threads)], env=env)
    try:
        # a sampler that cannot start (its model, its data, refused at hello) ends the run with its own line;
        # the trainer would wait pipeline.peer_timeout_s for a batch and then ask for a sampler
        code = wait_interruptible(trainer, sampler, watch=(sampler,))
        if code == 0:
            try:
                sampler.wait(timeout=30)  # it hears "done" and exits
            except subprocess.TimeoutExpired:
                pass
        return code
    finally:
        for proc in (sampler, trainer):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


# communication_test.py: this process plays the trainer (binds both ports, answers on the sync port) and starts a
# second one, `python -m alignrl.dist.seed004 comm-peer`, that plays the sampler (connects, pushes, asks)
COMM = "communication_test"
PEER_START_S = 600.0  # for the sampler process to import torch, load the model and make its batch


def comm_parser(prog: str = "communication_test.py") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Round trip of seed 004's messages (a scored batch with reference "
                      "log-probs, the weights) between two processes over the two ports: prints one sample, latency "
                      "and throughput; exits 1 if a port is taken, nothing answers, or anything arrives different.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (this process) and connect to (the other)")
    p.add_argument("--data-port", type=int, default=5555, help="port of the scored batches (sampler -> trainer)")
    p.add_argument("--sync-port", type=int, default=5556, help="port of the weights (trainer -> sampler)")
    p.add_argument("--model-path", default="demo", help="HF model folder (default: the embedded demo model)")
    p.add_argument("--rounds", type=int, default=20, help="timed round trips of each message")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each answer")
    return p


def comm_args_problem(a: argparse.Namespace) -> str | None:
    if a.rounds < 1:
        return f"--rounds {a.rounds}: give the number of timed round trips, 1 or more (default 20)"
    if not a.timeout > 0:
        return f"--timeout {a.timeout:g}: give the seconds to wait for each answer, above 0 (default 30)"
    problem = ports_problem(a.host, a.data_port, a.sync_port)
    if problem:
        return problem
    if a.model_path != "demo" and not (Path(a.model_path) / "config.json").is_file():
        return (f"--model-path {a.model_path}: not a Hugging Face model folder (no config.json there); give a folder "
                "saved with save_pretrained, or leave it out for the embedded demo model")
    return None


def _connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}.get(host, host)


def _digest(tensors: dict) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a message's tensors."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _load(path: str):
    from alignrl.models.loader import load_model

    return load_model(path, log=lambda *_: None)


def comm_test_main(argv: list[str] | None = None) -> int:
    """communication_test.py: the trainer's side of the test; the sampler's side is a second process."""
    p = comm_parser()
    a = p.parse_args(argv)
    problem = comm_args_problem(a)
    if problem:
        p.error(problem)
    import secrets
    import tempfile

    from alignrl.dist.records_wire import KIND, from_wire, seed_rows
    from alignrl.dist.weights_wire import encode_weights
    from alignrl.dist.wire import TOKEN_ENV, WireError
    from alignrl.dist.zmq_link import InsecureBind, Puller, Replier, _is_loopback, token_from_env
    from alignrl.models.loader import ModelError

    def failed(why: str) -> int:
        print(f"{COMM}: FAILED: {why}", file=sys.stderr)
        return 1

    # beyond loopback the sockets want a shared token: the two processes of this test make one up between them
    token = token_from_env() or ("" if _is_loopback(a.host) else secrets.token_hex(16))
    socks = []
    try:
        for cls, port, flag, what in ((Puller, a.data_port, "--data-port", "data"),
                                      (Replier, a.sync_port, "--sync-port", "sync")):
            try:
                socks.append(cls(a.host, port, token=token, port_flag=flag))
            except OSError as e:
                taken = e.errno == errno.EADDRINUSE
                return failed(f"port {port} on {a.host} ({flag}) is taken by another program: stop it, or give this "
                              f"test and both workers other ports ({flag} N)" if taken else
                              f"cannot bind {flag} {port} on {a.host}: {e.strerror or e}")
            except InsecureBind as e:
                return failed(str(e))
        pull, rep = socks
        try:
            model, tok = _load(a.model_path)
        except (ModelError, OSError, ValueError) as e:
            print(f"communication_test.py: error: --model-path {a.model_path}: {e}", file=sys.stderr)
            return 2
        weights = encode_weights(model.named_parameters(), 1, token=token)
        nbytes = sum(len(memoryview(f)) for f in weights)
        import alignrl

        root = str(Path(alignrl.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               TOKEN_ENV: token}
        with tempfile.TemporaryFile("w+") as err:
            peer = subprocess.Popen([sys.executable, "-m", "alignrl.dist.seed004", "comm-peer",
                                     "--host", _connect_host(a.host), "--data-port", str(pull.port),
                                     "--sync-port", str(rep.port), "--model-path", a.model_path,
                                     "--rounds", str(a.rounds), "--timeout", f"{a.timeout:g}"],
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                report, why = _serve(a, pull, rep, peer, weights, tok, KIND, from_wire, seed_rows, WireError)
                if why is None:
                    try:
                        peer.wait(timeout=a.timeout)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                if peer.poll() is None:
                    peer.kill()
                peer.wait()
            if why is None and report is None:
                err.seek(0)
                lines = [x for x in err.read().splitlines() if x.strip()]
                why = (f"the sampler process (pid {peer.pid}) stopped: {lines[-1].strip() if lines else 'no message'}"
                       f" (exit {peer.returncode})")
    finally:
        for s in socks:
            s.close()
    if why is not None:
        return failed(why)
    print(f"two processes: pid {os.getpid()} (trainer side) bound {pull.addr} (--data-port) and {rep.addr} "
          f"(--sync-port); pid {report['pid']} (sampler side) connected to both")
    batch_ms, weights_s = float(report["batch_ms"]), max(float(report["weights_ms"]) / 1e3, 1e-9)
    print(f"scored batch ({report['samples']} samples): {batch_ms:.2f} ms per round trip; weights "
          f"({nbytes / 2**20:.1f} MiB): {weights_s * 1e3:.1f} ms, {nbytes / 2**20 / weights_s:.0f} MiB/s")
    if not report.get("ok"):
        return failed(str(report.get("problem")))
    print(f"{COMM}: OK")
    return 0


def _serve(a, pull, rep, peer, weights, tok, kind, from_wire, seed_rows, WireError) -> tuple[dict | None, str | None]:
    """Answers the sampler process until its report: (report, None), or (None, why) on a failure here, or
    (None, None) when the process exited first (its own line says why)."""
    import time

    shown, hello = False, False
    last = time.monotonic()
    while True:
        try:
            got = rep.recv(0.2)
        except WireError as e:
            return None, f"a malformed request arrived on --sync-port {rep.port}: {e}"
        if got is None:
            if peer.poll() is not None:
                return None, None
            if time.monotonic() - last > (a.timeout if hello else PEER_START_S):
                return None, (f"the sampler process (pid {peer.pid}) sent nothing to --sync-port {rep.port} for "
                              f"{a.timeout if hello else PEER_START_S:g} s")
            continue
        last = time.monotonic()
        who, msg = got
        if msg.kind == "hello":
            hello = True
            rep.reply_msg(who, "welcome", {"pid": os.getpid()})
        elif msg.kind == "echo":
            try:
                batch = pull.recv(a.timeout)
            except WireError as e:
                return None, f"a malformed message arrived on --data-port {pull.port}: {e}"
            if batch is None:
                return None, (f"the scored batch the sampler process pushed did not arrive on --data-port "
                              f"{pull.port} within {a.timeout:g} s")
            if not shown:
                try:
                    from_wire(batch)  # what the trainer checks and builds
                except WireError as e:
                    return None, f"the scored batch is not one the trainer takes: {e}"
                if batch.meta.get("sha256") != _digest(batch.tensors):
                    return None, "the scored batch arrived different from what the sampler process sent"
                print("one sample as the trainer sees it (seed 004's fields):")
                for k, v in seed_rows(batch, tok)[0].items():
                    shown_v = v if not hasattr(v, "shape") else f"numpy.ndarray {v.dtype} {list(v.shape)}"
                    print(f"  {k}: {shown_v if len(str(shown_v)) < 100 else str(shown_v)[:97] + '...'}")
                sys.stdout.flush()
                shown = True
            rep.reply_msg(who, kind, batch.meta, batch.tensors)  # back, for the sampler to compare
        elif msg.kind == "send_weights":
            rep.reply(who, weights)
        elif msg.kind == "report":
            rep.reply_msg(who, "bye", {})
            return dict(msg.meta), None
        else:
            return None, f"the sampler process asked {msg.kind!r}, which this test does not know"


def comm_peer_main(argv: list[str] | None = None) -> int:
    """The sampler's side of communication_test.py (started by it): makes a scored batch with the producer on the
    model (with reference log-probs), pushes it to --data-port and asks for it back on --sync-port, then asks for
    the weights; compares both with its own; reports. Any failure is one line on stderr, exit 1."""
    a = comm_parser("communication_test.py (sampler side)").parse_args(argv)
    import time

    import torch

    from alignrl.algos.placement import build_maker, build_ref
    from alignrl.algos.runner import PromptData
    from alignrl.config import load_config
    from alignrl.data import synthetic
    from alignrl.dist.env import SINGLE
    from alignrl.dist.records_wire import KIND, to_wire
    from alignrl.dist.wire import WireError
    from alignrl.dist.zmq_link import PeerTimeout, Pusher, Requester, address, token_from_env
    from alignrl.rollout.hf_engine import HFRolloutEngine

    try:
        cfg = load_config(None, [f"model.path={a.model_path}", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                 "rollout.n=4", "rollout.max_new_tokens=24"])
        model, tok = _load(a.model_path)
        ref = build_ref(cfg, torch.device("cpu"), base=model)  # seed 004: the sampler computes them
        maker = build_maker(cfg, HFRolloutEngine(model, tok), tok, ref, SINGLE)
        batch = maker.make(1, [0, 1], PromptData(tok, synthetic.generate("train", 2, seed=0), 128))
        meta, tensors = to_wire(batch, tok, lease="test:1")
        meta["sha256"] = _digest(tensors)
        token = token_from_env()
        with Pusher(address(a.host, a.data_port), hwm=4, token=token) as push, \
                Requester(address(a.host, a.sync_port), token=token) as req:
            try:
                req.request("hello", {"pid": os.getpid()}, timeout_s=a.timeout)
            except PeerTimeout:
                raise PeerTimeout(f"nothing answers on {req.addr} (--sync-port) within {a.timeout:g} s: check "
                                  "--host and the ports, and that no firewall sits between the processes") from None
            problem, times = None, []
            for i in range(a.rounds + 1):  # round 0 is checked, the others timed
                t0 = time.perf_counter()
                push.send(KIND, meta, tensors, timeout_s=a.timeout)
                back = req.request("echo", {"round": i}, timeout_s=a.timeout)
                times.append(time.perf_counter() - t0)
                same = back.kind == KIND and back.meta == meta and set(back.tensors) == set(tensors) and all(
                    back.tensors[k].dtype == t.dtype and torch.equal(back.tensors[k], t) for k, t in tensors.items())
                if i == 0 and not same:
                    problem = "the scored batch came back different from what was sent"
            batch_ms = sum(times[1:]) / a.rounds * 1e3
            times, mine = [], dict(model.named_parameters())
            for i in range(a.rounds + 1):
                t0 = time.perf_counter()
                w = req.request("send_weights", {}, timeout_s=a.timeout)
                times.append(time.perf_counter() - t0)
                if i == 0 and not (set(w.tensors) == set(mine) and all(
                        torch.equal(w.tensors[n], t.detach()) for n, t in mine.items())):
                    problem = problem or "the weights arrived different from the model's"
            weights_ms = sum(times[1:]) / a.rounds * 1e3
            req.request("report", {"pid": os.getpid(), "ok": problem is None, "problem": problem,
                                   "batch_ms": batch_ms, "weights_ms": weights_ms, "samples": len(batch)},
                        timeout_s=a.timeout)
        return 0 if problem is None else 1
    except (PeerTimeout, WireError) as e:
        print(str(e), file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the test's report, whatever it was
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # run_distributed.py and communication_test.py start their other processes through here
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"train": training_main, "sample": sampling_main, "comm-peer": comm_peer_main}[command](rest))
