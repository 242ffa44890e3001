"""Errors as one line: the exit code of a user's mistake, an argparse whose errors skip the usage block, and the rule
that under torchrun only rank 0 says it (every rank meets the same bad input)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

USER_ERROR = 2  # the exit code of a one-line user error, on every command


def speak_once(line: str, code: int = USER_ERROR) -> int:
    """Prints a user error on rank 0 only (every rank of a launch meets the same bad input) and returns
    `code`. The other ranks wait quietly, so that rank 0 prints before torchrun stops them; torchrun's
    SIGTERM then ends them with the same code and without the "another rank failed" line."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
        return code
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
    time.sleep(2.0)
    return code


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`prog: error: ...`, exit 2) without the usage block, which
    buries the message; `--help` still shows the usage. Subparsers inherit the class."""

    def error(self, message: str):
        sys.exit(speak_once(f"{self.prog}: error: {message}"))
