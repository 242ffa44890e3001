"""Services as subprocesses on free loopback ports (tests, benchmarks, the search demo): started, waited
for until /health answers, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from alignrl.runtime.ports import free_port


@dataclass
class ServiceProcess:
    """A service started as a subprocess on a free loopback port (tests, benchmarks); stop() by PID."""

    args: Sequence[str]  # after `alignrl serve`, e.g. ["generate", "--model", path]
    env: dict[str, str] = field(default_factory=dict)
    command: Sequence[str] = ()  # instead of `python -m alignrl serve`, e.g. a seed launcher script
    startup_s: float = 120.0
    proc: subprocess.Popen | None = None
    port: int = 0
    log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **self.env}
        prefix = list(self.command) if self.command else [sys.executable, "-m", "alignrl", "serve"]
        cmd = [*prefix, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        # stderr to a file, not a pipe: nobody drains a pipe while the service runs, and a full one blocks it
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def wait(self) -> ServiceProcess:
        """Until /health answers; relaunch on another port if this one was taken meanwhile."""
        import httpx

        for _ in range(3):
            deadline = time.monotonic() + self.startup_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise RuntimeError(f"service {' '.join(self.args)} not healthy after {self.startup_s:.0f} s")
            self.log.seek(0)
            err = self.log.read().decode(errors="replace")
            if "address already in use" not in err.lower():
                raise RuntimeError(f"service {' '.join(self.args)} exited with {self.proc.returncode}: {err[-2000:]}")
            self.launch()
        raise RuntimeError("no free port found for the service after 3 tries")

    def start(self) -> ServiceProcess:
        self.launch()
        return self.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_all(services: Sequence[ServiceProcess]) -> list[ServiceProcess]:
    """Launch every service first, then wait for each: their startups overlap. All stop on failure."""
    try:
        for s in services:
            s.launch()
        return [s.wait() for s in services]
    except BaseException:
        for s in services:
            s.stop()
        raise
