"""`--nproc` ranks forked from their launcher (runtime.forked_ranks): they skip the imports the launcher made once,
and start as the fresh interpreters they replace (signals, output, exit callbacks, exit codes, sys.path)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_group, src_path

WORKERS = Path(__file__).parent / "workers"
# torch imported first with the machine's thread count, as a preference command's launcher does
LAUNCH = ("import sys, torch; from alignrl.runtime.launch import torchrun; "
          "sys.exit(torchrun(2, ['forked_rank_probe', *sys.argv[1:]], preload=('forked_rank_probe',)))")


def launch(tmp_path: Path, *args: str, fork: bool = True) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src_path(), str(WORKERS)]),
           "TMPDIR": str(tmp_path / "tmp"), "ALIGNRL_FORK_RANKS": "1" if fork else "0"}
    for unset in ("MASTER_PORT", "OMP_NUM_THREADS", "PYTHONFAULTHANDLER"):  # the launcher picks the ranks' threads
        env.pop(unset, None)
    done = run_group([sys.executable, "-c", LAUNCH, str(tmp_path / "r"), *args], 180, env=env, cwd=tmp_path)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("r.*.json"))]
    return done, reports


@pytest.mark.timeout(240)
def test_ranks_are_forked_from_the_launcher_and_start_as_fresh_processes(tmp_path):
    done, ranks = launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["rank"] for r in ranks] == [0, 1]
    launcher = ranks[0]["parent"]
    for r in ranks:
        # imported once, by the launcher (their parent: the agent runs in it), before it forked them
        assert r["parent"] == launcher and r["imported_in"] == launcher != r["pid"], r
        assert r["sigint_default"] and r["sigterm_default"] and r["stdout_line_buffered"], r
        assert not r["agent_loggers_quiet"] and r["path0"] == str(tmp_path) and r["argv"] == [str(tmp_path / "r")]
        # a session of its own, the launcher's standard input, no fault handler that torch's recorder turned on
        assert r["own_session"] and r["stdin_fd"] == 0 and not r["faulthandler"], r
        # its share of the cores, though torch was loaded in the launcher before the share was known
        assert r["threads"] == int(r["omp_num_threads"]), r
        assert (tmp_path / f"r.{r['rank']}.exit").read_text() == "ran"
    assert ranks[0]["numpy_draw"] != ranks[1]["numpy_draw"]  # numpy's global generator seeded afresh in each
    assert done.stdout.count("says hello") == 2, done.stdout
    assert list((tmp_path / "tmp").iterdir()) == []  # torchrun's log folder went with the launch


@pytest.mark.timeout(240)
def test_with_forking_off_each_rank_is_its_own_interpreter(tmp_path):
    done, ranks = launch(tmp_path, fork=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(r["imported_in"] == r["pid"] and r["path0"] == str(tmp_path) for r in ranks), ranks
    # what the forked ranks are checked for above is what an interpreter torchrun starts has
    assert all(r["own_session"] and r["stdin_fd"] == 0 and not r["faulthandler"] and
               r["threads"] == int(r["omp_num_threads"]) for r in ranks), ranks
    assert all((tmp_path / f"r.{r['rank']}.exit").is_file() for r in ranks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how, code", [("3", 3), ("raise", 1)])
def test_a_failed_rank_ends_the_launch_with_its_exit_code(tmp_path, how, code):
    done, _ = launch(tmp_path, how)
    assert done.returncode == code, done.stderr[-3000:]
    if how == "raise":  # its traceback on its own stderr, as an interpreter prints it, and its exit callbacks ran
        assert "RuntimeError: the probe's own failure" in done.stderr, done.stderr[-3000:]
    assert f"rank 1 failed (exit code {code})" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "r.1.exit").read_text() == "ran"


def test_a_launcher_forks_only_beside_openblas_workers_alone_and_with_a_cpu_torch(tmp_path):
    """numpy's OpenBLAS starts a worker per core (OMP_NUM_THREADS unset) and stops them before a fork: those
    alone allow it; another thread, or a CUDA build of torch, does not."""
    script = """
import threading, torch
from alignrl.runtime import forked_ranks as f
print(f.preload(("json",)))
torch.version.cuda = "12.8"
print(f.preload(("json",)))
torch.version.cuda = None
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()
print(f.preload(("json",)))
stop.set(); t.join()
"""
    env = {**os.environ, "PYTHONPATH": src_path(), "ALIGNRL_FORK_RANKS": "1"}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # beside OpenBLAS's workers: yes; a CUDA build of torch: no; beside another thread: no
    assert out.stdout.split() == ["True", "False", "False"], out.stdout


def test_the_log_folders_of_killed_launchers_are_removed_by_the_next(tmp_path):
    """A launcher killed by SIGKILL cannot remove its torchrun log folder; the next launch on the machine does, and
    leaves those of launchers still running and folders it did not make."""
    from alignrl.runtime.launch import LOG_DIR_PREFIX, agent_log_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process holds now
    stale = tmp_path / f"{LOG_DIR_PREFIX}{gone.pid}-abc"
    (stale / "attempt_0" / "0").mkdir(parents=True)
    running = tmp_path / f"{LOG_DIR_PREFIX}{os.getppid()}-def"
    running.mkdir()
    others = [tmp_path / f"{LOG_DIR_PREFIX}ghi", tmp_path / "torchelastic_jkl"]
    for folder in others:
        folder.mkdir()
    made = Path(agent_log_dir(str(tmp_path)))
    assert made.name.startswith(f"{LOG_DIR_PREFIX}{os.getpid()}-") and made.is_dir()
    assert not stale.exists() and running.is_dir() and all(folder.is_dir() for folder in others)
