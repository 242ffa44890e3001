"""POSIX shared-memory segments that outlive no trainer for long.

Python's resource tracker (a helper process each creator starts) removes a creator's segments after a plain
`kill -9` of it, and then warns of "leaked shared_memory objects": the removal is what we want, the two-line
warning is noise at the moment a user is reading why the trainer died, so it is silenced. What the tracker cannot
do is outlive its creator's process group: a `kill -9` of the whole group (a scheduler, `pkill -9 -g`, a container
stop) takes the tracker too, and the segments (a copy of the published weights each) would stay in /dev/shm, in
RAM, until reboot. So the segments carry their creator in their name, `alignrl_<pid namespace>_<pid>_<random>`, and
every trainer that makes segments first removes those whose creator in its own pid namespace is gone. A creator
in another pid namespace (another container sharing /dev/shm) is never judged from here.
"""

from __future__ import annotations

import os
import secrets
import sys
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

PREFIX = "alignrl_"
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared memory by name
_QUIET = "ignore:resource_tracker:UserWarning"  # passed to the tracker process, which Python starts with -W options


PID_MAX = 1 << 22  # Linux's largest pid_max: a name with a larger "pid" is not ours to judge


def _namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def create(size: int) -> SharedMemory:
    """A new segment of `size` bytes named after this process."""
    if _QUIET not in sys.warnoptions:  # read when the tracker starts, at the first segment of the process
        sys.warnoptions.append(_QUIET)
    return SharedMemory(name=f"{PREFIX}{_namespace() or 0}_{os.getpid()}_{secrets.token_hex(6)}", create=True,
                        size=size)


def orphans() -> list[str]:
    """Names of this host's alignrl segments whose creator, in this pid namespace, is no longer running."""
    ns, found = _namespace(), []
    if ns is None or not SHM_DIR.is_dir():  # without its pid namespace no creator can be judged from here
        return []
    for path in SHM_DIR.glob(f"{PREFIX}{ns}_*"):
        pid = path.name[len(PREFIX) + len(ns) + 1:].partition("_")[0]
        if pid.isdigit() and 0 < int(pid) <= PID_MAX and not _running(int(pid)):
            found.append(path.name)
    return found


def sweep() -> int:
    """Removes the orphaned segments; how many went. One another process removes first is simply skipped."""
    gone = 0
    for name in orphans():
        try:
            (SHM_DIR / name).unlink()
            gone += 1
        except OSError:
            pass
    return gone


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True
