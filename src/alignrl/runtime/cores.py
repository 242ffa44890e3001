"""How many compute threads a process should use: the cores it may run on (affinity, a cgroup quota), less what
other processes keep busy there now, shared among the alignrl processes of one machine.

torch starts one OpenMP thread per core. Beside one busy neighbour on a 2-core machine, two threads fight it for
the cores at every parallel region and a step can take many times longer; one thread takes about twice as long,
which is the fair share. So the thread count comes from the cores that are free. The wait policy stays libgomp's
default (spin briefly, then sleep): with the count fitted, a forced passive policy only slowed an idle machine's
step by about half (benchmarks/neighbour.py).

A count the user gave wins: `trainer.threads`, else OMP_NUM_THREADS. ALIGNRL_IGNORE_LOAD=1 leaves other
processes' load out of the choice, so a run's thread count (and its float sums) do not depend on what else runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

IGNORE_LOAD_ENV = "ALIGNRL_IGNORE_LOAD"


def affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cores a cgroup CPU quota allows (cgroup v2 cpu.max, or v1's cfs quota / period); None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    cores = len(affinity())
    quota = quota_cores()
    return max(1, min(cores, int(quota)) if quota is not None else cores)


def _busy_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cpus` since boot, from /proc/stat's per-core lines."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _own_ticks() -> int:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime of all this process's threads


def _load_sample() -> tuple[int, int, int] | None:
    """(busy, total) ticks of this process's cores and its own ticks, now; None where /proc is absent."""
    try:
        return (*_busy_ticks(affinity()), _own_ticks())
    except (OSError, ValueError, IndexError):
        return None


def _busy_between(before, after) -> float | None:
    """Cores other processes kept busy between two `_load_sample`s (None when either is missing or no time passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, (after[0] - before[0]) - (after[2] - before[2])) / (after[1] - before[1]) * len(affinity())


def busy_elsewhere(window_s: float = 0.3) -> float:
    """Cores that other processes kept busy on this process's cores over `window_s` (0.0 where /proc is absent)."""
    before = _load_sample()
    time.sleep(window_s)
    busy = _busy_between(before, _load_sample())
    return 0.0 if busy is None else busy


def fair_threads(usable: int, busy: float, sharing: int) -> int:
    """Threads for each of `sharing` processes on `usable` cores of which `busy` are taken by others: the free cores
    split evenly, at least one each. A core counts as taken once it is more than a quarter busy."""
    taken = int(busy + 0.75)
    return max(1, (usable - min(taken, usable - 1)) // max(1, sharing))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str
    measured: bool = False  # chosen from the machine's load (not given by the user): worth re-checking as it changes

    def line(self) -> str:
        return f"threads: {self.threads} per process ({self.why})"


def choose_threads(requested: int = 0, sharing: int = 1) -> ThreadChoice:
    """The thread count of one of `sharing` alignrl processes on this machine (see the module's text)."""
    if requested > 0:
        return ThreadChoice(requested, "trainer.threads")
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return ThreadChoice(int(given), "OMP_NUM_THREADS")
    usable = usable_cores()
    busy = 0.0 if os.environ.get(IGNORE_LOAD_ENV) == "1" else busy_elsewhere()
    threads = fair_threads(usable, busy, sharing)
    share = f", shared by {sharing} alignrl processes" if sharing > 1 else ""
    return ThreadChoice(threads, f"{usable} usable cores, {busy:.1f} busy with other processes{share}",
                        measured=os.environ.get(IGNORE_LOAD_ENV) != "1")


def fit_threads(requested: int = 0, sharing: int = 1) -> ThreadChoice:
    """Sets this process's torch intra-op threads to `choose_threads`; returns the choice to announce."""
    import torch

    choice = choose_threads(requested, sharing)
    torch.set_num_threads(choice.threads)
    return choice


class LoadWatch:
    """Re-fits a lone process's threads between steps when other processes start or stop on its cores: the load
    is read over the time since the last check (no sleep), so a neighbour that arrives mid-run takes its core
    back within a step. A count the user gave, or a run that ignores the load, is left alone."""

    def __init__(self, choice: ThreadChoice, sharing: int = 1):
        self.threads, self.sharing, self.active = choice.threads, sharing, choice.measured
        self._last = _load_sample() if self.active else None

    def check(self) -> ThreadChoice | None:
        """The new choice when it changed (torch's pool already resized), else None."""
        now = _load_sample() if self.active else None
        busy, self._last = _busy_between(self._last, now), now
        if busy is None:
            return None
        threads = fair_threads(usable_cores(), busy, self.sharing)
        if threads == self.threads:
            return None
        import torch

        self.threads = threads
        torch.set_num_threads(threads)
        return ThreadChoice(threads, f"now {busy:.1f} cores busy with other processes", measured=True)
