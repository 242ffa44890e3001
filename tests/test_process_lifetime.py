"""Processes a run starts die with the process that started them (alignrl.runtime.lifetime): torchrun ranks with
torchrun's agent, killed with `kill -9` included, and a launcher's SIGTERM stops everything it started. CPU, gloo,
loopback; every process a test starts is stopped by its PID at the end (ranks run in sessions of their own)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from alignrl.runtime.ports import free_ports
from conftest import src_path

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
              pytest.mark.timeout(180)]
ROOT = Path(__file__).parents[1]

# A rank: says it started (its pid), optionally sleeps (its agent may be killed meanwhile), joins the gloo group
# through init_distributed, says so, then waits to be stopped.
WORKER = """
import os, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
rank = os.environ["RANK"]

def say(name):
    with open(f"{out}/{name}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{out}/{name}.tmp", f"{out}/{name}")

say(f"started{rank}")
time.sleep(delay)
from alignrl.runtime.env import init_distributed
init_distributed("cpu", timeout_s=60)
say(f"joined{rank}")
while True:
    time.sleep(0.1)
"""

# torchrun's agent in this process, as `--nproc N` and training_worker.py run it (launch.torchrun)
AGENT = ("import sys; from alignrl.runtime.launch import torchrun; "
         "sys.exit(torchrun({n}, ['lt_worker', {out!r}, '{delay}']))")

# run_distributed.py's shape (seed004.launcher_main): a trainer that runs torchrun's agent, a sampler, and
# launch.wait_interruptible until the trainer ends or the sampler fails
RUN_DISTRIBUTED = """
import subprocess, sys
from alignrl.runtime.launch import wait_interruptible
trainer = subprocess.Popen([sys.executable, "-c", {agent!r}])
sampler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open({pids!r}, "w") as f:
    f.write(f"{{trainer.pid}} {{sampler.pid}}")
sys.exit(wait_interruptible(trainer, sampler, watch=(sampler,)))
"""


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return out


class Procs:
    """PIDs to stop at the end of a test, whatever happened."""

    def __init__(self):
        self.pids: set[int] = set()
        self.popens: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.popens.append(p)
        self.pids.add(p.pid)
        return p

    def stop(self):
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.popens:
            p.wait(timeout=30)


@pytest.fixture
def procs():
    ps = Procs()
    try:
        yield ps
    finally:
        ps.stop()


def env_for(tmp_path: Path) -> dict:
    (tmp_path / "lt_worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    return {**env, "PYTHONPATH": os.pathsep.join([src_path(), str(tmp_path)]), "OMP_NUM_THREADS": "1",
            "ALIGNRL_DIST_TIMEOUT": "60", "MASTER_PORT": str(free_ports(1)[0])}


def rank_pids(procs: Procs, out: Path, stage: str, n: int, timeout: float = 90) -> list[int]:
    def got():
        files = [out / f"{stage}{r}" for r in range(n)]
        # every rank that started is stopped at the end; only finished names (started0, never the started0.tmp
        # being renamed into place, which may be gone by the time it is read)
        for f in out.glob("started*"):
            if f.name[len("started"):].isdigit():
                procs.pids.add(int(f.read_text()))
        return all(f.is_file() for f in files) and [int(f.read_text()) for f in files]

    return wait_for(got, timeout, f"{n} rank(s) {stage}")


def agent_cmd(n: int, out: Path, delay: float = 0.0) -> list[str]:
    return [sys.executable, "-c", AGENT.format(n=n, out=str(out), delay=delay)]


def test_ranks_die_with_an_agent_killed_by_sigkill(procs, tmp_path):
    """kill -9 of the process running torchrun's agent (training_worker.py, `alignrl ... --nproc N`): its ranks
    are gone within seconds (they trained on, holding the pipeline's ports)."""
    agent = procs.start(agent_cmd(2, tmp_path), env=env_for(tmp_path), stderr=subprocess.DEVNULL)
    ranks = rank_pids(procs, tmp_path, "joined", 2)
    agent.kill()
    agent.wait(timeout=10)
    wait_for(lambda: not any(map(alive, ranks)), 5, f"ranks {ranks} gone after their agent was killed")


def test_a_rank_whose_agent_died_while_it_started_stops_when_it_joins(procs, tmp_path):
    """The agent is killed before its rank asks to die with it (the rank is still starting): the rank finds its
    parent changed when it does, and stops at once instead of waiting out the rendezvous timeout (60 s here)."""
    agent = procs.start(agent_cmd(1, tmp_path, delay=2.0), env=env_for(tmp_path), stderr=subprocess.DEVNULL)
    [rank] = rank_pids(procs, tmp_path, "started", 1)
    agent.kill()
    agent.wait(timeout=10)
    wait_for(lambda: not alive(rank), 40, f"rank {rank} gone once it reached init_distributed")
    assert not (tmp_path / "joined0").exists()


def test_sigterm_of_the_agent_stops_its_ranks(procs, tmp_path):
    agent = procs.start(agent_cmd(2, tmp_path), env=env_for(tmp_path), stderr=subprocess.DEVNULL)
    ranks = rank_pids(procs, tmp_path, "joined", 2)
    agent.terminate()
    assert agent.wait(timeout=40) == 128 + signal.SIGTERM
    wait_for(lambda: not any(map(alive, ranks)), 5, f"ranks {ranks} gone")


def test_sigterm_of_run_distributed_stops_its_trainer_ranks_and_sampler(procs, tmp_path):
    """run_distributed.py's launcher (launch.wait_interruptible) passes SIGTERM on to the processes it started and
    exits 143 once they stopped (it died alone, leaving its trainer's ranks training)."""
    pids = tmp_path / "pids"
    script = RUN_DISTRIBUTED.format(agent=AGENT.format(n=2, out=str(tmp_path), delay=0.0), pids=str(pids))
    launcher = procs.start([sys.executable, "-c", script], env=env_for(tmp_path), stderr=subprocess.DEVNULL)
    wait_for(pids.is_file, 60, "the launcher started its two processes")
    trainer, sampler = map(int, pids.read_text().split())
    procs.pids |= {trainer, sampler}
    ranks = rank_pids(procs, tmp_path, "joined", 2)
    launcher.terminate()
    assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    everything = [trainer, sampler, *ranks]
    wait_for(lambda: not any(map(alive, everything)), 5, f"{everything} gone")


def test_a_popen_child_with_the_preexec_dies_with_its_parent(procs, tmp_path):
    """launch's helper for the processes a launcher starts with subprocess (a sampler, a trainer)."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from alignrl.runtime.lifetime import preexec_die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 preexec_fn=preexec_die_with_parent())
        open({str(tmp_path / "child")!r}, "w").write(str(child.pid))
        time.sleep(300)
    """)
    parent = procs.start([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": src_path()})
    child = wait_for(lambda: (tmp_path / "child").is_file() and int((tmp_path / "child").read_text() or 0), 30,
                     "the child started")
    procs.pids.add(child)
    assert alive(child)
    parent.kill()
    parent.wait(timeout=10)
    wait_for(lambda: not alive(child), 5, f"child {child} gone with its parent")


def test_a_parent_that_died_before_prctl_is_caught():
    """die_with_parent with a parent pid that is not this process's parent any more: it is killed at once."""
    code = "from alignrl.runtime.lifetime import die_with_parent; die_with_parent(1 << 30); print('survived')"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src_path()},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and "survived" not in r.stdout


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_worker_killed_by_sigkill_frees_its_ports(procs, tiny_model_dir, tmp_path):
    """seed 004 as its users run it: `python training_worker.py` (DeepSpeed, so one torchrun rank) is killed with
    kill -9 while it waits for samplers; its rank is gone and the ports are free again within seconds, so that the
    same command can be run again (it said "port ... is in use")."""
    data, sync = free_ports(2)
    err = tmp_path / "output.txt"
    with err.open("w") as f:
        worker = procs.start([sys.executable, str(ROOT / "training_worker.py"), "--data-port", str(data),
                              "--sync-port", str(sync), "--model-path", str(tiny_model_dir), "--max-steps", "2",
                              "--output-dir", str(tmp_path / "out"), "--threads", "1", "trainer.progress_bar=false"],
                             cwd=tmp_path, stderr=f, stdout=f,
                             env={**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"})

        def rank():  # the rank, once it has bound the ports
            kids = children(worker.pid)
            procs.pids.update(kids)
            assert worker.poll() is None, err.read_text()[-3000:]
            return kids if "waiting for samplers" in err.read_text() else None

        ranks = wait_for(rank, 240, "the trainer's rank bound its ports")
    wait_for(lambda: not port_free(data) and not port_free(sync), 10, "the ports are taken")
    worker.kill()
    worker.wait(timeout=10)
    wait_for(lambda: not any(map(alive, ranks)), 5, f"rank(s) {ranks} gone")
    wait_for(lambda: port_free(data) and port_free(sync), 5, f"ports {data}, {sync} free")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def run_distributed_training(procs, model_dir, tmp_path: Path, ports: list[int]) -> tuple[subprocess.Popen, list[int]]:
    """seed 004's `python run_distributed.py` (a 2-rank DeepSpeed trainer and a sampler), once it trained a step;
    its output goes to tmp_path/output.txt. Returns it and the pids of every process under it."""
    log = tmp_path / "output.txt"
    metrics = tmp_path / "grpo_zmq" / "logs" / "metrics.jsonl"
    with log.open("w") as f:
        launcher = procs.start([sys.executable, str(ROOT / "run_distributed.py"), "--sampling-gpu", "0",
                                "--training-gpus", "1,2", "--model-path", str(model_dir), "--max-steps", "200",
                                "--batch-size", "4", "--group-size", "4", "--output-dir", str(tmp_path),
                                "--data-port", str(ports[0]), "--sync-port", str(ports[1]), "data.train_size=64",
                                "data.val_size=4", "rollout.max_new_tokens=8", "trainer.progress_bar=false"],
                               cwd=tmp_path, stdout=f, stderr=f,
                               env={**os.environ, "PYTHONPATH": src_path(), "OMP_NUM_THREADS": "1"})

    def training():  # a step trained: the sampler and both ranks are up
        assert launcher.poll() is None, log.read_text()[-3000:]
        kids = descendants(launcher.pid)
        procs.pids.update(kids)
        return kids if metrics.is_file() and '"step": 1' in metrics.read_text() else None

    kids = wait_for(training, 240, "run_distributed.py trained a step")
    assert len(kids) >= 4, kids  # the trainer's launcher, its 2 ranks, the sampler
    return launcher, kids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_distributed_killed_by_sigkill_takes_its_trainer_ranks_and_sampler_along(procs, tiny_model_dir, tmp_path):
    """seed 004's `python run_distributed.py`, killed with kill -9 while it trains (a 2-rank DeepSpeed trainer and a
    sampler under it): every process it started is gone within seconds and the ports can be bound by the next run."""
    data, sync = free_ports(2)
    launcher, kids = run_distributed_training(procs, tiny_model_dir, tmp_path, [data, sync])
    launcher.kill()
    launcher.wait(timeout=10)
    wait_for(lambda: not any(map(alive, kids)), 10, f"{kids} gone with run_distributed.py")
    # the next trainer can bind them (the killed connections' TIME_WAIT blocks a plain bind for a minute, not ZeroMQ's)
    wait_for(lambda: zmq_binds(data) and zmq_binds(sync), 5, f"ports {data}, {sync} free for ZeroMQ")


def zmq_binds(port: int) -> bool:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(f"tcp://127.0.0.1:{port}")
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_distributed_whose_sampler_is_killed_says_so_and_stops(procs, tiny_model_dir, tmp_path):
    """The sampler under run_distributed.py killed with kill -9: the launcher names it in one line, stops the trainer
    and exits 1 (it used to exit 247, sys.exit(-9), with only the ranks' lines)."""
    launcher, kids = run_distributed_training(procs, tiny_model_dir, tmp_path, free_ports(2))
    sampler = next(pid for pid in kids if b" sample " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
    os.kill(sampler, signal.SIGKILL)
    assert launcher.wait(timeout=60) == 1
    said = (tmp_path / "output.txt").read_text()
    assert (f"run_distributed.py: the sampler (pid {sampler}) was killed by SIGKILL; stopping the trainer" in said
            and "Traceback" not in said), said[-3000:]
    wait_for(lambda: not any(map(alive, kids)), 15, f"{kids} gone")
