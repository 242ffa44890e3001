"""Progress of the phases that take more than a few seconds (held-out evaluation, pass@k, demo model builds,
retrieval index builds, checkpoint writes), in the style of the RL loop's bar.

On a terminal a phase shows a rich bar with its count and the time left. Elsewhere (a log file, a pipe, a notebook
capturing output) nothing moves: the phase prints one line when it ends, with its count and seconds, so a log
keeps one line per phase. Inside another live display (a periodic evaluation or a checkpoint write inside the RL
loop's bar) the phase's bar shows under that one (rich 14.1 and later nest live displays); where rich cannot nest
them, the phase prints its closing line instead, so no phase passes unseen.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from alignrl.utils.tracking import console as run_console


def bar_columns() -> list:
    """The columns of every bar of a run: what, bar, done/total, time left."""
    return [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn()]


class Phase:
    """One long phase: `with Phase("held-out evaluation", 200, "problems") as p: ... p.advance(50)`.

    `say`: print the closing line off a terminal (False where the caller prints its own line with the seconds);
    `bar`: show a bar on a terminal (a run's trainer.progress_bar)."""

    def __init__(self, description: str, total: int, unit: str = "", *, say: bool = True, bar: bool = True,
                 console: Console | None = None):
        self.description, self.total, self.unit, self.say = description, int(total), unit, say
        self.console = console or run_console
        self.show = bar and self.console.is_terminal
        self.done, self.seconds = 0, 0.0
        self._progress: Progress | None = None
        self._t0 = 0.0

    def __enter__(self) -> Phase:
        self._t0 = time.perf_counter()
        if self.show:
            progress = Progress(*bar_columns(), console=self.console, transient=False)
            try:
                progress.start()
            except LiveError:  # another bar is live and rich cannot nest: this phase says its closing line
                progress = None
            if progress is not None:
                self._task = progress.add_task(self.description, total=self.total)
                self._progress = progress
        return self

    def advance(self, n: int = 1) -> None:
        """`n` more items done (a callback for the phase's loop)."""
        self.done += n
        if self._progress is not None:
            self._progress.update(self._task, advance=n)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self._progress is not None:
            self._progress.stop()
        elif self.say and kind is None:  # no bar was shown (off a terminal, bars off, or none could start)
            unit = f" {self.unit}" if self.unit else ""
            self.console.print(f"{self.description}: {self.done}/{self.total}{unit} in {self.seconds:.1f}s",
                               markup=False, highlight=False)
