#!/usr/bin/env python
"""CPU and wall seconds of a 2-rank `alignrl train grpo --nproc 2` whose ranks are forked from the launcher, against
the same launch with each rank started as its own interpreter (`ALIGNRL_FORK_RANKS=0`, as torchrun starts them).

    python benchmarks/forked_ranks.py [--rounds 5] [--steps 2]

Each launch trains a tiny random model for `--steps` GRPO steps on two gloo ranks, one thread each; the two kinds
alternate within a round, so a slower stretch of the machine falls on both. CPU is the launch's whole process tree
(launcher, agent and ranks: user + system, from the kernel's accounting of waited-for children). Prints each kind's
median CPU and wall seconds and `ratio = X.XXx` (own interpreters / forked, CPU).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return len(solution_str) % 3 / 2\n")


def command(model: Path, work: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "alignrl", "train", "grpo", "--nproc", "2", f"model.path={model}",
            "data.train_size=64", "data.val_size=8", "data.val_size_during_training=8", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "rollout.n=4", "rollout.max_new_tokens=6",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.save_freq=0",
            f"trainer.output_dir={work / 'out'}", "trainer.progress_bar=false",
            f"algorithm.reward_fn={work / 'reward.py'}:compute_score"]


def one_launch(cmd: list[str], fork: bool) -> tuple[float, float]:
    """(CPU seconds of the launch's process tree, wall seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_FORK_RANKS": "1" if fork else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"forked_ranks.py: the launch failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    from alignrl.models.tiny import TinyRecipe, build_demo_model

    with tempfile.TemporaryDirectory(prefix="alignrl-forked-ranks-") as tmp:
        work = Path(tmp)
        (work / "reward.py").write_text(REWARD)
        recipe = TinyRecipe(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, tokenizer_corpus=500, sft_steps=0)
        model = build_demo_model(work / "model", recipe, log=lambda *_: None)
        cmd = command(model, work, args.steps)
        one_launch(cmd, True)  # first-use caches (bytecode, the page cache) out of the count
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(args.rounds):
            for fork in ((True, False) if r % 2 == 0 else (False, True)):
                runs[fork].append(one_launch(cmd, fork))
                cpu, wall = runs[fork][-1]
                print(f"round {r + 1}: {'forked' if fork else 'own interpreters'}: {cpu:.2f} s CPU, {wall:.2f} s wall")
    med = {fork: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for fork, v in runs.items()}
    for fork, name in ((True, "forked ranks"), (False, "own interpreters")):
        print(f"{name:>16}: median {med[fork][0]:.2f} s CPU, {med[fork][1]:.2f} s wall")
    print(f"wall ratio = {med[False][1] / med[True][1]:.2f}x")
    print(f"ratio = {med[False][0] / med[True][0]:.2f}x")


if __name__ == "__main__":
    main()
