"""`--nproc N`: re-run the same command under torchrun's agent, and stop it and its ranks together.

The agent is torchrun's own (`torch.distributed.run`), run in the launching process itself (a process of its
own would cost another interpreter's start-up) so that a rank exiting with an error ends the launch with that
rank's exit code and its own message only: torchrun's command-line entry point would add a ~40-line
ChildFailedError block and agent log lines to it. `python -m alignrl.runtime.launch <torchrun args>` is the same
agent for a user's own command line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from alignrl.errors import program
from alignrl.runtime import forked_ranks
from alignrl.runtime.cores import choose_threads
from alignrl.runtime.heap import settled
from alignrl.runtime.one_line import USER_ERROR
from alignrl.runtime.ports import free_port

def pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--nproc N` / `--nproc=N` taken out of argv."""
    out, nproc, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--nproc" and i + 1 < len(argv):
            nproc, i = argv[i + 1], i + 2
            continue
        if a.startswith("--nproc="):
            nproc = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    if nproc is not None and (not str(nproc).isdigit() or int(nproc) < 1):
        raise ValueError(f"--nproc {nproc!r}: give the number of processes, e.g. --nproc 2")
    return (int(nproc) if nproc is not None else None), out


def peer_lost(e: BaseException) -> bool:
    """A collective failed because another rank of the launch went away (gloo says so only in its text)."""
    lost = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    return "WORLD_SIZE" in os.environ and isinstance(e, RuntimeError) and any(s in str(e) for s in lost)


def torchrun(nproc: int, module_argv: list[str], master_port: int | None = None,
             preload: tuple[str, ...] = ()) -> int:
    """Runs `python -m <module_argv>` on `nproc` local ranks; returns the exit code of the first rank
    that failed (torchrun stops the others), else 0. The rendezvous port is `master_port`, else
    $MASTER_PORT, else a free one. The ranks are forked from this process after it imports `preload`
    (runtime.forked_ranks), where that is safe."""
    port = master_port or int(os.environ.get("MASTER_PORT") or 0) or free_port()
    # the ranks split the free cores (this process's own torch threads are set already and stay as they are)
    os.environ.setdefault("OMP_NUM_THREADS", str(choose_threads(sharing=nproc).threads))
    fork = bool(preload) and forked_ranks.preload(preload)
    settled()  # this process now only waits on its ranks (runtime.heap); forked ranks share what it froze
    return agent([f"--nproc_per_node={nproc}", f"--master_port={port}", "--master_addr=127.0.0.1", "-m",
                  *module_argv], fork=fork)


class _Terminated(Exception):
    """SIGTERM reached a launcher waiting in wait_interruptible."""


def _raise_terminated(signum, frame):
    raise _Terminated


def wait_interruptible(main: subprocess.Popen, *others: subprocess.Popen,
                       watch: tuple[subprocess.Popen, ...] = ()) -> int:
    """`main`'s exit code, or that of a `watch` process that failed first (the caller stops the rest), or 130 on
    Ctrl-C once every process has stopped: a terminal's Ctrl-C reaches them too (they say what happened
    themselves). It is passed on only to those outside this process group, which a terminal's Ctrl-C did not
    reach: a second SIGINT would cut torchrun's agent's shutdown of its ranks short. Later SIGINTs are ignored.
    SIGTERM (a scheduler, `kill`) reaches this process alone, so it is passed on to every process, which stop
    (a torchrun agent stops its ranks), and returns 143. A process still running 30 s after either gets SIGTERM,
    then SIGKILL 10 s later (a torchrun agent's ranks die with it: alignrl.runtime.lifetime)."""
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers are set there only
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    procs = (main, *others)
    try:
        while True:
            try:
                return main.wait(timeout=0.5 if watch else None)
            except subprocess.TimeoutExpired:
                failed = next((p for p in watch if p.poll() not in (None, 0)), None)
                if failed is not None:
                    return failed.returncode
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if main_thread:  # already stopping; _stop's deadlines bound it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _signal_all([p for p in procs if _outside_group(p)], signal.SIGINT)
        _stop(procs)
        return 130
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _signal_all(procs, signal.SIGTERM)
        _stop(procs)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old_term is None else old_term)


def _outside_group(p: subprocess.Popen) -> bool:
    try:
        return os.getpgid(p.pid) != os.getpgrp()
    except ProcessLookupError:
        return False


def _signal_all(procs, sig: int) -> None:
    for p in procs:
        try:
            if p.poll() is None:
                p.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop(procs, grace_s: float = 30.0) -> None:
    """Waits for `procs` to exit: `grace_s`, then SIGTERM and 10 s, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


LOG_DIR_PREFIX = "alignrl-torchrun-"


def agent_log_dir(tmp: str | None = None) -> str:
    """A fresh folder for torchrun's log files, named for this process, which removes it when the launch ends. A
    launcher that was killed (SIGKILL, out of memory) could not: the folders of launchers no longer running are
    removed here first, so they do not pile up in /tmp."""
    tmp = tmp or tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name[len(LOG_DIR_PREFIX):].split("-", 1)[0]
        if name.startswith(LOG_DIR_PREFIX) and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)  # another user's stays: not ours to remove
    return tempfile.mkdtemp(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-", dir=tmp)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def agent(argv: list[str], fork: bool = False) -> int:
    """torchrun with its arguments; a failed rank's exit code is returned, not raised as a report. `fork`: a
    `-m module` command's ranks are forked from this process (runtime.forked_ranks)."""
    import logging

    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    # "closing signal SIGTERM", "failed (exitcode: 2)", "Terminating process N via signal SIGTERM"
    forked_ranks.quiet([name for name in logging.root.manager.loggerDict
                        if name.startswith(("torch.distributed", "torch.multiprocessing"))])
    args = parse_args(argv)
    from alignrl.runtime.lifetime import AGENT_PID

    # the ranks' parent, so that each rank can check it is still alive when it asks to die with it: a rank whose
    # agent is killed (kill -9 included) dies too (alignrl.runtime.lifetime, called in init_distributed)
    before = os.environ.get(AGENT_PID)
    os.environ[AGENT_PID] = str(os.getpid())
    # torchrun's default log folder (its ranks' error files) is a /tmp/torchelastic_* that nobody removes
    own_log_dir = args.log_dir is None
    if own_log_dir:
        args.log_dir = agent_log_dir()
    try:
        if fork and args.module:
            forked_ranks.launch(args)
        else:
            run(args)
    except (DistNetworkError, RendezvousError) as e:  # most often: the rendezvous port is taken
        first = (str(e).splitlines() or [type(e).__name__])[0]
        print(f"{program()}: error: torchrun rendezvous at {args.master_addr}:{args.master_port} failed ({first}); "
              "pick a free port (MASTER_PORT=N before the command; the RL commands also take trainer.master_port=N) "
              "or check the master host", file=sys.stderr)
        return USER_ERROR
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        if code != USER_ERROR and failure.exitcode < 0:  # killed: it could say nothing
            print(f"{program()}: rank {rank} was stopped by signal {failure.signal_name()} (killed, or out of memory)",
                  file=sys.stderr)
        elif code != USER_ERROR:  # a user error was printed by rank 0 already
            print(f"{program()}: rank {rank} failed (exit code {code}); its output above says why", file=sys.stderr)
        return code
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: torchrun stopped the ranks
        return 128 + int(e.sigval)
    finally:  # later children of this process are not ranks of this agent
        if own_log_dir:
            shutil.rmtree(args.log_dir, ignore_errors=True)
        if before is None:
            os.environ.pop(AGENT_PID, None)
        else:
            os.environ[AGENT_PID] = before
    return 0


if __name__ == "__main__":
    sys.exit(agent(sys.argv[1:]))
