"""Seconds to score a batch of math answers with the rule reward in the trainer's process against the same rule
under a time limit (algorithm.reward_timeout_s: rows side by side in worker processes from a fork server), in one run.

    python benchmarks/timed_rewards.py                 # 512 rows, 5 rounds, 2 workers
    python benchmarks/timed_rewards.py --rows 2048 --workers 4 --stall 2

`--stall N` makes N rows of each batch never return (a rule stuck on an odd response): in-process such a batch never
ends, so only the timed side runs it, and its seconds show what each stuck row costs (the limit, `--limit`, over the
workers). Prints the median seconds of each side and `ratio timed/in-process = X.XXx` (above 1: the workers cost
more than they save; the first timed round, which starts the fork server, is left out).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

from alignrl.config import load_config
from alignrl.data.records import Sample
from alignrl.rewards.registry import run_rule
from alignrl.rewards.timed_rules import late_rows, timed
from alignrl.rl.scoring import rule_scores

STALL = '''
import time

from alignrl.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("stall"):
        time.sleep(3600)  # a rule that never returns on this response
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def batch(rows: int, stall: int, round_: int) -> tuple[list[Sample], list[str]]:
    """Math answers, right and wrong, \\boxed{} and '#### N', different each round (nothing is remembered)."""
    samples, texts = [], []
    for i in range(rows):
        answer = 17 * i + round_
        samples.append(Sample(f"q{i}", str(answer), "openai/gsm8k" if i % 2 else "lighteval/MATH", {}))
        text = f"so the total is #### {answer + i % 3}" if i % 2 else f"hence $\\boxed{{{answer + i % 3}}}$"
        texts.append(f"stall {i}" if i < stall else text)
    return samples, texts


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=float, default=1.0, help="algorithm.reward_timeout_s")
    p.add_argument("--stall", type=int, default=0, help="rows of each batch that never return")
    args = p.parse_args()
    rule_file = Path("/tmp") / "alignrl_bench_stalling_rule.py"
    rule_file.write_text(STALL)
    cfg = load_config(None, [f"algorithm.reward_fn={rule_file}:compute_score",
                             f"algorithm.reward_timeout_s={args.limit}", f"algorithm.reward_workers={args.workers}"])
    plain = run_rule(cfg, "reward")
    limited = timed(plain, functools.partial(run_rule, cfg, "reward"), args.limit, args.workers)
    here, there = [], []
    for r in range(args.rounds + 1):
        samples, texts = batch(args.rows, args.stall, r)
        if not args.stall:
            t0 = time.perf_counter()
            expected = rule_scores(plain, "reward function", samples, texts)
            here.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = rule_scores(limited, "reward function", samples, texts)
        there.append(time.perf_counter() - t0)
        if not args.stall and got != expected:
            print("MISMATCH: the workers scored otherwise", file=sys.stderr)
            return 1
        print(f"round {r}: in-process {here[-1] if here else float('nan'):.3f} s, timed {there[-1]:.3f} s, "
              f"rows past the limit {late_rows([limited])}", flush=True)
    timed_s = statistics.median(there[1:])
    print(f"median timed {timed_s:.3f} s for {args.rows} rows ({args.workers} workers, {args.stall} stuck)")
    if here:
        here_s = statistics.median(here[1:])
        print(f"median in-process {here_s:.3f} s\nratio timed/in-process = {timed_s / here_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
