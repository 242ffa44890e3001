"""`UserError`, the base of the exceptions that mean "the user's input is wrong" (a config, data file, model folder,
reward function, service, DeepSpeed config, a pipeline peer that is absent or speaks nonsense, a pipeline port that
is taken or unsafe to bind): every command line prints them as one line and exits 2, never a traceback. Also what
the entry points share about stopping (SIGTERM) and about saying errors in the flags the user typed. Imports only
the standard library, so that every module can define its errors on UserError."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

PROGRAM_ENV = "ALIGNRL_PROG"
# set by a launcher (run_distributed.py) for the processes it starts: on Ctrl-C it speaks for them all
LAUNCHER_ENV = "ALIGNRL_LAUNCHER"
# {config key: flag} of a seed script whose flags set those keys: its errors say `--max-steps 0`, not
# `trainer.total_training_steps=0` (inherited by the processes and ranks it starts)
FLAGS_ENV = "ALIGNRL_FLAG_NAMES"


class UserError(ValueError):
    """A mistake the user can fix: its text is one line that says what is wrong and how to fix it."""


class ConfigError(UserError):
    """A config file, key or value that cannot be used; the message names the key and the fix. Defined here, not
    in `config`, so that the process foundation below the config (`runtime`) raises it too."""


class DataError(UserError):
    """A dataset file is missing or malformed; the message says what to change. Defined here, not in `data`, so that
    naming a dataset (`data.sources`) needs no torch."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler) stopping a process that says why in one line, as for Ctrl-C."""


def stop_on_sigterm():
    """SIGTERM raises Terminated in the main thread (once; a second one while stopping is ignored). Returns the
    handler it replaced, for the caller to put back (None: nothing changed, as in another thread or under torchrun,
    whose agent's SIGTERM alignrl.runtime.env handles)."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    if threading.current_thread() is threading.main_thread() and "LOCAL_RANK" not in os.environ:
        return signal.signal(signal.SIGTERM, stop)
    return None


def in_flag_words(text: str, names: dict[str, str] | None = None) -> str:
    """`text` with the config keys of `names` (default: FLAGS_ENV's) said as the flags the user typed: `key=value`
    becomes `flag value`, a bare `key` the flag; a path that merely contains a key's text (`/d/model.path`) stays."""
    names = json.loads(os.environ.get(FLAGS_ENV) or "{}") if names is None else names
    for key in sorted(names, key=len, reverse=True):
        flag = names[key]
        text = re.sub(rf"(?<![\w./-]){re.escape(key)}=(\S+?)(?=[,;:.)]?(?:\s|$))", rf"{flag} \1", text)
        text = re.sub(rf"(?<![\w./-]){re.escape(key)}(?!\w|\.\w)", flag, text)  # "... set rollout.n." too
    return text


def program() -> str:
    """The command the user typed, for the front of every error line: `alignrl`, or a seed's script
    (training_worker.py) that runs alignrl in its own processes and torchrun ranks, which inherit the name."""
    return os.environ.get(PROGRAM_ENV, "alignrl")
