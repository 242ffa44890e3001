#!/usr/bin/env python
"""The demo's GRPO step alone and beside one busy process (a neighbour spinning on one core), in one run.

    python benchmarks/neighbour.py [--steps 8] [--rounds 2] [--fixed-threads]

Each round runs `alignrl demo` for `--steps` steps (no evaluation, no checkpoints) twice: alone, then with a
CPU-bound neighbour process. The step time is the median `timing/step` of the run's metrics.jsonl, the first two
steps left out (warm-up). Prints both medians and `ratio = X.XXx` (beside / alone). On a 2-core machine the fair
share is 2.0x: the neighbour takes one core of two. `--fixed-threads` gives each run torch's own thread count and
spinning waits (OMP_NUM_THREADS = all cores, OMP_WAIT_POLICY=ACTIVE): what a run did before it sized its threads
from the free cores, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def demo_step_seconds(steps: int, neighbour: bool, fixed_threads: bool) -> float:
    out = Path(tempfile.mkdtemp(prefix="neighbour-"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ALIGNRL_IGNORE_LOAD")}
    if fixed_threads:
        env.update(OMP_NUM_THREADS=str(os.cpu_count() or 1), OMP_WAIT_POLICY="ACTIVE")
    cmd = [sys.executable, "-m", "alignrl", "demo", f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
           "trainer.save_freq=0", "trainer.eval_pass_at_k=false", "trainer.progress_bar=false", "data.val_size=8",
           "trainer.logger=[jsonl]", f"trainer.output_dir={out}", "trainer.experiment_name=run"]
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    try:
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    rows = [json.loads(line) for line in (out / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    times = [r["timing/step"] for r in rows if "timing/step" in r][2:]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fixed-threads", action="store_true")
    a = p.parse_args()
    alone, beside = [], []
    for r in range(a.rounds):
        alone.append(demo_step_seconds(a.steps, False, a.fixed_threads))
        beside.append(demo_step_seconds(a.steps, True, a.fixed_threads))
        print(f"round {r + 1}: alone {alone[-1]:.3f} s/step, beside a busy process {beside[-1]:.3f} s/step", flush=True)
    m_alone, m_beside = statistics.median(alone), statistics.median(beside)
    what = "torch's own threads, spinning waits" if a.fixed_threads else "threads fitted to the free cores"
    print(f"{what}: alone {m_alone:.3f} s/step, beside {m_beside:.3f} s/step")
    print(f"ratio = {m_beside / m_alone:.2f}x (fair share on {os.cpu_count()} cores with one busy neighbour: "
          f"{(os.cpu_count() or 1) / max(1, (os.cpu_count() or 1) - 1):.1f}x)")


if __name__ == "__main__":
    main()
