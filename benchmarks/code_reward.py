"""The code reward's throughput: responses scored per second, their programs run locally (`LocalRunner`) and on
`alignrl serve sandbox` (started here on loopback), in one run, with the ratio of the two.

    python benchmarks/code_reward.py                 # 32 responses x 10 stdin cases, 3 rounds
    python benchmarks/code_reward.py --responses 8 --rounds 1   # a smoke run

Each response is a short program that reads two numbers and prints their sum; half of them are right, a quarter
wrong, a quarter crash, so the pass rates vary as in training. Both ways run `--concurrent` cases of a response at
once (the code reward's sandbox.max_concurrent); the service runs `--workers` programs at once. Each round times both
ways, interleaved (this machine's speed drifts); the table shows each way's median round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a - b)",
            "a, b = map(int, input().split())\nprint(a + b)", "print(undefined_name)")


def workload(n: int, cases: int) -> list[tuple[str, str]]:
    truth = json.dumps({"inputs": [f"{i} {i + 1}\n" for i in range(cases)],
                        "outputs": [f"{2 * i + 1}\n" for i in range(cases)]})
    return [(f"```python\n{PROGRAMS[i % len(PROGRAMS)]}\n```", truth) for i in range(n)]


def score_all(reward, rows) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = [reward(text, truth) for text, truth in rows]
    return time.perf_counter() - start, scores


def start_sandbox(workers: int, folder: Path) -> tuple[subprocess.Popen, str]:
    out = (folder / "sandbox.out").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "sandbox", "--port", "0", "--workers",
                             str(workers)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (m := re.search(r"ready on (http://127\.0\.0\.1:\d+/run_code)", (folder / "sandbox.out").read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"the sandbox service did not start: {(folder / 'sandbox.out').read_text()[-1000:]}")
        time.sleep(0.1)
    return proc, m.group(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", type=int, default=32)
    p.add_argument("--cases", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--concurrent", type=int, default=cores, help="cases of one response at once")
    p.add_argument("--workers", type=int, default=cores, help="the service's programs at once")
    args = p.parse_args()

    from alignrl.rewards.code import CodeReward, CodeSettings
    from alignrl.rewards.code_exec import LocalRunner
    from alignrl.rewards.sandbox_client import SandboxClient

    rows = workload(args.responses, args.cases)
    settings = CodeSettings(timeout_s=10.0, memory_mb=1024, max_concurrent=args.concurrent)
    with tempfile.TemporaryDirectory(prefix="alignrl-code-bench-") as tmp:
        proc, url = start_sandbox(args.workers, Path(tmp))
        try:
            ways = {"local": CodeReward(LocalRunner(), settings), "sandbox service": CodeReward(SandboxClient(url),
                                                                                                settings)}
            times: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.rounds):
                for name, reward in ways.items():
                    seconds, scores = score_all(reward, rows)
                    times[name].append(seconds)
                    print(f"round {r + 1} {name}: {seconds:.2f} s, mean pass rate {statistics.mean(scores):.3f}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"\n{args.responses} responses x {args.cases} cases, {args.concurrent} cases at once, "
          f"{args.workers} service workers, {cores} cores")
    print("| way | median s | responses/s | programs/s |\n|---|---|---|---|")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, m in medians.items():
        print(f"| {name} | {m:.2f} | {args.responses / m:.1f} | {args.responses * args.cases / m:.1f} |")
    print(f"ratio service/local = {medians['sandbox service'] / medians['local']:.2f}x (time)")


if __name__ == "__main__":
    main()
