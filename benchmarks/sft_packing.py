"""Seconds per SFT optimizer step, packed against padded, on rows of long-tailed lengths.

    python benchmarks/sft_packing.py                       # 3 rounds, 64 rows, micro-batch 16, max_length 1024
    python benchmarks/sft_packing.py --rounds 1 --rows 32  # quick check
    python benchmarks/sft_packing.py --model path/to/hf_folder --threads 2

Each round runs `alignrl train sft` twice in fresh processes on the same rows, model and seed: once padded (each
micro-batch padded to its longest row) and once with `packing=true` (a micro-batch's rows laid end to end with
restarting position ids). Both train the same rows to the same loss and update (tests/test_train_sft.py holds them
equal), so the difference is the padding's compute. Row lengths are long-tailed, as chat data is: most rows are short,
a few are long, so a padded micro-batch is mostly padding. It prints each round's median s/step (the first step is
warm-up and left out) and forward tokens (padding included), the medians over rounds, and `ratio padded/packed =
X.XXx`, above 1 when packing is faster. Timings only mean something on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("the cat sat on a mat and then it ran off to see the dog who was barking at the moon over the hill "
         "while seven birds sang one two three four five six").split()


def write_rows(path: Path, n: int, seed: int) -> None:
    """`n` prompt-completion rows: 80% of a few words, 20% of a hundred or more (long-tailed lengths)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            k = rng.randint(80, 160) if rng.random() < 0.2 else rng.randint(3, 12)
            prompt = "Say: " + " ".join(rng.choice(WORDS) for _ in range(k))
            f.write(json.dumps({"prompt": prompt, "completion": " ".join(rng.choice(WORDS) for _ in range(k))}) + "\n")


def run(args, rows: Path, out: Path, packing: bool) -> tuple[float, int]:
    """(median s/step after the first, forward tokens) of one `alignrl train sft` run."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "alignrl.cli", "train", "sft", f"model_path={args.model}", f"train_files=[{rows}]",
           f"batch_size={args.batch}", "epochs=1", f"max_length={args.max_length}", f"packing={str(packing).lower()}",
           "log_every=1", "report_to=[jsonl]", "seed=1", "--output_dir", str(out / "model"), "--logging_dir",
           str(out / "logs")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"alignrl train sft failed ({'packed' if packing else 'padded'}): {done.stderr.strip()[-400:]}")
    steps = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = [s["train/s_per_step"] for s in steps if "train/s_per_step" in s][1:]
    tokens = json.loads((out / "model" / "eval_results.json").read_text())["forward_tokens"]
    return statistics.median(seconds), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="an HF folder, or 'demo' (the embedded tiny model)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="rows per micro-batch (one micro-batch per step)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[tuple[float, int]]] = {"padded": [], "packed": []}
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        write_rows(rows, args.rows, seed=0)
        for r in range(args.rounds):
            for name in ("padded", "packed"):  # alternating, so that a slow spell of the machine hits both
                results[name].append(run(args, rows, Path(tmp) / f"{name}{r}", name == "packed"))
            print(f"round {r + 1}: padded {results['padded'][-1][0]:.3f} s/step ({results['padded'][-1][1]} tokens), "
                  f"packed {results['packed'][-1][0]:.3f} s/step ({results['packed'][-1][1]} tokens)", flush=True)
    med = {k: statistics.median(s for s, _ in v) for k, v in results.items()}
    print(f"median s/step: padded {med['padded']:.3f}, packed {med['packed']:.3f}; forward tokens: padded "
          f"{results['padded'][0][1]}, packed {results['packed'][0][1]}")
    print(f"ratio padded/packed = {med['padded'] / med['packed']:.2f}x")


if __name__ == "__main__":
    main()
