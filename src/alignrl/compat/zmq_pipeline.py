"""The ZeroMQ pipeline's commands, as its users type them from the repository root:

    python communication_test.py
    python sampling_worker.py --gpu-id 0 --data-port 5555 --sync-port 5556
    python training_worker.py --gpu-id 1 --data-port 5555 --sync-port 5556 [--no-deepspeed]
    python run_distributed.py --sampling-gpu 0 --training-gpus "1,2,3"

The trainer is `alignrl train grpo pipeline.placement=zmq` (DeepSpeed ZeRO-2 from an editable, generated
`deepspeed.json`, or DDP / one process with --no-deepspeed); the sampler is `alignrl sample`. On a machine
without GPUs the device ids only count processes. Flags the seed lacks map onto config keys; any
`key.sub=value` after the flags is passed on as a config override.

`deepspeed.json` is written on the first run with that run's batch numbers, and again for each run until the user
edits it (zmq_deepspeed_json.untouched); the batch numbers of a file the user edited are the run's
(train_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size, train_batch_size and gradient_accumulation_steps ->
the mini-batch), said in one line at start. alignrl drives the accumulation itself,
so the engine hands DeepSpeed nominal batch numbers (alignrl.train.engines.deepspeed.load_ds_config).

communication_test.py is `compat.zmq_comm_test`, run_distributed.py `compat.zmq_launcher`; the deepspeed.json handling
`compat.zmq_deepspeed_json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from alignrl.runtime.one_line import OneLineParser
from alignrl.compat.zmq_deepspeed_json import (DS_FILE, ZmqScriptError, ds_batch_overrides, generated, read_ds_json,
                                            run_batch, untouched)
from alignrl.errors import FLAGS_ENV, PROGRAM_ENV, UserError, in_flag_words

SAVE_STEPS = 1000  # the ZeroMQ pipeline's scripts save every 1000 steps (the final step is always saved)
# the config keys the trainer's and the sampler's flags set: their errors name the flags (alignrl.errors)
TRAINER_FLAGS = {"trainer.total_training_steps": "--max-steps", "data.train_files": "--data-path",
                 "data.val_files": "--eval-data-path", "model.path": "--model-path", "trainer.output_dir": "--output-dir",
                 "trainer.save_freq": "--save-steps", "pipeline.max_staleness": "--max-staleness",
                 "data.train_batch_size": "--batch-size", "rollout.n": "--group-size", "actor.lr": "--lr",
                 "pipeline.host": "--host", "pipeline.data_port": "--data-port", "pipeline.sync_port": "--sync-port",
                 "trainer.threads": "--threads", "pipeline.replay_buffer_size": "--replay-buffer-size"}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def training_parser(prog: str = "training_worker.py") -> argparse.ArgumentParser:
    # no abbreviations: run_distributed.py passes unknown flags on, and `--npro 3` would reach this parser as --nproc
    p = OneLineParser(prog=prog, description="GRPO trainer fed by ZeroMQ samplers.", allow_abbrev=False)
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
    p.add_argument("--eval-data-path", default=None, metavar="FILE",
                   help="held-out data for the accuracy (data.val_files); default: synthetic arithmetic")
    p.add_argument("--max-steps", type=int, default=None, metavar="N", help="RL steps (trainer.total_training_steps)")
    p.add_argument("--output-dir", default="output", metavar="DIR", help="run folders go here (default: output)")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="0: on-policy; k: batches up to k versions old")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="prompts per step (data.train_batch_size)")
    p.add_argument("--group-size", type=int, default=None, metavar="N", help="samples per prompt (rollout.n)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (actor.lr)")
    p.add_argument("--save-steps", type=int, default=SAVE_STEPS, metavar="N",
                   help=f"checkpoint every N steps (trainer.save_freq; default {SAVE_STEPS}); the final step is "
                        "always saved")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch CPU threads per process (0: torch's default)")
    p.add_argument("--replay-buffer-size", type=int, default=None, metavar="N",
                   help="prompt groups with reward spread kept to replay in place of groups without it "
                        "(pipeline.replay_buffer_size; 0: off); turns on algorithm.rollout_is=token unless given")
    return p


def training_overrides(a: argparse.Namespace, extra: list[str], ds_json: str | None = None) -> list[str]:
    """The trainer's config overrides; `ds_json` is the DeepSpeed file to name (None: leave it out)."""
    o = ["pipeline.placement=zmq", f"pipeline.host={a.host}", f"pipeline.data_port={a.data_port}",
         f"pipeline.sync_port={a.sync_port}", f"model.path={a.model_path}", f"trainer.output_dir={a.output_dir}",
         "trainer.experiment_name=grpo_zmq"]
    for key, value in (("data.train_files", a.data_path), ("data.val_files", a.eval_data_path),
                       ("trainer.total_training_steps", a.max_steps),
                       ("pipeline.max_staleness", a.max_staleness), ("data.train_batch_size", a.batch_size),
                       ("actor.ppo_mini_batch_size", a.batch_size), ("rollout.n", a.group_size),
                       ("actor.lr", a.lr), ("trainer.save_freq", a.save_steps)):
        if value is not None:
            o.append(f"{key}={value}")
    if a.threads:
        o.append(f"trainer.threads={a.threads}")
    if a.replay_buffer_size is not None:  # replayed groups are off-policy: the IS correction comes with them
        o.append(f"pipeline.replay_buffer_size={a.replay_buffer_size}")
        if a.replay_buffer_size > 0 and not any(x.startswith("algorithm.rollout_is=") for x in extra):
            o.append("algorithm.rollout_is=token")
    if not a.no_deepspeed:
        o += ["trainer.strategy=deepspeed", "trainer.zero_stage=2"]
        o += [f"trainer.deepspeed_config={ds_json}"] if ds_json else []
    return o + extra


def trainer_flag_names(a: argparse.Namespace, extra: list[str]) -> dict[str, str]:
    """{config key: flag} for the keys the trainer's flags set (given, or by the script's defaults) and the user did
    not type as key=value: an error about `actor.lr=abc` typed as such stays in those words."""
    by_flags = {o.split("=", 1)[0] for o in training_overrides(a, [])}
    typed = {x.split("=", 1)[0] for x in extra}
    return {k: f for k, f in TRAINER_FLAGS.items() if k in by_flags and k not in typed}


def data_path_problem(path: str | None, side: str, flag: str = "--data-path", data: str = "training") -> str | None:
    """A --data-path (or `flag`, for `data`) that names no readable data file, in the flag's own words (`side`: what
    leaving it out means)."""
    if path is None or path == "synthetic":
        return None
    if not Path(path).is_file():
        what = "a folder" if Path(path).is_dir() else "no such file"
        return f"{flag} {path}: {what}; give the {data} data (.jsonl, .json " \
               f"or .parquet), or {side}"
    if Path(path).suffix.lower() not in DATA_SUFFIXES:
        return f"{flag} {path}: a {Path(path).suffix or 'suffix-less'} file; give a .jsonl, .json or .parquet file"
    return None


def ports_problem(host: str, data_port: int, sync_port: int, whose: str = "") -> str | None:
    """The first mistake in a host and the two ports (`whose`: "the trainer's " on a sampler), or None."""
    import socket

    for flag, port in (("--data-port", data_port), ("--sync-port", sync_port)):
        if not 1 <= port <= 65535:
            return f"{flag} {port} is not a TCP port: give {whose or 'one '}in 1..65535 (defaults: 5555 and 5556)"
    if data_port == sync_port:
        return (f"--data-port and --sync-port are both {data_port}: give {whose}two different ports "
                "(the scripts' defaults: --data-port 5555 --sync-port 5556)")
    try:
        socket.getaddrinfo(host, sync_port)
    except (OSError, UnicodeError):
        return f"--host {host!r} does not resolve to an address: give {whose or 'a '}host name or IP"
    return None


def port_taken(host: str, data_port: int, sync_port: int) -> str | None:
    """A trainer port another program holds, in the flags' words (None: both free). Binding is the only sure test;
    the sockets are closed at once (SO_REUSEADDR, as ZeroMQ binds)."""
    import errno
    import socket

    where = "0.0.0.0" if host in ("*", "") else host
    for flag, port in (("--data-port", data_port), ("--sync-port", sync_port)):
        try:
            family = socket.getaddrinfo(where, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((where.strip("[]"), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"{flag} {port} is in use on {host} (another training_worker.py, or another program): stop "
                        f"it or pass another {flag}")
            if e.errno == errno.EADDRNOTAVAIL:
                return (f"--host {host} is not an address of this machine, where the trainer binds: give one of "
                        "its addresses, 0.0.0.0 for all of them, or 127.0.0.1")
    return None


def prepare_training(a: argparse.Namespace, extra: list[str], write: bool, say=None) -> list[str]:
    """The trainer's config overrides once its flags, its config and `deepspeed.json` are checked: ConfigError or
    ZmqScriptError in one line otherwise. `write`: generate a missing deepspeed.json (with this run's batch numbers)
    and say, through `say`, what it wrote and which values came from the user's file."""
    from alignrl.config import ConfigError, check_world_size, keys_given, load_config

    problem = (data_path_problem(a.data_path, "leave it out for synthetic arithmetic")
               or data_path_problem(a.eval_data_path, "leave it out for synthetic arithmetic", "--eval-data-path",
                                  "held-out"))
    if problem:
        raise ZmqScriptError(problem)
    if a.model_path != "demo":  # named in the flag's spelling (the demo model is built on first use)
        from alignrl.models.loader import ModelError, resolve_model_path

        try:
            resolve_model_path(a.model_path, lambda *_: None, key="--model-path")
        except ModelError as e:
            raise ZmqScriptError(str(e)) from None
    cfg = load_config(None, training_overrides(a, extra))
    prompts = cfg.data.train_batch_size
    if prompts % a.nproc and a.batch_size is None and "data.train_batch_size" not in keys_given(None, extra):
        # the seed's own `--training-gpus "1,2,3"` with the default batch: each rank takes whole prompts, in whole
        # micro-batches (DeepSpeed's train_batch_size = micro-batch × accumulation × ranks, which deepspeed.json
        # states); the largest such batch below the default
        for a.batch_size in range(prompts // a.nproc * a.nproc, 0, -a.nproc):
            try:
                cfg = load_config(None, training_overrides(a, extra))
                check_world_size(cfg, a.nproc)
            except ConfigError:
                continue
            if (cfg.mini_batch_sequences // a.nproc) % cfg.actor.ppo_micro_batch_size == 0:
                break
        if say:
            say(f"{a.nproc} training processes: {a.batch_size} prompts a step (the default {prompts} does not split "
                "evenly over them; --batch-size sets it)")
    check_world_size(cfg, a.nproc)  # what the launch checks too: before deepspeed.json is written for the split
    before_start(cfg, a)
    if a.data_path or a.eval_data_path:  # their rows, read as the run will: a bad one is named before anything starts
        from alignrl.data.prompts import load_task_data

        load_task_data(cfg)
    if a.no_deepspeed:
        return training_overrides(a, extra)
    path = Path(DS_FILE)
    ds = read_ds_json(path) if path.is_file() else None
    if ds is not None and not untouched(ds):  # the user's (edited, or their own): the run follows it
        try:
            more, line = ds_batch_overrides(ds, cfg, a.nproc, keys_given(None, extra), a.batch_size is not None)
        except ZmqScriptError as e:
            raise ZmqScriptError(f"{path}: {e}") from None
        if more:
            load_config(None, training_overrides(a, extra) + more)
        if line and say:
            say(line)
    elif write:
        from alignrl.runtime.env import cuda_bf16

        bf16, run = cuda_bf16(), run_batch(cfg, a.nproc)
        more = ([f"actor.ppo_micro_batch_size={run['train_micro_batch_size_per_gpu']}"]
                if run["train_micro_batch_size_per_gpu"] != min(cfg.actor.ppo_micro_batch_size,
                                                            run["train_batch_size"] // a.nproc)
                else [])
        mine = generated(run, bf16, cfg.actor.grad_clip)
        if mine != ds:  # absent, or alignrl's own for another run and not edited since: written for this one
            path.write_text(json.dumps(mine, indent=4) + "\n")
            if say:
                say(f"wrote {path} (ZeRO-2, bf16 {'on' if bf16 else 'off'}; this run's batch: "
                    f"train_batch_size {run['train_batch_size']} = {run['train_micro_batch_size_per_gpu']} per "
                    f"micro-batch × {a.nproc} process(es) × {run['gradient_accumulation_steps']} accumulation "
                    "step(s)); edit it to change DeepSpeed and the batch")
    else:
        more = []
    return training_overrides(a, extra, str(path.resolve()) if (path.is_file() or write) else None) + more


def before_start(cfg, a: argparse.Namespace) -> None:
    """What the trainer would refuse once started, checked before anything is written or started (by
    run_distributed.py, before its sampler): the ports, binding beyond loopback without a token, a checkpoint
    past --max-steps."""
    from alignrl.wire.zmq_link import InsecureBind, check_bind, token_from_env
    from alignrl.train.checkpoint import check_newest_not_past

    problem = port_taken(a.host, a.data_port, a.sync_port)
    if problem:
        raise ZmqScriptError(problem)
    try:
        check_bind(a.host, token_from_env())
    except InsecureBind as e:
        raise ZmqScriptError(f"--host {a.host}: {e}") from None
    check_newest_not_past(cfg)


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
        p.error(f"--save-steps {a.save_steps}: give the steps between checkpoints (default {SAVE_STEPS}), or 0 for "
                "the final one only")
    problem = ports_problem(a.host, a.data_port, a.sync_port)  # in the flags' names, not pipeline.*_port's
    if problem:
        p.error(problem)
    return a, extra


def training_main(argv: list[str] | None = None, prog: str = "training_worker.py") -> int:
    a, extra = parse_training(argv, prog)
    os.environ.setdefault(FLAGS_ENV, json.dumps(trainer_flag_names(a, extra)))
    try:  # a mistaken value is named before anything is written (deepspeed.json) or started
        overrides = prepare_training(a, extra, write=True,
                                     say=lambda line: print(f"training_worker: {line}", file=sys.stderr, flush=True))
    except UserError as e:
        print(f"{prog}: error: {in_flag_words(str(e))}", file=sys.stderr)
        return 2
    # the run's own lines, on every torchrun rank, name the script the user ran (run_distributed.py sets its own)
    os.environ.setdefault(PROGRAM_ENV, prog)
    if a.nproc == 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(a.gpu_id)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not has_cuda() else "cuda")
    from alignrl.cli import RANK_IMPORTS, main

    # DeepSpeed wants a process group even for one process: run under torchrun whenever it is used
    launch = ["--nproc", str(a.nproc)] if a.nproc > 1 or not a.no_deepspeed else []
    if launch and a.nproc == 1 and "LOCAL_RANK" not in os.environ:
        from alignrl.runtime.launch import torchrun

        return torchrun(1, ["alignrl", "train", "grpo", *overrides], preload=RANK_IMPORTS)
    return main([*launch, "train", "grpo", *overrides])


def has_cuda() -> bool:
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
    os.environ.setdefault(FLAGS_ENV, json.dumps({"model.path": "--model-path",  # the keys the sampler's flags set
                                                 **({"data.train_files": "--data-path"} if args.data_path else {})}))
    problem = sampling_args_problem(args)
    if problem:
        p.error(problem)
    from alignrl.placements.zmq.sampler import run

    return run(args, prog)


def sampling_args_problem(a: argparse.Namespace) -> str | None:
    """The first mistake in a sampler's flags, or None: named at once, where the sampler would otherwise load
    its model and then wait --peer-timeout seconds for a trainer it can never reach."""
    problem = ports_problem(a.host, a.data_port, a.sync_port, "the trainer's ")
    if problem:
        return problem
    if a.threads < 0:
        return f"--threads {a.threads}: give the torch threads of this process, or 0 for torch's default"
    if a.gpu_id is not None and a.gpu_id < 0:
        return f"--gpu-id {a.gpu_id}: give a CUDA device id from 0"
    if not a.peer_timeout > 0:
        return f"--peer-timeout {a.peer_timeout:g}: give the seconds to wait for an absent trainer, above 0"
    # before the model loads and the trainer is asked (the file was read only once a trainer answered)
    return data_path_problem(a.data_path, "leave --data-path out to read the trainer's data.train_files")


def sample_main(argv: list[str] | None = None) -> int:
    """`alignrl sample ...`: the same sampler under the package's own name."""
    return sampling_main(argv, prog="alignrl sample")


if __name__ == "__main__":  # run_distributed.py starts its sampler and trainer processes through here
    from alignrl.runtime.heap import starting

    starting()
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"train": training_main, "sample": sampling_main}[command](rest))
