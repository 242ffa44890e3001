#!/usr/bin/env python
"""The demo's GRPO step alone and beside one busy process (a neighbour spinning on one core), in one run.

    python benchmarks/neighbour.py [--steps 8] [--rounds 2] [--fixed-threads] [--arrive-after S]
    python benchmarks/neighbour.py --steps 0 --rounds 1      # the whole `make demo` run, alone and beside

Each round runs `alignrl demo` for `--steps` steps (no evaluation, no checkpoints) twice: alone, then with a
CPU-bound neighbour process. The step time is the median `timing/step` of the run's metrics.jsonl, the first two
steps left out (warm-up). Prints both medians and `ratio = X.XXx` (beside / alone), and the same for the runs'
whole seconds (`wall_seconds` of summary.json, start-up and evaluations included). On a 2-core machine the fair
share is 2.0x: the neighbour takes one core of two. `--fixed-threads` gives each run torch's own thread count
(OMP_NUM_THREADS = all cores, the OpenMP runtime's own wait policy): what a run did before it sized its threads
from the free cores, for comparison. `--arrive-after S` starts the neighbour S seconds into the run instead of
before it, so the run starts on an idle machine and must notice the neighbour between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def demo_seconds(steps: int, neighbour: bool, fixed_threads: bool, arrive_after: float) -> tuple[float, float]:
    """(median s/step after the warm-up, the run's wall seconds)."""
    out = Path(tempfile.mkdtemp(prefix="neighbour-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "ALIGNRL_IGNORE_LOAD", "OMP_WAIT_POLICY")}
    if fixed_threads:
        env.update(OMP_NUM_THREADS=str(os.cpu_count() or 1))
    short = [f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.save_freq=0",
             "trainer.eval_pass_at_k=false", "data.val_size=8"] if steps else []  # 0: the whole demo
    cmd = [sys.executable, "-m", "alignrl", "demo", *short, "trainer.progress_bar=false", "trainer.logger=[jsonl]",
           f"trainer.output_dir={out}", "trainer.experiment_name=run"]
    spin = None
    try:
        run = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        if neighbour:
            time.sleep(arrive_after)
            spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if run.wait() != 0:
            sys.exit(f"the demo run failed (exit {run.returncode}); run it alone to see why")
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    rows = [json.loads(line) for line in (out / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    times = [r["timing/step"] for r in rows if "timing/step" in r][2:]
    return statistics.median(times), json.loads((out / "run" / "summary.json").read_text())["wall_seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="demo steps per run; 0: the whole demo as `make demo` runs it")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fixed-threads", action="store_true")
    p.add_argument("--arrive-after", type=float, default=0.0, help="seconds into the run the neighbour starts")
    a = p.parse_args()
    alone, beside = [], []
    for r in range(a.rounds):
        alone.append(demo_seconds(a.steps, False, a.fixed_threads, 0.0))
        beside.append(demo_seconds(a.steps, True, a.fixed_threads, a.arrive_after))
        print(f"round {r + 1}: alone {alone[-1][0]:.3f} s/step ({alone[-1][1]:.0f} s in all), beside a busy "
              f"process {beside[-1][0]:.3f} s/step ({beside[-1][1]:.0f} s)", flush=True)
    step_alone, step_beside = (statistics.median(x[0] for x in xs) for xs in (alone, beside))
    wall_alone, wall_beside = (statistics.median(x[1] for x in xs) for xs in (alone, beside))
    what = "torch's own threads" if a.fixed_threads else "threads fitted to the free cores"
    print(f"{what}: alone {step_alone:.3f} s/step, beside {step_beside:.3f} s/step; whole run {wall_alone:.0f} s "
          f"alone, {wall_beside:.0f} s beside ({wall_beside / wall_alone:.2f}x)")
    print(f"ratio = {step_beside / step_alone:.2f}x (fair share on {os.cpu_count()} cores with one busy neighbour: "
          f"{(os.cpu_count() or 1) / max(1, (os.cpu_count() or 1) - 1):.1f}x)")


if __name__ == "__main__":
    main()
