"""Seconds per optimisation step of each training engine on 2 local ranks (gloo on CPU, NCCL on GPUs),
side by side in one run, plus the one-process engine on the same global batch.

    python benchmarks/engines_bench.py [--model PATH] [--steps 6] [--batch 16]

Each engine runs the actor's PPO update (forward, backward, gradient reduction, optimizer step) on a
fixed batch of sequences; the first step is warm-up and excluded. Ratios are against DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [("single", 0, 1), ("ddp", 0, 2), ("fsdp2", 0, 2), ("deepspeed", 1, 2), ("deepspeed", 2, 2),
         ("deepspeed", 3, 2)]


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from alignrl.data.records import Experience
    from alignrl.runtime.env import init_distributed, shard, shutdown
    from alignrl.train.actor import Actor, PolicyLossSpec
    from alignrl.train.engines import OptimSpec, build_engine

    env = init_distributed()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    g = torch.Generator().manual_seed(0)
    b, p, r = args.batch, 48, 48
    ids = torch.randint(3, model.config.vocab_size, (b, p + r), generator=g)
    mask = torch.ones(b, p, dtype=torch.bool)
    rmask = torch.ones(b, r, dtype=torch.bool)
    exp = Experience(ids[:, :p], mask, ids[:, p:], rmask, -torch.rand(b, r, generator=g) * 3, None,
                     torch.randn(b, 1, generator=g).expand(b, r).contiguous())
    local = exp.select(torch.tensor(shard(list(range(b)), env)))
    engine = build_engine(args.strategy, model, OptimSpec(lr=1e-5, total_steps=100), env, zero_stage=args.stage)
    actor = Actor(engine)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        actor.update(local, PolicyLossSpec(), mini_batch=len(local), micro_batch=args.micro, epochs=1,
                     generator=torch.Generator().manual_seed(0))
        times.append(time.perf_counter() - t0)
    if env.is_main:
        Path(args.out).write_text(json.dumps({"times": times[1:]}))
    shutdown()


def drive(args) -> None:
    model = args.model
    if model is None:
        from alignrl.models.tiny import ensure_demo_model

        model = str(ensure_demo_model())
    from alignrl.runtime.ports import free_port

    results = []
    for strategy, stage, nproc in CASES:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        worker_args = [__file__, "--worker", "--strategy", strategy, "--stage", str(stage), "--model", model,
                       "--steps", str(args.steps), "--batch", str(args.batch), "--micro", str(args.micro), "--out", out]
        cmd = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", "--master_addr=127.0.0.1", *worker_args] if nproc > 1
               else [sys.executable, *worker_args])
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{strategy} stage {stage}: failed\n{r.stderr[-1500:]}")
            continue
        times = json.loads(Path(out).read_text())["times"]
        results.append((strategy if strategy != "deepspeed" else f"deepspeed zero-{stage}", nproc,
                        sorted(times)[len(times) // 2]))
    ddp = next((t for name, _, t in results if name == "ddp"), None)
    print(f"global batch {args.batch} sequences × 96 tokens, micro-batch {args.micro}, median of {args.steps - 1} "
          f"steps after warm-up; model {model}")
    print(f"{'engine':<20}{'ranks':>6}{'s/step':>10}{'vs ddp':>10}")
    for name, nproc, t in results:
        print(f"{name:<20}{nproc:>6}{t:>10.3f}{(t / ddp if ddp else float('nan')):>9.2f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--model")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
