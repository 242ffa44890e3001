"""Processes a run starts die with the process that started them, however it dies (`kill -9` included).

On Linux a child asks the kernel for a signal when its parent exits (prctl PR_SET_PDEATHSIG); elsewhere these
functions do nothing. The signal is SIGKILL: the parent is gone, so nobody is left to escalate a SIGTERM that a
rank ignores (its handler returns after a Ctrl-C, a blocking C call such as a gloo collective defers Python
handlers, a SystemExit can be swallowed), and a half-stopped rank keeps its ZeroMQ ports and GPU. Nothing is
lost that a `kill -9` of the launcher did not already lose: checkpoints are written atomically, and POSIX
shared-memory weights are unlinked by multiprocessing's resource tracker.

Two caveats of the kernel's rule: the signal fires when the *thread* that forked the child exits (torchrun's
agent and our launchers spawn from their main thread, which lives as long as the process), and a parent that
died before the child's prctl sends nothing, so the child compares its parent with the pid recorded before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL = signal.SIGKILL
AGENT_PID = "ALIGNRL_AGENT_PID"  # set by launch.agent for its ranks: the pid their parent must have

_prctl = None
if sys.platform.startswith("linux"):
    try:  # looked up now, in the parent: a preexec_fn runs between fork and exec, where less is safe
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None
_rank_done = False


def die_with_parent(parent_pid: int | None, sig: int = DEATH_SIGNAL) -> bool:
    """This process gets `sig` when its parent exits. `parent_pid`: the parent it must still have (its pid as
    the parent recorded it before starting this process); if it has another, that one already died and this
    process is sent `sig` now. Returns whether the kernel took the request (False off Linux)."""
    if _prctl is None or _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:  # orphaned before prctl: re-parented already
        os.kill(os.getpid(), sig)
    return True


def preexec_die_with_parent(sig: int = DEATH_SIGNAL):
    """A `preexec_fn` for subprocess.Popen: the child dies with the process calling Popen. The mark survives
    the child's exec (not a set-user-ID program's)."""
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(parent, sig)

    return preexec


def rank_dies_with_agent() -> None:
    """Called where a rank starts (init_distributed): a torchrun rank (torchrun sets TORCHELASTIC_RUN_ID) dies
    with torchrun's agent, its parent, instead of training on, holding its ports, after the agent is killed.
    Under launch.agent the agent's pid is known (AGENT_PID) and checked; under a torchrun that is not ours it is
    not, and a parent that is already init (pid 1) stands for a dead one. A rank of DeepSpeed's launcher dies with
    it and with DeepSpeed's runner above it, which a user kills (launch_distributed.sh): the launcher outlives its
    runner, and both ranks trained on in the background. Once per process."""
    global _rank_done
    if _rank_done:
        return
    deepspeed = _deepspeed_launchers()
    if not ("TORCHELASTIC_RUN_ID" in os.environ or deepspeed):
        return
    _rank_done = True
    recorded = os.environ.pop(AGENT_PID, None)  # not for this rank's own children: their parent is this rank
    parent = int(recorded) if recorded and recorded.isdigit() else None
    if die_with_parent(parent) and parent is None and os.getppid() == 1:
        os.kill(os.getpid(), DEATH_SIGNAL)
    top = _proc(deepspeed[-1][0]) if deepspeed else None
    if top is not None and top[0] == 1 and "deepspeed.launcher.launch" in top[2]:  # its runner died as this started
        os.kill(os.getpid(), DEATH_SIGNAL)
    if len(deepspeed) > 1:  # the parent is the kernel's to watch; the ones above it, a thread's
        threading.Thread(target=_watch, args=(deepspeed[1:],), name="alignrl-launcher-watch", daemon=True).start()


def _proc(pid: int) -> tuple[int, str, list[str]] | None:
    """(parent pid, start time, argv) of a process, or None once it is gone, a zombie included (Linux /proc)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ... starttime (field 22)
    if fields[0] in "ZX":  # killed, not yet reaped by its parent: gone all the same
        return None
    return int(fields[1]), fields[19], argv


def _is_deepspeed_launcher(argv: list[str]) -> bool:
    """`python [-u] -m deepspeed.launcher.launch|runner ...`, or the `deepspeed` script (which runs the runner)."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module.startswith("deepspeed.launcher.") or any(os.path.basename(a) == "deepspeed" for a in argv[:2])


def _deepspeed_launchers() -> list[tuple[int, str]]:
    """(pid, start time) of this process's chain of DeepSpeed launcher ancestors (launch, runner), parent first."""
    chain, pid = [], os.getppid()
    while pid > 1 and (info := _proc(pid)) is not None and _is_deepspeed_launcher(info[2]):
        chain.append((pid, info[1]))
        pid = info[0]
    return chain


def _watch(launchers: list[tuple[int, str]], every_s: float = 1.0) -> None:
    while all((info := _proc(pid)) is not None and info[1] == start for pid, start in launchers):
        time.sleep(every_s)
    os.kill(os.getpid(), DEATH_SIGNAL)
