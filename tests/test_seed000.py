"""Seed 000 as written: ./scripts/launch_distributed.sh through DeepSpeed's multi-node launcher (two "hosts" on
this machine through stand-in pdsh/ssh), the one-host hostfile, scripts/launch_training.sh, `accelerate launch
--config_file config/accelerate_config.yaml src/train_grpo.py` and the NODE_RANK fallback (the checks before any
rank starts: test_seed000_checks.py). Every process is started in its own session and killed by its process group
in finally; services bind 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from alignrl.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2.0
'''

# stand-in pdsh: runs each host's command here in a fresh environment (as ssh would), %n = the host's index
PDSH = r'''#!/usr/bin/env bash
echo "$*" >> "$STANDIN_LOG"
while [[ $# -gt 0 ]]; do case $1 in -S) shift;; -f) shift 2;; -w) HOSTS=$2; shift 2;; *) break;; esac; done
CMD="$*"
[[ "$CMD" == pkill* ]] && exit 0   # DeepSpeed's clean-up by name: not on a shared machine
IFS=, read -ra H <<< "$HOSTS"
pids=()
for i in "${!H[@]}"; do
  env -i HOME="$HOME" PATH=/usr/bin:/bin bash -c "${CMD//%n/$i}" &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
'''
# stand-in ssh: DeepSpeed's "ssh -o PasswordAuthentication=no HOST hostname" check, run here
SSH = r'''#!/usr/bin/env bash
echo "ssh $*" >> "$STANDIN_LOG"
while [[ $# -gt 0 ]]; do case $1 in -o|-p) shift 2;; -*) shift;; *) break;; esac; done
shift
exec "$@"
'''
FAIL_PDSH = '#!/usr/bin/env bash\necho "pdsh must not run for one host" >&2\nexit 99\n'


def nodes_yaml(tmp_path, tiny_model_dir, model_services, hostfile_text, **trainer):
    gen, ref = model_services
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    cfg = {
        "training": {"master_node": "127.0.0.1", "master_port": free_port(), "hostfile": str(hostfile),
                     "services": {"generation": {"url": gen.url}, "reference": {"url": ref.url}}},
        "models": {"base_path": str(tiny_model_dir.parent),
                   "train": {"name": "tiny", "path": str(tiny_model_dir)},
                   "output": {"path": str(tmp_path / "output"), "checkpoint_dir": "checkpoints", "log_dir": "logs"}},
        "data": {"train_size": 32, "val_size": 4, "val_size_during_training": 4, "train_batch_size": 2},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "actor": {"ppo_mini_batch_size": 2, "lr": 3e-3, "use_kl_loss": True, "kl_loss_coef": 0.01},
        "algorithm": {"reward_fn": f"{reward}:compute_score"},
        "trainer": {"total_training_steps": 1, "test_freq": 0, "save_freq": 1, "progress_bar": False, **trainer},
        "services": {"timeout_s": 60, "retries": 2},
    }
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def standins(tmp_path, pdsh=PDSH):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("pdsh", pdsh), ("ssh", SSH)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def trainer_ranks(marker: str) -> dict[int, str]:
    """{RANK: argv[1]} of the running processes whose command line holds `marker` and train_grpo.py."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if marker not in " ".join(argv) or not any(a.endswith("train_grpo.py") for a in argv):
                continue
            env = dict(kv.split("=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = next(a for a in argv if a.endswith("train_grpo.py"))
    return found


def run(cmd, env, marker, timeout=240):
    """Runs `cmd` in its own session from the repository root; returns (rc, output, {rank: script seen})."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "ALIGNRL": str(BIN / "alignrl"), **env}
    seen: dict[int, str] = {}
    log = Path(env["STANDIN_LOG"]).with_name("run.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.update(trainer_ranks(marker))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            stop.set()
            watcher.join()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # this run's session only: the launcher and its ranks
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, log.read_text(), seen


def weight_version(gen):
    return httpx.get(gen.url + "/v1/weight_version").json()["weight_version"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_distributed_starts_both_hosts_of_the_hostfile_through_deepspeed(model_services, tiny_model_dir,
                                                                                tmp_path):
    """One command, two "nodes" x 1 rank (gloo): DeepSpeed's runner checks ssh, pdsh starts each host's
    deepspeed.launcher.launch with its node rank, each runs src/train_grpo.py, both train through the services."""
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "# two nodes\nlocalhost slots=1\n127.0.0.1 slots=1\n",
                      strategy="deepspeed", deepspeed_config=str(ROOT / "config/deepspeed/zero3.json"))
    bindir = standins(tmp_path)
    log = tmp_path / "standin.log"
    v0 = weight_version(model_services[0])
    rc, out, seen = run(["./scripts/launch_distributed.sh"],
                        {"CONFIG": str(path), "STANDIN_LOG": str(log), "PATH": f"{bindir}:{os.environ['PATH']}"},
                        marker=str(path))
    assert rc == 0, out[-5000:]
    assert "nodes=2 hosts=localhost,127.0.0.1" in out and "launcher=deepspeed (pdsh)" in out
    calls = log.read_text()
    assert "ssh -o PasswordAuthentication=no localhost hostname" in calls   # DeepSpeed's passwordless-ssh check
    assert "-w localhost,127.0.0.1" in calls and "--node_rank=%n" in calls and "src/train_grpo.py" in calls
    # the ranks' environment came through DeepSpeed's exports, not inherited (the stand-in starts from env -i)
    assert "export DS_ACCELERATOR=cpu" in calls and "export ALIGNRL_DIST_TIMEOUT=60" in calls
    assert "node_rank=0" in out and "node_rank=1" in out and "dist_world_size=2" in out
    assert set(seen) == {0, 1} and all(s.endswith("src/train_grpo.py") for s in seen.values()), seen
    assert "strategy deepspeed" in out
    assert weight_version(model_services[0]) >= v0 + 2  # start-up push + 1 step
    outdir = tmp_path / "output"
    assert (outdir / "checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file()
    assert (outdir / "logs").is_dir() and any((outdir / "logs").iterdir())
    assert json.loads((outdir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_host_hostfile_runs_locally_without_pdsh(model_services, tiny_model_dir, tmp_path):
    """The seed's one-node form: a hostfile of one host with 2 slots, config/deepspeed/zero3.json, two local ranks
    under DeepSpeed's launcher training through the services."""
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "gpu007 slots=2\n", strategy="deepspeed",
                      deepspeed_config=str(ROOT / "config/deepspeed/zero3.json"))
    bindir = standins(tmp_path, pdsh=FAIL_PDSH)
    log = tmp_path / "standin.log"
    v0 = weight_version(model_services[0])
    rc, out, seen = run(["./scripts/launch_distributed.sh"],
                        {"CONFIG": str(path), "STANDIN_LOG": str(log), "PATH": f"{bindir}:{os.environ['PATH']}"},
                        marker=str(path))
    assert rc == 0, out[-5000:]
    assert "nodes=1 node_rank=0 procs_per_node=2" in out and "launcher=deepspeed (local)" in out
    assert not log.exists()   # neither pdsh nor ssh
    assert set(seen) == {0, 1} and all(s.endswith("src/train_grpo.py") for s in seen.values()), seen
    assert "strategy deepspeed" in out and weight_version(model_services[0]) >= v0 + 2  # start-up push + 1 step
    outdir = tmp_path / "output"
    assert json.loads((outdir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
    assert (outdir / "checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file()


def _pids(marker: str, module: str) -> list[int]:
    """Running processes whose command line holds `marker` and `module`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and module in cmd:
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", ["deepspeed.launcher.runner", "deepspeed.launcher.launch"])
def test_ranks_stop_when_deepspeeds_runner_or_launcher_is_killed(model_services, tiny_model_dir, tmp_path, killed):
    """kill -9 of DeepSpeed's runner (what the user's shell waits on) or of its per-node launcher: the ranks stop
    within seconds instead of training on in the background, writing checkpoints."""
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "gpu007 slots=2\n", total_training_steps=500)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "ALIGNRL": str(BIN / "alignrl"), "CONFIG": str(path)}
    with open(tmp_path / "run.log", "w") as out:
        proc = subprocess.Popen(["./scripts/launch_distributed.sh"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 150
        while len(trainer_ranks(str(path))) < 2 or not (tmp_path / "output" / "logs" / "metrics.jsonl").exists():
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        (target,) = _pids(str(path), killed)
        os.kill(target, signal.SIGKILL)
        deadline = time.time() + 20
        while trainer_ranks(str(path)) and time.time() < deadline:
            time.sleep(0.5)
        assert not trainer_ranks(str(path)), (tmp_path / "run.log").read_text()[-3000:]
        proc.wait(timeout=20)  # the script returns once its runner is gone
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _pids(str(path), "deepspeed.launcher"):  # an orphaned launcher left the session's group
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_of_launch_distributed_is_one_line_and_exit_130(model_services, tiny_model_dir, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole foreground group): rank 0's one line, exit 130 as the other launchers
    (DeepSpeed's own launcher exits 1), and no rank left."""
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "gpu007 slots=2\n", total_training_steps=500)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "ALIGNRL": str(BIN / "alignrl"), "CONFIG": str(path)}
    with open(tmp_path / "run.log", "w") as out:  # SIGINT as in a terminal, even in a test run started with `&`
        proc = subprocess.Popen(["./scripts/launch_distributed.sh"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 150
        while len(trainer_ranks(str(path))) < 2 or not (tmp_path / "output" / "logs" / "metrics.jsonl").exists():
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, (tmp_path / "run.log").read_text()[-3000:]
        log = (tmp_path / "run.log").read_text()
        said = [x for x in log.splitlines() if ": interrupted" in x]  # the line says whether the same command resumes
        assert len(said) == 1 and "the same command" in said[0] and "Traceback" not in log, log[-3000:]
        assert not trainer_ranks(str(path))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_training_runs_torchrun_over_this_hosts_slots(model_services, tiny_model_dir, tmp_path):
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "localhost slots=2\n")
    rc, out, seen = run(["./scripts/launch_training.sh"], {"CONFIG": str(path), "STANDIN_LOG": str(tmp_path / "x")},
                        marker=str(path))
    assert rc == 0, out[-5000:]
    assert "single node: procs=2" in out and "strategy ddp" in out
    assert set(seen) == {0, 1} and all(s.endswith("src/train_grpo.py") for s in seen.values())
    assert (tmp_path / "output" / "checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_accelerate_launch_trains_with_the_zero3_plugin(model_services, tiny_model_dir, tmp_path):
    pytest.importorskip("accelerate")
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "localhost slots=2\n")
    port = yaml.safe_load(path.read_text())["training"]["master_port"]
    rc, out, seen = run([str(BIN / "accelerate"), "launch", "--config_file", "config/accelerate_config.yaml",
                         "--main_process_port", str(port), "src/train_grpo.py", "--config", str(path)],
                        {"STANDIN_LOG": str(tmp_path / "x")}, marker=str(path))
    assert rc == 0, out[-5000:]
    assert "strategy deepspeed" in out
    assert set(seen) == {0, 1} and all(s.endswith("src/train_grpo.py") for s in seen.values())
    outdir = tmp_path / "output"
    assert json.loads((outdir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
    assert (outdir / "checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_rank_fallback_runs_this_nodes_ranks_with_torchrun(model_services, tiny_model_dir, tmp_path):
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "localhost slots=1\n")
    rc, out, seen = run(["./scripts/launch_distributed.sh"],
                        {"CONFIG": str(path), "NODE_RANK": "0", "STANDIN_LOG": str(tmp_path / "x")}, marker=str(path))
    assert rc == 0, out[-5000:]
    assert "nodes=1 node_rank=0 procs_per_node=1" in out and "launcher=torchrun" in out
    assert set(seen) == {0} and seen[0].endswith("src/train_grpo.py")
    assert (tmp_path / "output" / "checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file()
