"""Seed 004's commands, as its users type them from the repository root:

    python communication_test.py
    python sampling_worker.py --gpu-id 0 --data-port 5555 --sync-port 5556
    python training_worker.py --gpu-id 1 --data-port 5555 --sync-port 5556 [--no-deepspeed]
    python run_distributed.py --sampling-gpu 0 --training-gpus "1,2,3"

The trainer is `alignrl train grpo pipeline.placement=zmq` (DeepSpeed ZeRO-2 from an editable, generated
`deepspeed.json`, or DDP / one process with --no-deepspeed); the sampler is `alignrl sample`. On a machine
without GPUs the device ids only count processes. Flags the seed lacks map onto config keys; any
`key.sub=value` after the flags is passed on as a config override.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from alignrl.dist.launch import OneLineParser, wait_interruptible

DS_FILE = "deepspeed.json"


def training_parser(prog: str = "training_worker.py") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="GRPO trainer fed by ZeroMQ samplers (seed 004).")
    p.add_argument("--gpu-id", type=int, default=0, help="CUDA device of the (single-process) trainer")
    p.add_argument("--nproc", type=int, default=1, help="training processes (run_distributed.py sets it)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the two ports on")
    p.add_argument("--data-port", type=int, default=5555)
    p.add_argument("--sync-port", type=int, default=5556)
    p.add_argument("--no-deepspeed", action="store_true", help="plain DDP (or one process) instead of ZeRO-2")
    p.add_argument("--model-path", default="demo", help="HF model folder (default: the embedded demo model)")
    p.add_argument("--data-path", default=None, help="training data (.jsonl/.parquet); default: synthetic arithmetic")
    p.add_argument("--max-steps", type=int, default=None, help="RL steps (trainer.total_training_steps)")
    p.add_argument("--output-dir", default="output", help="run folders go here")
    p.add_argument("--max-staleness", type=int, default=None, help="0: on-policy; k: batches up to k versions old")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per step (data.train_batch_size)")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt (rollout.n)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (trainer.save_freq)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per process (0: torch's default)")
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


def ensure_ds_json(a: argparse.Namespace) -> str:
    """`deepspeed.json` in the working folder: the user's own if present (edit it freely), else generated
    (ZeRO-2; bf16 where the GPU has it, fp32 on CPU)."""
    path = Path(DS_FILE)
    if not path.is_file():
        from alignrl.dist.env import cuda_bf16

        bf16 = cuda_bf16()
        cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 2}, "bf16": {"enabled": bf16}, "gradient_clipping": 1.0}
        path.write_text(json.dumps(cfg, indent=4) + "\n")
        print(f"training_worker: wrote {path} (ZeRO-2, bf16 {'on' if bf16 else 'off'}); edit it to change DeepSpeed",
              file=sys.stderr)
    return str(path.resolve())


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
    return a, extra


def training_main(argv: list[str] | None = None) -> int:
    a, extra = parse_training(argv)
    from alignrl.config import ConfigError, load_config

    try:  # a mistaken value is named before anything is written (deepspeed.json) or started
        load_config(None, training_overrides(a, extra))
    except ConfigError as e:
        print(f"alignrl: error: {e}", file=sys.stderr)
        return 2
    overrides = training_overrides(a, extra, None if a.no_deepspeed else ensure_ds_json(a))
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
    p.add_argument("--data-path", default=None, help="training data file, if the trainer's path differs here")
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
    return None


def sample_main(argv: list[str] | None = None) -> int:
    """`alignrl sample ...`: the same sampler under the package's own name."""
    return sampling_main(argv, prog="alignrl sample")


def launcher_main(argv: list[str] | None = None) -> int:
    """run_distributed.py: one sampler on --sampling-gpu, a trainer over --training-gpus; stops both."""
    p = OneLineParser(prog="run_distributed.py", description="Sampler + multi-process trainer (seed 004).")
    p.add_argument("--sampling-gpu", type=int, default=0)
    p.add_argument("--training-gpus", default="1", help='comma-separated device ids, e.g. "1,2,3"')
    p.add_argument("--data-port", type=int, default=5555)
    p.add_argument("--sync-port", type=int, default=5556)
    p.add_argument("--model-path", default="demo")
    p.add_argument("--host", default="127.0.0.1", help="the address the trainer binds and the sampler connects to")
    a, rest = p.parse_known_args(argv)
    try:
        gpus = [int(g) for g in a.training_gpus.split(",") if g.strip()]
    except ValueError:
        p.error(f"--training-gpus {a.training_gpus!r}: give comma-separated device ids, e.g. \"1,2,3\"")
    if not gpus:
        p.error("--training-gpus needs at least one device id")
    parse_training(rest, "run_distributed.py")  # the trainer's flags: a mistake is named now, before anything starts
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



def comm_test_main(argv: list[str] | None = None) -> int:
    """communication_test.py: the real message types (a scored batch made by the producer on the demo
    model, its weights) round-trip over loopback sockets; prints one row of the seed's schema, latency and
    throughput; exits 1 if anything arrives different."""
    import time

    import torch

    from alignrl.algos.placement import build_maker
    from alignrl.algos.runner import PromptData
    from alignrl.config import load_config
    from alignrl.data import synthetic
    from alignrl.dist.env import SINGLE
    from alignrl.dist.records_wire import KIND, from_wire, seed_rows, to_wire
    from alignrl.dist.weights_wire import encode_weights
    from alignrl.dist.wire import decode
    from alignrl.dist.zmq_link import Puller, Pusher
    from alignrl.models.loader import load_model
    from alignrl.rollout.hf_engine import HFRolloutEngine

    p = OneLineParser(prog="communication_test.py", description=comm_test_main.__doc__.split(";")[0])
    p.add_argument("--model-path", default="demo")
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args(argv)
    cfg = load_config(None, [f"model.path={a.model_path}", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=4",
                             "rollout.max_new_tokens=24"])
    model, tok = load_model(a.model_path, log=lambda *_: None)
    maker = build_maker(cfg, HFRolloutEngine(model, tok), tok, None, SINGLE)
    batch = maker.make(1, [0, 1], PromptData(tok, synthetic.generate("train", 2, seed=0), 128))
    meta, tensors = to_wire(batch, tok, lease="test:1")
    with Puller("127.0.0.1", 0, hwm=4) as pull, Pusher(pull.addr, hwm=4) as push:
        push.send(KIND, meta, tensors, timeout_s=10)
        msg = pull.recv(10)
        if msg is None:
            print("communication_test: FAILED: the batch did not arrive within 10 s", file=sys.stderr)
            return 1
        back = from_wire(msg)
        same = (torch.equal(back.rollout.response_ids, batch.rollout.response_ids)
                and torch.equal(back.rollout.logprobs, batch.rollout.logprobs)
                and torch.equal(back.scores.rewards, batch.scores.rewards))
        row = seed_rows(msg, tok)[0]
        print("one sample as the trainer sees it (seed 004's fields):")
        for k, v in row.items():
            shown = v if not hasattr(v, "shape") else f"numpy.ndarray {v.dtype} {list(v.shape)}"
            print(f"  {k}: {shown if len(str(shown)) < 100 else str(shown)[:97] + '...'}")
        t0 = time.perf_counter()
        for _ in range(a.rounds):
            push.send(KIND, meta, tensors, timeout_s=10)
            from_wire(pull.recv(10))
        batch_ms = (time.perf_counter() - t0) / a.rounds * 1e3
        frames = encode_weights(model.named_parameters(), 1)
        nbytes = sum(len(memoryview(f)) for f in frames)
        t0 = time.perf_counter()
        for _ in range(a.rounds):
            push._sock.send_multipart(frames, copy=False)
            w = decode(pull.recv_frames(10))
        weights_s = (time.perf_counter() - t0) / a.rounds
        same = same and all(torch.equal(w.tensors[n], t) for n, t in model.named_parameters())
    print(f"scored batch ({len(batch)} samples): {batch_ms:.2f} ms per round trip; weights ({nbytes / 2**20:.1f} MiB): "
          f"{weights_s * 1e3:.1f} ms, {nbytes / 2**20 / weights_s:.0f} MiB/s")
    if not same:
        print("communication_test: FAILED: data arrived different from what was sent", file=sys.stderr)
        return 1
    print("communication_test: OK")
    return 0


if __name__ == "__main__":  # run_distributed.py starts its two workers through here
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"train": training_main, "sample": sampling_main}[command](rest))
