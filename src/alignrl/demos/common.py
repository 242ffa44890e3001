"""What the demos' entry points (`alignrl demo search|vision|safe`) share: the check of the arguments their parser
leaves over, and the SIGTERM handler that lets their `finally` blocks run."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from alignrl.config import ConfigError


def check_overrides(prog: str, args: Sequence[str], takes: str) -> None:
    """Every one of `args` is a key=value override; the first that is not (an unknown flag, a bare word) is one
    ConfigError naming it and what `prog` takes."""
    bad = [a for a in args if a.startswith("-") or "=" not in a]
    if bad:
        raise ConfigError(f"unrecognized argument {bad[0]!r} ({prog} takes {takes})")


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def raise_on_sigterm() -> None:
    """From now on SIGTERM (a job scheduler, `kill`) raises SystemExit(128 + 15): Python's default ends the process
    without running `finally` blocks, and a demo's hold the cleanup (a server stopped by its PID, a build lock, temp
    folders)."""
    signal.signal(signal.SIGTERM, _terminate)
