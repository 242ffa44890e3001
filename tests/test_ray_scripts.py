"""Seed 001's cluster script on this machine (`two_script_nodes`, run by test_vision_script, whose job shares the
cluster): a head and a worker node (their own ports and temp dirs), `ray status` showing both, seed 003's submission
through the dashboard port as written (`--runtime-env=verl/trainer/runtime_env.yaml`, `python3 -m
verl.trainer.main_ppo`), and the script's `stop` leaving no process of either node behind. (A verl-style run inside a
Ray job is test_ray_cluster's: the job runs the same `alignrl train` with RAY_ADDRESS set.) Also: the head's
dashboard (job submission, no auth) listens on 127.0.0.1 only, ports inside Ray's worker port range are refused
in one line, and submit_ppo_ray.sh says in one line that no cluster answers instead of Ray's traceback."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from alignrl.runtime.ports import free_ports
from conftest import PY_BIN, RAY_AGENT_VARS, TwoRayNodes, run_captured, run_until_agent

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "r1_scripts" / "start_ray_cluster.sh"
SUBMIT = SCRIPT.parent / "submit_ppo_ray.sh"


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
    out = run_until_agent(["ray", "job", "submit", address, "--runtime-env=verl/trainer/runtime_env.yaml", "--no-wait",
                  "--submission-id", "seed-003", "--", "python3", "-m", "verl.trainer.main_ppo", *args], env, 120, ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    # Polled through the dashboard's job REST API (what `ray job status` reads) rather than the CLI: each CLI call
    # is a Python start-up that imports Ray, CPU taken from the job on a two-core machine.
    url = address.removeprefix("--address=") + "/api/jobs/seed-003"
    deadline, status = time.time() + 240, ""
    while time.time() < deadline and status not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(0.5)
        with urllib.request.urlopen(url, timeout=30) as reply:
            status = json.load(reply)["status"]
    with urllib.request.urlopen(url + "/logs", timeout=30) as reply:
        logs = json.load(reply)["logs"]
    assert status == "SUCCEEDED", (status + logs)[-3000:]
    assert (tmp_path / "verl_checkpoints" / "global_step_1" / "model" / "model.safetensors").is_file(), logs[-3000:]


def submit_to_the_loopback_dashboard(head: dict, port: int, tmp_path: Path) -> None:
    """The head's dashboard listens on 127.0.0.1 alone, and submit_ppo_ray.sh, finding it there, goes on to submit."""
    deadline, hosts = time.time() + 60, set()
    while time.time() < deadline and not hosts:  # `ray start` can return before the dashboard listens
        hosts = listening_hosts(port)
        time.sleep(0.5)
    assert hosts == {"127.0.0.1"}, hosts
    stub_ray(tmp_path / "bin")
    submit_env = {**head, "PATH": f"{tmp_path / 'bin'}:{head['PATH']}", "HEAD_HOST": "127.0.0.1",
                  "PRETRAIN": str(tmp_path / "model"), "PROMPT_DATA": "synthetic", "SAVE_PATH": str(tmp_path / "run")}
    out = run_captured(["bash", str(SUBMIT)], submit_env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert f"ray job submit --address=http://127.0.0.1:{port} -- alignrl train ppo-ray" in out.stdout, out.stdout


@contextlib.contextmanager
def two_script_nodes(tiny_model_dir, tmp_path: Path, extra: int = 0):
    """Seed 001's script on this machine: a head (its dashboard, which takes jobs without authentication, on
    127.0.0.1 only, not 0.0.0.0, and submit_ppo_ray.sh finding it there and going on to `ray job submit`: a stub
    `ray` that prints its call), a worker, `ray status` showing both, a second head and a worker whose agent port is
    taken refused in one line each, and seed 003's job through the dashboard. Yields the nodes for more jobs
    (test_vision_script's: starting and stopping a cluster is a good part of a job's time), then the script's `stop`
    leaves no process of either node behind."""
    nodes = TwoRayNodes("rayt", extra)
    for env in (nodes.base, nodes.head, nodes.worker):  # the dashboard's host is the script's default
        for var in ("RAY_DASHBOARD_HOST", "RAY"):
            env.pop(var, None)
    ports, short, base, head, worker = nodes.ports, nodes.short, nodes.base, nodes.head, nodes.worker
    try:
        out = run_captured(["bash", str(SCRIPT), "head", "127.0.0.1"], head)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"ray status --address=127.0.0.1:{ports[0]}" in out.stdout
        assert f"listening on 127.0.0.1:{ports[1]}" in out.stdout, out.stdout
        submit_to_the_loopback_dashboard(head, ports[1], tmp_path / "submit")
        out = run_captured(["bash", str(SCRIPT), "worker", "127.0.0.1"], worker)
        assert out.returncode == 0, out.stderr[-2000:]
        deadline, status = time.time() + 60, ""
        while time.time() < deadline:  # the worker registers within seconds
            status = run_captured(["ray", "status", f"--address=127.0.0.1:{ports[0]}"], base, timeout=60).stdout
            if status.count(" node_") == 2:
                break
            time.sleep(1)
        assert status.count(" node_") == 2 and "0.0/8.0 CPU" in status, status
        # a second head on the same ports (another user's, say) is refused in one line before Ray starts
        other = run_captured(["bash", str(SCRIPT), "head", "127.0.0.1"], {**head, "RAY_TEMP_DIR": str(short / "other")})
        assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr[-2000:]
        assert f"port {ports[0]} is in use (another Ray cluster?)" in other.stderr
        # a node whose dashboard agent port is taken would take no job: refused in one line too
        clash = run_captured(["bash", str(SCRIPT), "worker", "127.0.0.1"],
                    {**worker, "RAY_TEMP_DIR": str(short / "clash"), "RAY_AGENT_PORT": str(ports[2])})
        assert clash.returncode == 2 and clash.stderr.count("\n") == 1, clash.stderr[-2000:]
        assert f"port {ports[2]} (Ray's dashboard agent) is in use" in clash.stderr
        # seed 003's submission through the dashboard port; `ray job submit` of `alignrl train ppo-ray` without
        # --no-wait, placed on both nodes, is the vision script's, on the same nodes
        seed_003_job(f"--address=http://127.0.0.1:{ports[1]}", base, tiny_model_dir, tmp_path / "seed003")
        yield nodes
    finally:
        nodes.stop(SCRIPT)
    # `stop` kills what outlives its SIGTERM's grace without waiting for it to die
    patterns = (f"{short}/", f"ray.util.client.server .*--address=[^ ]*:{ports[0]}")  # the second names no dir
    deadline = time.monotonic() + 30
    while any(ray_pids(p) for p in patterns) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [ray_pids(p) for p in patterns] == [[], []]
    shutil.rmtree(short, ignore_errors=True)


def listening_hosts(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6, as `ss -ltn`)."""
    hosts = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            host, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                hosts.add(socket.inet_ntoa(bytes.fromhex(host)[::-1]) if len(host) == 8 else f"[{host}]")
    return hosts


def stub_ray(directory: Path) -> Path:
    """A `ray` that only prints its arguments: the scripts' checks run, no Ray starts."""
    directory.mkdir(parents=True, exist_ok=True)
    stub = directory / "ray"
    stub.write_text('#!/usr/bin/env bash\necho "ray $*"\n')
    stub.chmod(0o755)
    return stub


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", ["submit_ppo_ray.sh", "xDAN-L2-RL-32b-Instruct-0220-nodes.sh"])
def test_submit_without_cluster_is_one_line(script, tmp_path):
    """No Ray at HEAD_HOST:RAY_DASHBOARD_PORT (nothing listens on the port): one line naming the address and how to
    start the head, exit 2, instead of `ray job submit`'s traceback."""
    port = free_ports(1)[0]
    env = {**os.environ, "PATH": f"{PY_BIN}:{os.environ['PATH']}", "HEAD_HOST": "127.0.0.1",
           "RAY_DASHBOARD_PORT": str(port), "PRETRAIN": str(tmp_path / "model"), "PROMPT_DATA": "synthetic",
           "SAVE_PATH": str(tmp_path / "run")}
    out = run_captured(["bash", str(SUBMIT.parent / script)], env, timeout=45)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out.stdout + out.stderr[-3000:]
    assert f"no Ray cluster answers at http://127.0.0.1:{port}: start one on the head node with start_ray_cluster.sh head" \
        in out.stderr


@pytest.mark.timeout(60)
def test_ports_in_worker_port_range_refused(tmp_path):
    """A port chosen inside Ray's worker port range (default 10002-19999, or RAY_MIN/MAX_WORKER_PORT) is refused in
    one line before anything is stopped or started; outside it, Ray is started with that range."""
    ports = free_ports(6)
    env = {**os.environ, "RAY": str(stub_ray(tmp_path / "bin")), "RAY_TEMP_DIR": str(tmp_path / "ray"),
           "RAY_PORT": str(ports[0]), "RAY_DASHBOARD_PORT": str(ports[1]),
           **dict(zip(RAY_AGENT_VARS, map(str, ports[2:])))}
    env.pop("RAY_MIN_WORKER_PORT", None), env.pop("RAY_MAX_WORKER_PORT", None)
    refused = [("head", {"RAY_PORT": "18100"}, "port 18100 (RAY_PORT) is in Ray's worker port range 10002-19999"),
               ("head", {"RAY_DASHBOARD_PORT": "10002"}, "port 10002 (RAY_DASHBOARD_PORT) is in Ray's worker port range"),
               ("worker", {"RAY_AGENT_PORT": "19999"}, "port 19999 (RAY_AGENT_PORT) is in Ray's worker port range"),
               # a range of RAY_PORT alone: the other five ports may be its neighbours (the test run's port pool)
               ("head", {"RAY_MIN_WORKER_PORT": str(ports[0]), "RAY_MAX_WORKER_PORT": str(ports[0])},
                f"port {ports[0]} (RAY_PORT) is in Ray's worker port range {ports[0]}-{ports[0]}")]
    for role, change, message in refused:
        out = run_captured(["bash", str(SCRIPT), role, "127.0.0.1"], {**env, **change}, timeout=45)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (change, out.stdout + out.stderr[-2000:])
        assert message in out.stderr and "RAY_MIN_WORKER_PORT / RAY_MAX_WORKER_PORT" in out.stderr, out.stderr
        assert "ray start" not in out.stdout
    out = run_captured(["bash", str(SCRIPT), "head", "127.0.0.1"], env, timeout=45)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert f"ray start --head --port={ports[0]} " in out.stdout, out.stdout
    assert "--min-worker-port=10002 --max-worker-port=19999" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_a_node_that_times_out_during_startup_is_started_once_more(tmp_path):
    """Ray gives a starting node a fixed 30 s to register with the GCS, which a busy machine can miss: the script
    stops what the attempt left and starts the node once more (the stand-in `ray start` fails the first time)."""
    ports = free_ports(6)
    stub = tmp_path / "bin" / "ray"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\necho "ray $*"\n'
                    f'if [[ $1 == start && ! -e {tmp_path}/tried ]]; then touch {tmp_path}/tried\n'
                    '  echo "Exception: The current node timed out during startup." >&2; exit 1; fi\n')
    stub.chmod(0o755)
    env = {**os.environ, "RAY": str(stub), "RAY_TEMP_DIR": str(tmp_path / "ray"), "RAY_PORT": str(ports[0]),
           "RAY_DASHBOARD_PORT": str(ports[1]), **dict(zip(RAY_AGENT_VARS, map(str, ports[2:])))}
    env.pop("RAY_MIN_WORKER_PORT", None), env.pop("RAY_MAX_WORKER_PORT", None)
    out = run_captured(["bash", str(SCRIPT), "worker", "127.0.0.1"], env, timeout=45)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count(f"ray start --address=127.0.0.1:{ports[0]} ") == 2, out.stdout
    assert "the worker node did not start; stopping what it left and starting it once more" in out.stderr
    assert "node started (worker" in out.stdout


def test_seed_003s_tee_log_stays_out_of_the_jobs_package(tmp_path):
    """The seed's `| tee $EXPERIMENT_NAME.log` writes into the working directory while `ray job submit` hashes and
    packs it: a file in the package that changes between the two made the job ask for a package never uploaded.
    The runtime env's excludes leave logs out, so writing one does not change the package."""
    import yaml
    from ray._private.runtime_env import packaging

    excludes = yaml.safe_load((ROOT / "verl" / "trainer" / "runtime_env.yaml").read_text())["excludes"]
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "__init__.py").write_text("")
    before = packaging.get_uri_for_directory(str(tmp_path), False, excludes=excludes)
    (tmp_path / "nq-nq-search-r1-ppo-qwen2.5-3b-em.log").write_text("step 1\n")
    assert packaging.get_uri_for_directory(str(tmp_path), False, excludes=excludes) == before
    (tmp_path / "verl" / "new.py").write_text("")  # the code itself is still packed
    assert packaging.get_uri_for_directory(str(tmp_path), False, excludes=excludes) != before


@pytest.mark.timeout(60)
def test_a_worker_on_the_heads_machine_with_its_temp_dir_is_refused(tmp_path):
    """`start_ray_cluster.sh worker HOST` on the head's own machine with the head's temp dir would stop the head (it
    stops every Ray process of its temp dir first) and then retry the GCS for minutes: refused in one line naming
    RAY_TEMP_DIR and the agent ports, and the head left running. With a temp dir of its own the worker starts."""
    temp = tmp_path / "ray"
    temp.mkdir()
    # a stand-in head: a process whose command line is a GCS server's under this temp dir
    head = subprocess.Popen(["bash", "-c", f'exec -a "gcs_server --log_dir={temp}/session/logs --gcs_server_port=8100"'
                                           " sleep 120"], start_new_session=True)
    try:
        ports = free_ports(4)
        env = {**os.environ, "RAY": str(stub_ray(tmp_path / "bin")), "RAY_TEMP_DIR": str(temp),
               **dict(zip(RAY_AGENT_VARS, map(str, ports)))}
        deadline = time.monotonic() + 20
        while not ray_pids(f"gcs_server .*{temp}/") and time.monotonic() < deadline:  # its exec has happened
            time.sleep(0.05)
        out = run_captured(["bash", str(SCRIPT), "worker", "127.0.0.1"], env, timeout=45)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stdout + out.stderr
        assert f"runs a Ray head under {temp}" in out.stderr and "RAY_TEMP_DIR" in out.stderr
        assert "RAY_AGENT_PORT" in out.stderr and head.poll() is None  # nothing was stopped
        own = run_captured(["bash", str(SCRIPT), "worker", "127.0.0.1"], {**env, "RAY_TEMP_DIR": str(tmp_path / "w")},
                           timeout=45)
        assert own.returncode == 0 and "ray start --address=127.0.0.1:" in own.stdout, own.stdout + own.stderr
    finally:
        os.killpg(head.pid, 9)
        head.wait(10)
