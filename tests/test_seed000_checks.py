"""Seed 000's launch files checked before any rank starts: the accelerate config and hostfile agree, the
train_grpo.py shim builds the alignrl command, and a hostfile host that does not resolve, a host without ssh, a master
that does not resolve, a missing model or config, and a missing pdsh are one line each (`alignrl doctor` says the same
about the hosts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alignrl.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


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
