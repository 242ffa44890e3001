"""Host memory of loading a model sharded over ranks: read by rows against loaded whole, then sharded.

```bash
python benchmarks/sharded_load.py                  # a random ~240M-parameter Qwen2 saved in bf16, 2 gloo ranks
python benchmarks/sharded_load.py --model path/to/hf_folder --nproc 4
```

Each way and load dtype runs as its own `torchrun` launch: every rank builds the FSDP2-sharded frozen model as the
sharded reference group does (`alignrl.placements.sharded_ref`), in the weights' own dtype (bf16) and in fp32 (the CPU
default, a converted copy), and reports the peak of its private (anonymous) resident memory above what it held
before the load, sampled every 5 ms, and its peak resident set (VmHWM, which also counts the pages of the weight
files it touched: page cache, shared by the ranks of a node), the seconds the load took and the share of the
weights it holds. Printed: one row per way, dtype and rank, and per dtype the ratio of the largest private peaks
(whole / by rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def build_model(out: Path, tokenizer_from: Path) -> Path:
    """A random ~240M-parameter Qwen2, saved in bf16 as checkpoints are shared."""
    import torch
    from serve_bench import random_qwen2

    return random_qwen2(tokenizer_from, out, hidden=1024, intermediate=2816, layers=16, heads=16, dtype=torch.bfloat16)


def status_mib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


class AnonPeak:
    """The largest RssAnon seen while it runs (the kernel keeps a high-water mark of the whole resident set only)."""

    def __init__(self):
        self.peak, self.stop = status_mib("RssAnon"), threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, status_mib("RssAnon"))

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return max(self.peak, status_mib("RssAnon"))


def rank_main(way: str, dtype: str, model: str, out: str) -> None:
    """One rank: the sharded frozen model, by rows or loaded whole then sharded; its peak memory to `out`."""
    from alignrl.runtime.env import barrier, init_distributed
    from alignrl.models.sharded_load import held_elements
    from alignrl.models.loader import DTYPES, load_model
    from alignrl.models.sharded_load import load_sharded
    from alignrl.train.engines.fsdp2 import shard_blocks

    env = init_distributed("cpu")
    barrier(env)
    anon0, hwm0 = status_mib("RssAnon"), status_mib("VmHWM")
    sampler = AnonPeak()
    t0 = time.perf_counter()

    def shard(m) -> None:
        shard_blocks(m, env, reshard_after_forward=True)

    if way == "rows":
        m = load_sharded(Path(model), DTYPES[dtype], env.device, shard)
        assert m is not None, "the folder cannot be read by rows"
    else:
        m = load_model(model, dtype, log=lambda *_: None)[0]
        m.eval()
        m.requires_grad_(False)
        shard(m)
    seconds = time.perf_counter() - t0
    anon = sampler.done()
    with open(f"{out}.{env.rank}.json", "w") as f:
        json.dump({"rank": env.rank, "anon_mib": anon - anon0, "hwm_mib": status_mib("VmHWM") - hwm0,
                   "seconds": seconds, "held": held_elements(m), "total": sum(p.numel() for p in m.parameters())}, f)
    barrier(env)


def launch(way: str, dtype: str, model: Path, nproc: int, out: Path) -> list[dict]:
    from alignrl.runtime.ports import free_port

    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", __file__, "--rank", way, "--dtype", dtype, "--model", str(model),
           "--out", str(out / f"{way}-{dtype}")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{way}: torchrun exited {done.returncode}\n{done.stderr[-3000:]}")
    return [json.loads((out / f"{way}-{dtype}.{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder of safetensors weights (default: a random ~240M Qwen2)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rank", choices=("rows", "whole"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, SRC)
    if a.rank:
        return rank_main(a.rank, a.dtype, a.model, a.out)
    from alignrl.models.tiny import ensure_demo_model

    with tempfile.TemporaryDirectory(prefix="alignrl-sharded-load-") as tmp:
        t0 = time.perf_counter()
        model = Path(a.model) if a.model else build_model(Path(tmp) / "model", ensure_demo_model())
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        print(f"model {model if a.model else 'random Qwen2'}: {size / 2**20:.0f} MiB of safetensors "
              f"({time.perf_counter() - t0:.0f} s to get); {a.nproc} gloo ranks")
        rows = {(way, dtype): launch(way, dtype, model, a.nproc, Path(tmp))
                for dtype in ("bfloat16", "float32") for way in ("whole", "rows")}
    print(f"{'way':<7}{'dtype':>10}{'rank':>5}{'private peak MiB':>18}{'VmHWM MiB':>11}{'load s':>8}{'held':>8}")
    for (way, dtype), ranks in rows.items():
        for r in ranks:
            print(f"{way:<7}{dtype:>10}{r['rank']:>5}{r['anon_mib']:>18.0f}{r['hwm_mib']:>11.0f}{r['seconds']:>8.2f}"
                  f"{r['held'] / r['total']:>8.1%}")
    for dtype in ("bfloat16", "float32"):
        whole, by_rows = (max(r["anon_mib"] for r in rows[(w, dtype)]) for w in ("whole", "rows"))
        print(f"{dtype}: largest private peak of a rank: whole {whole:.0f} MiB, by rows {by_rows:.0f} MiB -> "
              f"whole / by rows = {whole / max(by_rows, 1):.2f}x")


if __name__ == "__main__":
    main()
