"""`--nproc` ranks forked from their launcher, which imported once what every rank imports.

A rank that torchrun starts as `python -u -m alignrl ...` spends 3.5-4 s of CPU importing torch, transformers and
alignrl before it does any work, and N ranks pay that N times. Here the launcher imports that code once and
freezes it (runtime.heap), and torchrun's own agent forks the ranks from it (its `fork` start method, which runs a
function as each rank): they share the launcher's pages until they write to them, and start at once.

A rank starts as the fresh process it replaces would (`_as_a_fresh_process`): in a session of its own, its signal
handlers Python's defaults, its output written through as `python -u` writes it, the launcher's standard input,
its share of the cores as torch's thread count (torch read OMP_NUM_THREADS once, in the launcher), the agent's
quieted loggers speaking again; the interpreter's exit callbacks run when its command ends (a forked child leaves
through `os._exit`, which skips them). One difference remains: when the agent stops the ranks its signals reach
each rank, not each rank's process group, so what a rank starts ends with the rank (runtime.lifetime, its own
cleanup, a pipe's end) rather than by the agent's hand.

Forking is safe only from a process that runs nothing but its main thread (and threads that stop themselves before
a fork, as OpenBLAS's workers do): a lock held by another thread stays held in the child, and an OpenMP pool the
parent has used is missing there (GNU OpenMP then hangs the child). The launcher checks that before its agent starts
(the agent's own rendezvous store thread is torch's to fork beside); with any other thread running, or off Linux,
the ranks start as their own interpreters, as torchrun starts them.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import logging
import os
import runpy
import signal
import sys
import threading
import traceback

from alignrl.runtime.lifetime import rank_dies_with_agent

FORK_ENV = "ALIGNRL_FORK_RANKS"  # 0: every rank starts as its own interpreter
_quieted: dict[str, int] = {}  # logger name -> level before the agent quieted it, put back in each rank


def fork_safe_threads() -> bool:
    """This process runs its main thread and at most OpenBLAS's workers (Linux's task list; off Linux: unknown,
    so no). numpy and scipy load OpenBLAS, which starts a worker per core unless OMP_NUM_THREADS says otherwise and
    stops them before a fork (its own fork handler; the child starts its own): a launcher that imported numpy has
    them. Any other thread rules a fork out."""
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return threads == 1 or threads == 1 + _openblas_workers()


def _openblas_workers() -> int:
    from threadpoolctl import threadpool_info

    return sum(max(0, pool["num_threads"] - 1) for pool in threadpool_info() if pool["internal_api"] == "openblas")


def preload(modules: tuple[str, ...]) -> bool:
    """Imports `modules` (what the ranks will run; the rest they import themselves), if the ranks can be forked
    from this process; returns whether they can."""
    if os.environ.get(FORK_ENV, "1") == "0" or not fork_safe_threads() or _gpu_build():
        return False
    for name in modules:
        importlib.import_module(name)
    return fork_safe_threads()  # an import that started another thread rules the fork out


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
    agent reads the exit code); a zero one returns, as torchrun's function ranks must (a rank that left without
    returning would keep the agent waiting for its return value)."""
    try:
        code = _run_as_main(module, list(argv))
    except KeyboardInterrupt:  # one that came before the command ran, or while it ended
        code = 130
    if code:
        raise SystemExit(code)


def _run_as_main(module: str, argv: list[str]) -> int:
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
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _as_a_fresh_process() -> None:
    """What an interpreter torchrun started would have that a child forked from the launcher does not."""
    os.setsid()  # a session of its own: a terminal's Ctrl-C reaches the agent, which passes it on once
    rank_dies_with_agent()  # from here on, not from init_distributed (torch's parent-death signal is a Ctrl-C's)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    if not (os.environ.get("PYTHONFAULTHANDLER") or sys.flags.dev_mode):
        faulthandler.disable()  # torch's error recorder turned it on for function ranks only
    for name, level in _quieted.items():
        logging.getLogger(name).setLevel(level)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=True)
    try:  # multiprocessing gives its children /dev/null; a rank reads the launcher's (a breakpoint() in it)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 (the process's own standard input)
    except OSError:
        pass
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read once, when torch loaded: in the launcher, before its ranks' share
        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:  # its global generator seeded afresh, as at an interpreter's import
        sys.modules["numpy"].random.seed()
