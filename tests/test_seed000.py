"""Seed 000 as written: ./scripts/launch_distributed.sh through DeepSpeed's multi-node launcher (two "hosts" on
this machine through stand-in pdsh/ssh), the one-host hostfile, scripts/launch_training.sh, `accelerate launch
--config_file config/accelerate_config.yaml src/train_grpo.py`, and the hostfile's host checks. Every process
is started in its own session and killed by its process group in finally; services bind 127.0.0.1."""

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
        "trainer": {"total_training_steps": 2, "test_freq": 0, "save_freq": 2, "progress_bar": False, **trainer},
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
    assert weight_version(model_services[0]) >= v0 + 2
    outdir = tmp_path / "output"
    assert (outdir / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()
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
    assert "strategy deepspeed" in out and weight_version(model_services[0]) >= v0 + 3  # start-up push + 2 steps
    outdir = tmp_path / "output"
    assert json.loads((outdir / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
    assert (outdir / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()


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
    assert (tmp_path / "output" / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()


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
    assert (outdir / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()


def test_accelerate_config_points_at_the_zero3_json_and_the_hostfile_layout():
    acc = yaml.safe_load((ROOT / "config/accelerate_config.yaml").read_text())
    assert acc["distributed_type"] == "DEEPSPEED"
    ds = ROOT / acc["deepspeed_config"]["deepspeed_config_file"]
    assert json.loads(ds.read_text())["zero_optimization"]["stage"] == 3
    from alignrl.doctor import parse_hostfile

    hosts, errors = parse_hostfile((ROOT / "config/hostfile").read_text())
    assert not errors and acc["num_machines"] == len(hosts) and acc["num_processes"] == sum(hosts.values())


def test_train_grpo_shim_builds_the_alignrl_command(monkeypatch):
    from alignrl.compat.deepspeed_launcher import train_args

    nodes = ROOT / "config/nodes.yaml"
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert train_args(["--local_rank=1", "a.b=1"], nodes) == ["--config", str(nodes), "a.b=1"]
    assert train_args(["--config", "x.yaml", "--local_rank", "0"], nodes) == ["--config", "x.yaml"]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "z3.json")
    assert train_args(["--config", "x.yaml"], nodes)[-2:] == ["trainer.strategy=deepspeed",
                                                            "trainer.deepspeed_config=z3.json"]


@pytest.mark.timeout(60)
def test_unresolvable_hostfile_host_is_one_line_with_its_line_number(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\nlocalhost slots=1\nno-such-node.invalid slots=1\n")
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(yaml.safe_dump({"training": {"master_node": "127.0.0.1", "master_port": free_port(),
                                                "hostfile": str(hostfile)},
                                   "models": {"train": {"path": "demo"}}}))
    r = subprocess.run(["./scripts/launch_distributed.sh"], cwd=ROOT, capture_output=True, text=True, timeout=50,
                       env={**os.environ, "CONFIG": str(cfg), "ALIGNRL": str(BIN / "alignrl")})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"launch_distributed.sh: {hostfile} line 3: host no-such-node.invalid does not resolve"]

    from alignrl.config import load_config
    from alignrl.doctor import run_checks

    checks = [c for c in run_checks(load_config(str(cfg), []), 1.0) if c.name == "hostfile host"]
    assert [(c.ok, c.detail) for c in checks] == [  # several hosts: DeepSpeed's pdsh/ssh reaches this one too
        (True, "this host: DeepSpeed's launcher reaches it over ssh too, as every host of a hostfile with several "
               "(passwordless ssh to itself needed)"),
        (False, f"{hostfile} line 3: host no-such-node.invalid does not resolve")]


@pytest.mark.timeout(120)
def test_launcher_mistakes_found_before_any_rank_starts_are_one_line(tmp_path):
    """Each of these ended in a DeepSpeed traceback, a rank's error after the models loaded, or (NODE_RANK with a
    master that does not resolve) a rendezvous that waited for ever."""
    two = tmp_path / "hostfile"
    two.write_text("localhost slots=1\n127.0.0.2 slots=1\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, code in (("pdsh", 0), ("ssh", 255)):  # pdsh installed, ssh refused: no keys
        (fake / name).write_text(f"#!/bin/sh\nexit {code}\n")
        (fake / name).chmod(0o755)
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(yaml.safe_dump({"training": {"master_node": "127.0.0.1", "master_port": free_port(),
                                                "hostfile": str(two)}, "models": {"train": {"path": "demo"}}}))
    small = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2"]
    env = {**os.environ, "CONFIG": str(cfg), "ALIGNRL": str(BIN / "alignrl"), "PATH": f"{fake}:{os.environ['PATH']}"}
    cases = [({}, [], "launch_distributed.sh: host localhost is not reachable over passwordless ssh from this node"),
             ({"NODE_RANK": "0"}, ["training.master_node=gpu007.invalid"],
              "launch_distributed.sh: training.master_node gpu007.invalid does not resolve to an address"),
             ({}, ["models.train.path=/data/vayu/none"],
              "launch_distributed.sh: models.train.path='/data/vayu/none' is not a Hugging Face model folder"),
             ({"CONFIG": str(tmp_path / "node.yaml")}, [],
              f"launch_distributed.sh: config file not found: {tmp_path / 'node.yaml'} (set CONFIG= to the nodes.yaml")]
    for extra_env, overrides, said in cases:
        r = subprocess.run(["./scripts/launch_distributed.sh", *small, *overrides], cwd=ROOT, capture_output=True,
                           text=True, timeout=50, env={**env, **extra_env})
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), r.stderr


@pytest.mark.timeout(60)
def test_doctor_notes_that_another_host_needs_ssh(tmp_path):
    from alignrl.doctor import check_hosts

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\n10.255.255.1 slots=8  # worker\n")
    local, remote = check_hosts(str(hostfile))
    assert local.ok and "reaches it over ssh too" in local.detail  # pdsh/ssh reaches every host of several
    hostfile.write_text("127.0.0.1 slots=2\n")
    assert "no ssh" in check_hosts(str(hostfile))[0].detail  # one host: DeepSpeed starts its ranks locally
    assert remote.ok and remote.target == f"10.255.255.1 ({hostfile} line 2)" and "ssh needed" in remote.detail


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_rank_fallback_runs_this_nodes_ranks_with_torchrun(model_services, tiny_model_dir, tmp_path):
    path = nodes_yaml(tmp_path, tiny_model_dir, model_services, "localhost slots=1\n")
    rc, out, seen = run(["./scripts/launch_distributed.sh"],
                        {"CONFIG": str(path), "NODE_RANK": "0", "STANDIN_LOG": str(tmp_path / "x")}, marker=str(path))
    assert rc == 0, out[-5000:]
    assert "nodes=1 node_rank=0 procs_per_node=1" in out and "launcher=torchrun" in out
    assert set(seen) == {0} and seen[0].endswith("src/train_grpo.py")
    assert (tmp_path / "output" / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()


@pytest.mark.timeout(60)
def test_two_hosts_without_pdsh_is_one_line_naming_the_fallback(tmp_path):
    import shutil

    if shutil.which("pdsh", path="/usr/bin:/bin"):
        pytest.skip("pdsh is installed here")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(yaml.safe_dump({"training": {"master_node": "127.0.0.1", "master_port": free_port(),
                                                "hostfile": str(hostfile)}, "models": {"train": {"path": "demo"}}}))
    r = subprocess.run(["./scripts/launch_distributed.sh"], cwd=ROOT, capture_output=True, text=True, timeout=50,
                       env={**os.environ, "CONFIG": str(cfg), "ALIGNRL": str(BIN / "alignrl"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "launch_distributed.sh: pdsh not found on this node: install pdsh (and passwordless ssh to localhost,127.0.0.1), "
        "or run this script on each node with NODE_RANK=0..1"]
