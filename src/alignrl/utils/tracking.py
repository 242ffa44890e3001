"""Metric sinks: console (rich), JSONL and TensorBoard, plus the end-of-run PNG.

`metrics.jsonl` is append-only during a run; on resume, lines past the checkpoint's step are
dropped (rewritten atomically) so a resumed run never shows the same step twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from alignrl.train.checkpoint import atomic_write_text

console = Console(highlight=False)

_CONSOLE_KEYS = {"reward/mean": "reward", "reward/accuracy": "acc", "val/accuracy": "val_acc",
                 "actor/kl_loss": "kl", "actor/entropy": "entropy", "actor/clipfrac": "clipfrac",
                 "response/length_mean": "len", "perf/tokens_per_s": "tok/s", "timing/step": "s/step"}


class Tracker:
    def __init__(self, log_dir: Path, sinks: list[str], resume_step: int = 0, write: bool = True):
        """`write=False` (ranks other than 0) keeps history in memory and touches no file."""
        self.log_dir = log_dir
        self.sinks = set(sinks) if write else set()
        self.jsonl = log_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if write:
            log_dir.mkdir(parents=True, exist_ok=True)
        if write and self.jsonl.exists():
            kept = [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]
            self.history = [r for r in kept if r.get("step", 0) <= resume_step]
            atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in self.history))
        self.tb = None
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(log_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        if "jsonl" in self.sinks:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if "console" in self.sinks:
            shown = "  ".join(f"{name}={metrics[k]:.4g}" for k, name in _CONSOLE_KEYS.items() if k in metrics)
            console.print(f"[bold]step {step}[/bold]  {shown}")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()

    def plot(self, path: Path) -> None:
        """Reward mean and held-out accuracy over steps, as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label, style in (("reward/mean", "train reward (mean)", "-"),
                                  ("val/accuracy", "held-out accuracy (greedy, task reward)", "o-"),
                                  ("val/accuracy_flexible", "held-out, last-number extraction", "s--")):
            pts = [(r["step"], r[key]) for r in self.history if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(path)
