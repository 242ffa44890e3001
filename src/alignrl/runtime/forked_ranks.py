"""`--nproc` ranks forked from their launcher, which imported once what every rank imports.

A rank that torchrun starts as `python -u -m alignrl ...` spends 3.5-4 s of CPU importing torch, transformers and
alignrl before it does any work, and N ranks pay that N times. Here the launcher imports that code once and
freezes it (runtime.heap), and torchrun's own agent forks the ranks from it (its `fork` start method, which runs a
function as each rank): they share the launcher's pages until they write to them, and start at once.

A rank starts as the fresh process it replaces would: the launcher's signal handlers are put back to Python's
defaults, its output is written through as `python -u` writes it, the agent's quieted loggers speak again, and the
interpreter's exit callbacks run when the rank's command ends (a forked child leaves through `os._exit`, which
skips them).

Forking is safe only from a process that runs nothing but its main thread: a lock held by another thread stays
held in the child, and an OpenMP pool the parent has used is missing there (GNU OpenMP then hangs the child). The
launcher checks that before its agent starts (the agent's own rendezvous store thread is torch's to fork beside);
with any other thread running, or off Linux, the ranks start as their own interpreters, as torchrun starts them.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import runpy
import signal
import sys
import threading
import traceback

FORK_ENV = "ALIGNRL_FORK_RANKS"  # 0: every rank starts as its own interpreter
_quieted: dict[str, int] = {}  # logger name -> level before the agent quieted it, put back in each rank


def only_thread() -> bool:
    """This process runs its main thread alone (Linux's task list; off Linux: unknown, so no)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def preload(modules: tuple[str, ...]) -> bool:
    """Imports `modules` (what the ranks will run; the rest they import themselves), if the ranks can be forked
    from this process; returns whether they can."""
    if os.environ.get(FORK_ENV, "1") == "0" or not only_thread() or _gpu_build():
        return False
    for name in modules:
        importlib.import_module(name)
    return only_thread()  # an import that started a thread (none does today) rules the fork out


def _gpu_build() -> bool:
    """torch built for a GPU: CUDA's driver is not fork-safe once anything in the parent has touched it (even
    `torch.cuda.is_available()` initializes it), and the launcher cannot know whether something has, so a GPU
    build's ranks start as their own interpreters. Asked without touching the driver."""
    import torch

    return bool(torch.version.cuda or getattr(torch.version, "hip", None) or getattr(torch.version, "xpu", None))


def quiet(logger_names: list[str]) -> None:
    """The agent's loggers at CRITICAL in this process; each rank gets their levels back."""
    for name in logger_names:
        log = logging.getLogger(name)
        _quieted.setdefault(name, log.level)
        log.setLevel(logging.CRITICAL)


def launch(args) -> None:
    """torchrun's `run(args)` for a `-m module` command whose ranks are forked from this process."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=rank)(args.training_script, *args.training_script_args)


def rank(module: str, *argv: str) -> None:
    """One rank: `python -u -m module argv` run in this forked process. A non-zero exit leaves as SystemExit (the
    agent reads the exit code); a zero one returns, as torchrun's function ranks must."""
    _as_a_fresh_process()
    sys.argv = [module, *argv]
    if not sys.flags.safe_path:  # `python -m` puts the working folder first, where the launcher had its own
        sys.path[0] = os.getcwd()
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # as the interpreter would at exit: the traceback on stderr, exit code 1
        traceback.print_exc()
        code = 1
    finally:  # an interpreter's exit, in its order: non-daemon threads joined, then the exit callbacks
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        raise SystemExit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _as_a_fresh_process() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    for name, level in _quieted.items():
        logging.getLogger(name).setLevel(level)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
