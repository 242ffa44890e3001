"""`--nproc N`: re-run the same command under torchrun (`python -m torch.distributed.run`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def torchrun(nproc: int, module_argv: list[str], master_port: int | None = None) -> int:
    """Runs `python -m <module_argv>` on `nproc` local ranks; returns torchrun's exit code (non-zero
    when any rank failed: torchrun stops the others)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={master_port or free_port()}", "--master_addr=127.0.0.1", "-m", *module_argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                                                       // nproc)))}
    return subprocess.run(cmd, env=env).returncode
