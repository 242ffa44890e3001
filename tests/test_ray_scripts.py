"""Seed 001's cluster script on this machine: a head and a worker node (their own ports and temp dirs),
`ray status` showing both, `ray job submit` of a short `alignrl train ppo-ray` run placed on both nodes through
the dashboard port, and the script's `stop` leaving no process of either node behind. (A verl-style run inside a
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

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "r1_scripts" / "start_ray_cluster.sh"
BIN = str(Path(sys.executable).parent)


def run(args, env, timeout=120):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def ray_pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_head_worker_status_and_job_submit(tiny_model_dir, tmp_path):
    ports = free_ports(7)
    short = Path(tempfile.mkdtemp(prefix="rayt", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    base = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_PORT": str(ports[0]),
            "RAY_DASHBOARD_PORT": str(ports[1]), "ALIGNRL_CPU_SLOTS": "4", "PYTHONPATH": str(ROOT / "src"),
            "OMP_NUM_THREADS": "1"}
    base.pop("RAY_ADDRESS", None)
    head = {**base, "RAY_TEMP_DIR": str(short / "head")}
    worker = {**base, "RAY_TEMP_DIR": str(short / "worker"), "RAY_AGENT_PORT": str(ports[2]),
              "RAY_AGENT_GRPC_PORT": str(ports[3]), "RAY_RUNTIME_ENV_AGENT_PORT": str(ports[4]),
              "RAY_METRICS_PORT": str(ports[5])}
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
        argv = ["ppo-ray", "--pretrain", str(tiny_model_dir), "--save_path", str(tmp_path / "run"),
                "--actor_num_nodes", "2", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
                "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
                "--train_batch_size", "16", "--micro_train_batch_size", "4", "--generate_max_len", "8",
                "--max_samples", "64", "--init_kl_coef", "0", "--total_steps", "2", "--val_size", "4"]
        address = f"--address=http://127.0.0.1:{ports[1]}"
        # without --no-wait, as seed 001's scripts submit: the job's log follows, and its end decides the exit code
        out = run(["ray", "job", "submit", address, "--submission-id", "ppo-ray", "--", "alignrl", "train", *argv],
                  base, timeout=300)
        assert out.returncode == 0 and "Job 'ppo-ray' succeeded" in out.stdout, (out.stdout + out.stderr)[-3000:]
        assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()
        placed = json.loads((tmp_path / "run" / "placement.json").read_text())
        ranks = [w["node_id"] for w in placed["workers"] if w["name"].startswith("actor rank")]
        assert len(set(ranks)) == 2, placed
    finally:
        for env in (worker, head):
            run(["bash", str(SCRIPT), "stop"], env)
    time.sleep(1)
    assert ray_pids(f"{short}/") == []
    assert ray_pids(f"ray.util.client.server .*--address=[^ ]*:{ports[0]}") == []  # it does not name the dir
    shutil.rmtree(short, ignore_errors=True)
