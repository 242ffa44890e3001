"""The ZeroMQ launcher, `python run_distributed.py --sampling-gpu 0 --training-gpus "1,2,3"`: one sampler and a
trainer over the listed devices (`python -m alignrl.compat.zmq_pipeline sample|train`), both checked before either starts
and both stopped with it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from alignrl.runtime.one_line import OneLineParser

from alignrl.runtime.launch import wait_interruptible
from alignrl.runtime.lifetime import preexec_die_with_parent
from alignrl.compat.zmq_pipeline import (has_cuda, parse_training, ports_problem, prepare_training, trainer_flag_names,
                                  training_parser)
from alignrl.compat.zmq_deepspeed_json import DS_FILE
from alignrl.runtime.cores import choose_threads
from alignrl.errors import FLAGS_ENV, LAUNCHER_ENV, PROGRAM_ENV, UserError, in_flag_words

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
              *textwrap.wrap(f"The trainer reads {DS_FILE} in this folder unless --no-deepspeed: written with each "
                             "run's batch numbers until you edit it; edit it to change DeepSpeed and the batch "
                             "(train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size).", 96)]
    return "\n".join(lines)


def launcher_main(argv: list[str] | None = None) -> int:
    """run_distributed.py: one sampler on --sampling-gpu, a trainer over --training-gpus; stops both."""
    p = OneLineParser(prog="run_distributed.py", description="Sampler + multi-process trainer (the ZeroMQ pipeline).",
                      epilog=passed_on_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
                      allow_abbrev=False)
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
    mine = [w for w in rest if w.split("=", 1)[0] in LAUNCHER_SETS]
    if mine:  # the trainer's --nproc would disagree with --training-gpus (and its checkpoint with the next run)
        p.error(f"unrecognized arguments: {mine[0]} (run_distributed.py sets it from --sampling-gpu and "
                "--training-gpus)")
    try:
        gpus = [int(g) for g in a.training_gpus.split(",") if g.strip()]
    except ValueError:
        p.error(f"--training-gpus {a.training_gpus!r}: give comma-separated device ids, e.g. \"1,2,3\"")
    if not gpus:
        p.error("--training-gpus needs at least one device id")
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:  # CUDA_VISIBLE_DEVICES=1,1 would put two ranks on one GPU
        p.error(f"--training-gpus {a.training_gpus!r}: device {twice[0]} is listed twice; give each device once")
    if a.sampling_gpu < 0 or min(gpus) < 0:
        p.error(f"--sampling-gpu {a.sampling_gpu} --training-gpus {a.training_gpus!r}: give CUDA device ids from 0")
    problem = ports_problem(a.host, a.data_port, a.sync_port)  # once here, not by the sampler and the trainer each
    if problem:
        p.error(problem)
    # the trainer's flags, config and deepspeed.json: a mistake is named now, once, before anything starts
    t, extra = parse_training(rest, "run_distributed.py")
    t.nproc, t.host, t.data_port, t.sync_port, t.model_path = len(gpus), a.host, a.data_port, a.sync_port, a.model_path
    os.environ.setdefault(FLAGS_ENV, json.dumps(trainer_flag_names(t, extra)))  # its errors, and its processes'
    try:
        prepare_training(t, extra, write=False)
    except UserError as e:
        p.error(in_flag_words(str(e)))
    threads = choose_threads(sharing=len(gpus) + 1).threads  # the trainer's ranks and the sampler split the free cores
    ports = ["--host", a.host, "--data-port", str(a.data_port), "--sync-port", str(a.sync_port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), LAUNCHER_ENV: "run_distributed.py",
           PROGRAM_ENV: "run_distributed.py"}
    trainer_env = {**env, **({"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if has_cuda() else {})}
    this = [sys.executable, "-m", "alignrl.compat.zmq_pipeline"]
    # both die with this launcher, even by kill -9 (they would go on training and holding the ports)
    trainer = subprocess.Popen([*this, "train", *ports, "--nproc", str(len(gpus)),
                                "--model-path", a.model_path, "--threads", str(threads), *rest], env=trainer_env,
                               preexec_fn=preexec_die_with_parent())
    sampler = subprocess.Popen([*this, "sample", *ports, "--gpu-id",
                                str(a.sampling_gpu), "--model-path", a.model_path, "--threads", str(threads)], env=env,
                               preexec_fn=preexec_die_with_parent())
    try:
        # a sampler that cannot start (its model, its data, refused at hello) ends the run with its own line;
        # the trainer would wait pipeline.peer_timeout_s for a batch and then ask for a sampler
        code = wait_interruptible(trainer, sampler, watch=(sampler,))
        if trainer.poll() is None and code < 0:  # a signal ended the sampler, which said nothing (an error says why)
            print(f"run_distributed.py: the sampler (pid {sampler.pid}) was killed by {signal.Signals(-code).name}; "
                  "stopping the trainer (the same command resumes from its last checkpoint)", file=sys.stderr,
                  flush=True)
            return 1
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
