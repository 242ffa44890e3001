#!/usr/bin/env python
"""A process's start-up and exit seconds, with and without alignrl's handling of the garbage collector.

    python benchmarks/process_exit.py [--rounds 5]

Every rank, sampler, service and command of a run is a Python process that imports torch and transformers and
builds a model (about half a million objects). CPython's full collections walk them all while they are created and
again at exit. Each round starts three such processes, interleaved: `plain` (Python's collector as it is);
`exit freeze` (alignrl imported: the exit's collections are skipped, alignrl/__init__.py); `entry point` (also
`runtime.heap.starting()` first and `settled()` once the model is built, as an alignrl command's process does). Each
prints the time it finished its work and exits; the parent takes the time it saw the process end. Prints each
configuration's median exit seconds and whole-process seconds, and `ratio = X.XXx` (plain / entry point, the whole
process).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

WORK = """
import time
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
{settled}
print(time.time(), flush=True)
"""
FIRST = {"plain": ("import gc", ""), "exit freeze": ("import alignrl", ""),
         "entry point": ("from alignrl.runtime import heap; heap.starting()", "heap.settled()")}


def one(name: str) -> tuple[float, float]:
    """(exit seconds, whole seconds) of one process."""
    first, last = FIRST[name]
    start = time.time()
    out = subprocess.run([sys.executable, "-c", first + WORK.format(settled=last)], capture_output=True, text=True,
                         check=True)
    end = time.time()
    done = float(out.stdout.strip().splitlines()[-1])
    return end - done, end - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in FIRST}
    for _ in range(args.rounds):
        for name in FIRST:
            runs[name].append(one(name))
    med = {k: (statistics.median(e for e, _ in v), statistics.median(w for _, w in v)) for k, v in runs.items()}
    for name, (exit_s, whole_s) in med.items():
        print(f"{name:11s} exit {exit_s:.2f} s, whole process {whole_s:.2f} s "
              f"(rounds {', '.join(f'{w:.2f}' for _, w in runs[name])})")
    print(f"ratio = {med['plain'][1] / med['entry point'][1]:.2f}x (whole process, plain / entry point); "
          f"exit {med['plain'][0]:.2f} s -> {med['entry point'][0]:.2f} s")


if __name__ == "__main__":
    main()
