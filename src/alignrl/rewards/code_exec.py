"""Running a program a policy wrote: one Python run in a child process, with limits, in SandboxFusion's terms.

`LocalRunner.run(code, stdin, timeout_s, memory_mb)` writes the code into a fresh temporary folder and runs it
there under a small launcher that first lowers its own limits (address space, CPU seconds, the size of any file it
writes, no core dumps) and then runs the code as `__main__`. stdout and stderr go to files in that folder, so the
file-size limit also bounds what a runaway print loop can make the parent read. The child runs in a session of its
own, which is killed whole at the wall-clock timeout and when the run ends (a process the code starts in a session
of its own escapes that). `python -I` keeps the user's site folder, PYTHON* variables
and the working folder off the import path; the environment is a short fixed one, one thread per math library.

These are resource limits, not isolation: the code runs as the user, with the network and the file system the user
has, and reads what the user can read (root: everything, every process's environment included). Code that is not
trusted belongs in a sandbox service (SandboxFusion, or `alignrl serve sandbox` in a container), which
`rewards.sandbox_client` reaches over HTTP with the same `run` interface (`CodeRunner`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

# Status words of SandboxFusion's run_result, which verl's code reward and code tool read
FINISHED, TIME_LIMIT, ERROR = "Finished", "TimeLimitExceeded", "Error"
OUTPUT_CAP = 1 << 20  # bytes of stdout (and of stderr) a run may write; a longer write ends it
LANGUAGES = ("python",)

# Runs in the child before the user's code: the limits are set by the process on itself, so the parent needs no
# preexec_fn (unsafe beside the parent's threads: the reward stage runs test cases on a thread pool).
LAUNCHER = """import resource, runpy, sys
memory, cpu, output = (int(a) for a in sys.argv[1:4])
if memory > 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit:
    raise
except BaseException as e:  # the traceback from the code's own frames, as a plain `python main.py` prints it
    import traceback
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
    sys.exit(1)
"""


@dataclass(frozen=True)
class RunResult:
    """One run, as SandboxFusion's run_result: status Finished (whatever its exit code), TimeLimitExceeded or
    Error (the run could not be made: an unsupported language, a sandbox service's own failure)."""

    status: str
    return_code: int | None
    stdout: str
    stderr: str
    execution_time: float

    @property
    def succeeded(self) -> bool:
        return self.status == FINISHED and self.return_code == 0

    def as_json(self) -> dict:
        return asdict(self)


class CodeRunner(Protocol):
    """Runs one program on one input: the local runner, or a sandbox service's client."""

    def run(self, code: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 1024,
            language: str = "python") -> RunResult: ...


def _child_env(folder: str) -> dict[str, str]:
    one = "1"  # one thread per math library: many runs share the cores at once
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": one, "OMP_NUM_THREADS": one,
            "OPENBLAS_NUM_THREADS": one, "MKL_NUM_THREADS": one}


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(OUTPUT_CAP).decode("utf-8", "replace")


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session: what the code started in it goes too
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class LocalRunner:
    """Python runs in child processes of this one (see the module's note on what the limits do not cover)."""

    python: str = sys.executable

    def run(self, code: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 1024,
            language: str = "python") -> RunResult:
        if language not in LANGUAGES:
            return RunResult(ERROR, None, "", f"language {language!r} is not run here (python only); use a "
                                              "SandboxFusion service for others", 0.0)
        with tempfile.TemporaryDirectory(prefix="alignrl-run-") as folder:
            Path(folder, "main.py").write_text(code, encoding="utf-8", errors="replace")
            out_path, err_path = Path(folder, "stdout"), Path(folder, "stderr")
            memory = max(0, int(memory_mb)) << 20
            argv = [self.python, "-I", "-c", LAUNCHER, str(memory), str(max(1, int(timeout_s + 0.999))),
                    str(OUTPUT_CAP)]
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(argv, cwd=folder, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                        env=_child_env(folder), start_new_session=True)
                status = FINISHED
                try:
                    proc.communicate(stdin.encode("utf-8", "replace"), timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    status = TIME_LIMIT
                finally:
                    _kill_session(proc)  # also reaps children it left behind after a normal exit
            elapsed = time.monotonic() - start
            if proc.returncode == -signal.SIGXCPU:  # its CPU seconds ran out before the wall clock did
                status = TIME_LIMIT
            return RunResult(status, proc.returncode, _read(out_path), _read(err_path), elapsed)
