"""Metric sinks: console (rich), JSONL, TensorBoard and wandb, plus the end-of-run PNG.

`metrics.jsonl` is append-only during a run; on resume, lines past the checkpoint's step are
dropped (rewritten atomically) so a resumed run never shows the same step twice, and a fresh start
begins an empty file. Whatever is dropped is first kept aside, whole, as `metrics.<time>.jsonl`; so is a
line a killed run left torn. A fresh start also moves an earlier run's TensorBoard events aside and
begins a wandb run of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any

from rich.console import Console

from alignrl.errors import ConfigError
from alignrl.utils.atomic import atomic_write_text

# soft_wrap: a long warning stays one line in a log file or pipe (rich would fold it at 80 columns there)
console = Console(highlight=False, soft_wrap=True)

_CONSOLE_KEYS = {"reward/mean": "reward", "reward/accuracy": "acc", "val/accuracy": "val_acc",
                 "actor/kl_loss": "kl", "actor/entropy": "entropy", "actor/clipfrac": "clipfrac",
                 "response/length_mean": "len", "perf/tokens_per_s": "tok/s", "timing/step": "s/step"}


WANDB_STEP = "train/global_step"  # the x-axis of every wandb chart (transformers' and TRL's name for it)


def aside(path: Path) -> Path:
    """Where to keep an earlier `path` (metrics.jsonl, prompts.jsonl, tensorboard): path's name with the time
    before its suffix, never an existing one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    new, n = path.with_name(f"{path.stem}.{stamp}{path.suffix}"), 1
    while new.exists():
        n += 1
        new = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    return new


def keep_aside(log_dir: Path, text: str) -> None:
    """`text` (an earlier metrics.jsonl) saved whole as metrics.<time>.jsonl, never over another one."""
    atomic_write_text(aside(log_dir / "metrics.jsonl"), text)


def json_rows(text: str) -> list[dict]:
    """The JSON object lines of a log; a line a kill left torn (or any other that is not one) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def json_line(record: dict[str, Any]) -> str:
    """One metrics row as strict JSON: a non-finite value (a diverged loss) is null, as jq, pandas and other
    languages' parsers refuse the bare NaN that json.dumps writes."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in record.items()}) + "\n"


class Tracker:
    def __init__(self, log_dir: Path, sinks: list[str], resume_step: int = 0, write: bool = True,
                 project: str | None = None, run_name: str | None = None, config: Any = None,
                 tensorboard_dir: Path | None = None):
        """`write=False` (ranks other than 0) keeps history in memory and touches no file. `project` (default:
        WANDB_PROJECT, else alignrl, as an offline trainer's `report_to` wandb has no setting of its own), `run_name`
        (default: WANDB_NAME, else the logging folder's name, logs/training/<the output folder's name> for the offline
        trainers) and `config` (a dict or the run's config dataclass) label the wandb run. TensorBoard events go to
        `tensorboard_dir` (default: `log_dir/tensorboard`)."""
        self.log_dir = log_dir
        self.sinks = set(sinks) if write else set()
        self.jsonl = log_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if write:
            log_dir.mkdir(parents=True, exist_ok=True)
        if write and self.jsonl.exists():
            text = self.jsonl.read_text()
            kept = json_rows(text)
            # a fresh start (resume_step 0) logs its own step 0: the old run's rows all go
            self.history = [r for r in kept if r.get("step", 0) <= resume_step] if resume_step else []
            if len(self.history) < sum(1 for x in text.splitlines() if x.strip()):  # steps again, a run, torn lines
                keep_aside(log_dir, text)
            atomic_write_text(self.jsonl, "".join(json_line(r) for r in self.history))
        self.tb = None
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            events = tensorboard_dir or log_dir / "tensorboard"
            if not resume_step and events.is_dir():  # TensorBoard would plot both runs as one
                events.rename(aside(events))
            events.parent.mkdir(parents=True, exist_ok=True)
            self.tb = SummaryWriter(str(events), purge_step=resume_step + 1 if resume_step else None)
        self.wandb, self.tables = None, {}
        if "wandb" in self.sinks:
            self.wandb = start_wandb(log_dir, project or os.environ.get("WANDB_PROJECT") or "alignrl",
                                     run_name or os.environ.get("WANDB_NAME") or log_dir.name, config,
                                     resume=resume_step > 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        if "jsonl" in self.sinks:
            with self.jsonl.open("a") as f:
                f.write(json_line(record))
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:  # the step as a value, not wandb's own step: see start_wandb
            self.wandb.log({**metrics, WANDB_STEP: step})
        if "console" in self.sinks:
            shown = "  ".join(f"{name}={metrics[k]:.4g}" for k, name in _CONSOLE_KEYS.items() if k in metrics)
            console.print(f"[bold]step {step}[/bold]  {shown}")

    def log_table(self, name: str, step: int, rows: list[list[Any]]) -> None:
        """(input, output, score) rows of one step: TensorBoard text, and a wandb table growing one row a step
        (verl's columns: step, input_1, output_1, score_1, ...)."""
        if self.tb is not None:
            text = "\n\n".join(f"**input:** {i}\n\n**output:** {o}\n\n**score:** {sc:g}" for i, o, sc in rows)
            self.tb.add_text(name, text, step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            columns = ["step"] + [f"{part}_{k + 1}" for k in range(len(rows)) for part in ("input", "output", "score")]
            earlier = self.tables.get(name)
            table = wandb.Table(columns=columns, data=earlier.data if earlier is not None and
                                earlier.columns == columns else [])
            table.add_data(step, *[x for row in rows for x in row])
            self.tables[name] = table
            self.wandb.log({name: table, WANDB_STEP: step})

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            # finish() returns before the service has written the run's file; teardown waits for it,
            # so a run folder copied or synced right after close is complete
            wandb.teardown()
            self.wandb = None

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
        if ax.get_legend_handles_labels()[0]:  # a run resumed at its last step has no curve to name
            ax.legend()
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(path)


def wandb_mode() -> str:
    """WANDB_MODE when set; else offline without an API key or without a route to the wandb server
    (a run on an air-gapped cluster must not hang or fail at its first log), else online."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in _netrc_text()
    if not has_key:
        return "offline"
    url = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((url.hostname or "api.wandb.ai", url.port or 443), timeout=3).close()
    except (OSError, ValueError):
        return "offline"
    return "online"


def _netrc_text() -> str:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.read_text()
    except OSError:
        return ""


def start_wandb(log_dir: Path, project: str, run_name: str, config: Any, resume: bool = False) -> Any:
    """A wandb run writing under `log_dir/wandb`; its id is kept in `log_dir` so a resumed run continues
    the same wandb run, and a fresh start makes a new one. Every metric is plotted against `WANDB_STEP`,
    logged as a value beside it, while wandb's own step just counts rows: wandb drops a row whose own step
    is below the highest it has, so a run resumed from a checkpoint before a crash lost the steps between the
    two (they are logged again; the crashed run's rows of those steps stay too, as in TensorBoard's purge).
    Offline runs are uploaded later with `wandb sync <log_dir>/wandb/offline-run-*`."""
    import wandb

    id_file = log_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    mode = wandb_mode()
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    try:
        run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(log_dir), mode=mode,
                         config=config, settings=wandb.Settings(console="off", silent=True))
    except Exception as e:  # wandb raises its own error types for a bad key, project or server
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"wandb could not start in {mode} mode ({first[:160]}); set WANDB_MODE=offline, fix "
                          "WANDB_API_KEY, or drop wandb from the sinks (trainer.logger; the offline trainers' "
                          "report_to)") from None
    run.define_metric(WANDB_STEP)
    run.define_metric("*", step_metric=WANDB_STEP)
    if mode == "offline":
        console.print(f"wandb: offline run in {log_dir / 'wandb'} (upload with `wandb sync`)")
    return run
