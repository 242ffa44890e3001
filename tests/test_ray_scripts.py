"""Seed 001's cluster script on this machine: a head and a worker node (their own ports and temp dirs),
`ray status` showing both, `ray job submit` of a short `alignrl train ppo-ray` run placed on both nodes through
the dashboard port, seed 003's submission as written (`--runtime-env=verl/trainer/runtime_env.yaml`,
`python3 -m verl.trainer.main_ppo`), and the script's `stop` leaving no process of either node behind. (A verl-style run inside a
Ray job is test_ray_cluster's: the job runs the same `alignrl train` with RAY_ADDRESS set.)"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from alignrl.dist.launch import free_ports
from conftest import src_path

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "r1_scripts" / "start_ray_cluster.sh"
BIN = str(Path(sys.executable).parent)


def run(args, env, timeout=120):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def submit(args, env, timeout, cwd=None):
    """`ray job submit`, again while the head says its job agent is not up yet: on a loaded machine the dashboard
    can answer before the head node's agent has registered ("No available agent to submit job, please try again
    later"), and a submission that fails so has not created its submission id."""
    deadline = time.time() + 90
    while True:
        out = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if out.returncode == 0 or "No available agent" not in out.stdout + out.stderr or time.time() > deadline:
            return out
        time.sleep(3)


def ray_pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def seed_003_job(address: str, env: dict, model_dir: Path, tmp_path: Path) -> None:
    """Seed 003's submission as written, from the repository root: verl's runtime-env file and entry point
    (`python3 -m verl.trainer.main_ppo`, the shim in verl/), `--no-wait`, then `ray job status` until it ends.
    One PPO step of the tiny model over both nodes (trainer.nnodes=2 × n_gpus_per_node=1)."""
    args = ["data.train_batch_size=4", "data.val_data_num=4", "data.max_prompt_length=64", "data.max_response_length=8",
            "algorithm.adv_estimator=gae", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=4",
            "actor_rollout_ref.rollout.n_agent=1", "actor_rollout_ref.rollout.name=vllm", f"critic.model.path={model_dir}",
            "algorithm.kl_ctrl.kl_coef=0.001", "trainer.critic_warmup=0", "trainer.logger=['console']",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=2", "trainer.save_freq=1", "trainer.test_freq=0",
            "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'verl_checkpoints'}",
            f"trainer.output_dir={tmp_path / 'verl_out'}", "trainer.threads=1", "trainer.progress_bar=false"]
    out = submit(["ray", "job", "submit", address, "--runtime-env=verl/trainer/runtime_env.yaml", "--no-wait",
                  "--submission-id", "seed-003", "--", "python3", "-m", "verl.trainer.main_ppo", *args], env, 120, ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    deadline, status = time.time() + 240, ""
    while time.time() < deadline and not any(s in status for s in ("succeeded", "failed", "stopped")):
        time.sleep(2)
        status = run(["ray", "job", "status", address, "seed-003"], env, timeout=60).stdout.lower()
    logs = run(["ray", "job", "logs", address, "seed-003"], env, timeout=60).stdout
    assert "job 'seed-003' succeeded" in status, (status + logs)[-3000:]
    assert (tmp_path / "verl_checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file(), logs[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_head_worker_status_and_job_submit(tiny_model_dir, tmp_path):
    ports = free_ports(10)
    short = Path(tempfile.mkdtemp(prefix="rayt", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    base = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_PORT": str(ports[0]),
            "RAY_DASHBOARD_PORT": str(ports[1]), "ALIGNRL_CPU_SLOTS": "4", "PYTHONPATH": src_path(),
            "OMP_NUM_THREADS": "1"}
    base.pop("RAY_ADDRESS", None)
    # every node's agents on free ports, the head's too: on their fixed defaults (52365, ...) they fail to bind
    # while another Ray of the test run holds them, and the head then has no agent to take a job ("No available
    # agent to submit job"), however long one waits
    agents = ("RAY_AGENT_PORT", "RAY_AGENT_GRPC_PORT", "RAY_RUNTIME_ENV_AGENT_PORT", "RAY_METRICS_PORT")
    head = {**base, "RAY_TEMP_DIR": str(short / "head"), **dict(zip(agents, map(str, ports[2:6])))}
    worker = {**base, "RAY_TEMP_DIR": str(short / "worker"), **dict(zip(agents, map(str, ports[6:10])))}
    try:
        out = run(["bash", str(SCRIPT), "head", "127.0.0.1"], head)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"ray status --address=127.0.0.1:{ports[0]}" in out.stdout
        out = run(["bash", str(SCRIPT), "worker", "127.0.0.1"], worker)
        assert out.returncode == 0, out.stderr[-2000:]
        deadline, status = time.time() + 60, ""
        while time.time() < deadline:  # the worker registers within seconds
            status = run(["ray", "status", f"--address=127.0.0.1:{ports[0]}"], base, timeout=60).stdout
            if status.count(" node_") == 2:
                break
            time.sleep(1)
        assert status.count(" node_") == 2 and "0.0/8.0 CPU" in status, status
        # a second head on the same ports (another user's, say) is refused in one line before Ray starts
        other = run(["bash", str(SCRIPT), "head", "127.0.0.1"], {**head, "RAY_TEMP_DIR": str(short / "other")})
        assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr[-2000:]
        assert f"port {ports[0]} is in use (another Ray cluster?)" in other.stderr
        # a node whose dashboard agent port is taken would take no job: refused in one line too
        clash = run(["bash", str(SCRIPT), "worker", "127.0.0.1"],
                    {**worker, "RAY_TEMP_DIR": str(short / "clash"), "RAY_AGENT_PORT": str(ports[2])})
        assert clash.returncode == 2 and clash.stderr.count("\n") == 1, clash.stderr[-2000:]
        assert f"port {ports[2]} (Ray's dashboard agent) is in use" in clash.stderr
        argv = ["ppo-ray", "--pretrain", str(tiny_model_dir), "--save_path", str(tmp_path / "run"),
                "--actor_num_nodes", "2", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
                "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
                "--train_batch_size", "16", "--micro_train_batch_size", "4", "--generate_max_len", "8",
                "--max_samples", "64", "--init_kl_coef", "0", "--total_steps", "2", "--val_size", "4"]
        address = f"--address=http://127.0.0.1:{ports[1]}"
        # without --no-wait, as seed 001's scripts submit: the job's log follows, and its end decides the exit code
        out = submit(["ray", "job", "submit", address, "--submission-id", "ppo-ray", "--", "alignrl", "train", *argv],
                     base, 300)
        assert out.returncode == 0 and "Job 'ppo-ray' succeeded" in out.stdout, (out.stdout + out.stderr)[-3000:]
        assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()
        placed = json.loads((tmp_path / "run" / "placement.json").read_text())
        ranks = [w["node_id"] for w in placed["workers"] if w["name"].startswith("actor rank")]
        assert len(set(ranks)) == 2, placed
        seed_003_job(address, base, tiny_model_dir, tmp_path)
    finally:
        for env in (worker, head):
            run(["bash", str(SCRIPT), "stop"], env)
    time.sleep(1)
    assert ray_pids(f"{short}/") == []
    assert ray_pids(f"ray.util.client.server .*--address=[^ ]*:{ports[0]}") == []  # it does not name the dir
    shutil.rmtree(short, ignore_errors=True)
