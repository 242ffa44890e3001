"""The offline trainers' run log: console lines and metric sinks on rank 0 (`RankZeroLog`), and each optimizer step's
micro-batch metrics averaged over ranks into one row (`StepMetrics`), recorded before the step's checkpoint so a
TRL-layout checkpoint's trainer_state.json holds its own step."""

from __future__ import annotations

import time
from pathlib import Path

from alignrl.preference.configs import CommonConfig
from alignrl.train.checkpoint import hold_run_dir


class RankZeroLog:
    """Console lines and metric sinks on rank 0 only; the other ranks stay silent."""

    def __init__(self, env, log_dir: Path, sinks: list[str]):
        self.env, self.tracker, self.lock = env, None, None
        self.history: list[dict] = []  # {"step": N, **metrics} as recorded (rank 0), for TRL's trainer_state.json
        if env.is_main:
            from alignrl.utils.tracking import Tracker

            log_dir.mkdir(parents=True, exist_ok=True)
            # before the tracker sets an old run's metrics aside: a run still writing them (two runs of one task
            # share the default folder) would otherwise interleave its rows with this one's
            self.lock = hold_run_dir(log_dir, "another --logging_dir")
            self.tracker = Tracker(log_dir, list(sinks))  # a fresh run: an old run's curve is kept aside

    def print(self, text: str) -> None:
        if self.env.is_main:
            print(text, flush=True)

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.tracker is not None:
            self.tracker.log(step, metrics)
            if self.history and self.history[-1]["step"] == step:  # the step's training row, recorded before
                self.history[-1].update(metrics)
            else:
                self.history.append({"step": step, **metrics})

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """The step's training row, then its held-out measure, in the history before its checkpoint is written
        (`metrics` logs them after), so the checkpoint's trainer_state.json holds its own step, as transformers
        logs and evaluates before it saves."""
        if self.tracker is None or not metrics:
            return
        if self.history and self.history[-1]["step"] == step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": step, **metrics})


def fmt(metrics: dict[str, float], keys: dict[str, str]) -> str:
    return " ".join(f"{short} {metrics[k]:.4g}" for k, short in keys.items() if k in metrics)


def totals_per_count(metrics: dict[str, float]) -> dict[str, float]:
    """A metric given as `name_sum` and `name_count` (a mean over rows of one kind, which a micro-batch may lack)
    becomes `name`: the steps' total over their count, not a mean of micro-batch means (the two are averaged over
    the same micro-batches and ranks, so their ratio is exact); a kind no row had is left out."""
    out = {k: v for k, v in metrics.items() if not k.endswith(("_sum", "_count"))}
    for key, total in metrics.items():
        name = key.removesuffix("_sum")
        if key.endswith("_sum") and metrics.get(name + "_count", 0) > 0:
            out[name] = total / metrics[name + "_count"]
    return out


class StepMetrics:
    """Micro-batch metrics averaged per optimizer step, averaged over ranks every `log_every` steps
    (a collective: every rank calls `end_step` at the same steps), then printed and recorded."""

    def __init__(self, cfg: CommonConfig, env, log: RankZeroLog, total: int, console_keys: dict[str, str]):
        self.cfg, self.env, self.log, self.total, self.keys = cfg, env, log, total, console_keys
        self.micro: list[dict[str, float]] = []
        self.extra: dict[str, float] = {}  # step-level values, the same on every rank (λ after its update)
        self.row: dict[str, float] | None = None  # the step's training row at logged steps (close_step)
        self.logged_step, self.t = 0, time.time()

    def add(self, metrics: dict[str, float]) -> None:
        self.micro.append(metrics)

    def close_step(self, step: int, grad_norm: float, lr: float) -> None:
        """The optimizer step's training row, averaged over ranks (a collective) at logged steps and recorded before
        the step's checkpoint and held-out measure (`after_step`); `end_step` logs it with what those add."""
        from alignrl.runtime.env import mean_metrics

        self.row = None
        if step % self.cfg.log_every == 0 or step == self.total:
            m = {k: sum(d[k] for d in self.micro) / len(self.micro) for k in self.micro[0]}
            self.row = totals_per_count(mean_metrics(self.env, {**m, "grad_norm": grad_norm, "lr": lr}))
            self.log.record(step, self.row)

    def end_step(self, step: int, epoch: int) -> None:
        """The step's row with `extra` (the same on every rank: a held-out measure, λ after its update), logged."""
        if self.row is not None:  # the seconds count the step's checkpoint and held-out measure too
            m = {**self.row, **self.extra, "s_per_step": (time.time() - self.t) / (step - self.logged_step)}
            self.log.metrics(step, m)
            self.log.print(f"step {step}/{self.total} epoch {epoch + 1} " + fmt(m, {
                **self.keys, "grad_norm": "grad_norm", "lr": "lr", "s_per_step": "s/step"}))
            self.logged_step, self.t = step, time.time()
        elif held_out := {k: v for k, v in self.extra.items() if k.startswith("eval/")}:
            self.log.metrics(step, held_out)  # measured between logged steps (eval_steps apart from log_every)
            self.log.print(f"step {step}/{self.total} " + fmt(held_out, {k: k for k in held_out}))
        self.micro, self.extra = [], {}
