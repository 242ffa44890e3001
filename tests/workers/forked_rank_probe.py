"""A rank that reports how it started: `python -m forked_rank_probe OUT [exit code of rank 1 | raise]`.

Imported by the launcher before its ranks are forked (test_forked_ranks preloads it), it records the pid that
imported it; run as each rank's `__main__`, it writes what a fresh interpreter's rank would be asked about."""

import atexit
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path

import numpy
import torch

IMPORTED_IN = os.getpid()


def _report(out: Path) -> dict:
    first_import = sys.modules.get("forked_rank_probe")
    return {"pid": os.getpid(), "parent": os.getppid(), "rank": int(os.environ["RANK"]),
            "imported_in": first_import.IMPORTED_IN if first_import else os.getpid(),
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "stdout_line_buffered": sys.stdout.line_buffering,
            "agent_loggers_quiet": logging.getLogger("torch.distributed.elastic").level >= logging.CRITICAL,
            "path0": sys.path[0], "argv": sys.argv[1:], "own_session": os.getsid(0) == os.getpid(),
            "stdin_fd": sys.stdin.fileno(), "faulthandler": faulthandler.is_enabled(),
            "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "numpy_draw": int(numpy.random.randint(2**31))}


if __name__ == "__main__":
    out, how = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "0")
    rank = int(os.environ["RANK"])
    report = _report(out)
    tmp = out.with_name(f"{out.name}.{rank}.tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(out.with_name(f"{out.name}.{rank}.json"))
    # an exit callback of the rank's own runs when its command ends
    atexit.register(lambda: out.with_name(f"{out.name}.{rank}.exit").write_text("ran"))
    print(f"rank {rank} says hello", flush=False)  # line-buffered as `python -u` writes it: not lost at exit
    if rank == 1 and how == "raise":
        raise RuntimeError("the probe's own failure")
    sys.exit(int(how) if rank == 1 else 0)
