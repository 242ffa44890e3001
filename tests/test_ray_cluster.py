"""The Ray placement on a two-node cluster on this machine (`ray.cluster_utils.Cluster`, two nodes × 8
fake GPUs as in seed 001, bound to 127.0.0.1, shut down by the module fixture): seed 001's placement
read back from Ray's placement tables, the Ray loop against the in-process loop, an impossible
placement, and a killed worker."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from alignrl.algos.runner import train_grpo  # noqa: E402
from alignrl.cluster import flags as F  # noqa: E402
from alignrl.cluster.plan import engine_slot, release, requests, reserve, slots  # noqa: E402
from alignrl.cluster.train_ppo_ray import main  # noqa: E402
from alignrl.config import load_config  # noqa: E402

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SRC = str(Path(__file__).parents[1] / "src")
NODE = dict(num_cpus=8, num_gpus=8, node_ip_address="127.0.0.1", include_dashboard=False,
            object_store_memory=80 << 20)
SEED_001 = ["--ref_num_nodes", "2", "--ref_num_gpus_per_node", "4", "--actor_num_nodes", "2",
            "--actor_num_gpus_per_node", "4", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4",
            "--colocate_actor_ref", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
            "--rollout_batch_size", "128", "--train_batch_size", "128", "--micro_train_batch_size", "2",
            "--use_kl_loss", "--init_kl_coef", "0.001"]


def tiny(model_dir, save, steps, *extra):
    """Two actor ranks, one reference worker, one rollout engine: a small world for the 2-core machine."""
    return ["--pretrain", str(model_dir), "--save_path", str(save), "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "2", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--generate_max_len", "8", "--prompt_max_len", "64", "--max_samples", "64", "--use_kl_loss",
            "--init_kl_coef", "0.01", "--actor_learning_rate", "1e-3", "--val_size", "4",
            "--total_steps", str(steps), "--peer_timeout", "60", "--placement_timeout", "20", *extra]


@pytest.fixture(scope="module")
def cluster():
    # Ray turns a loopback address into the machine's own IP unless clusters are "local only"; the
    # nodes here listen on 127.0.0.1, so every process of the test (and its drivers) keeps loopback.
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER, os.environ[LOOPBACK_ENV] = False, "0"
    c = Cluster(initialize_head=True, head_node_args=dict(NODE))
    try:
        c.add_node(**NODE)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="ERROR")
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved[1]


def test_seed_001_placement_from_rays_tables(cluster):
    assert all_gpus_free()
    args = F.parser().parse_args(SEED_001)
    F.check(args)
    reqs = requests(args)
    reserve(reqs, gpus=True, timeout_s=20)
    try:
        tables = {k: placement_group_table(r.pg) for k, r in reqs.items()}
        actor = tables["actor"]  # actor and reference share it: 4 + 4 on each of the two nodes
        assert actor["strategy"] == "STRICT_SPREAD" and actor["state"] == "CREATED"
        assert [b["GPU"] for b in actor["bundles"].values()] == [4.0, 4.0]
        assert len(set(actor["bundles_to_node_id"].values())) == 2
        engines = [tables["engine0"], tables["engine1"]]  # two engines of TP 4, the rest of each node
        assert all([b["GPU"] for b in t["bundles"].values()] == [4.0] for t in engines)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        used = {n: 0.0 for n in nodes}
        for t in tables.values():
            for i, node in t["bundles_to_node_id"].items():
                used[node] += t["bundles"][i]["GPU"]
        assert sorted(used.values()) == [8.0, 8.0]
        assert ray.available_resources().get("GPU", 0.0) == 0.0
        assert reqs["actor"].roles == ["actor", "ref"] and (reqs["actor"].share("actor"), reqs["actor"].share("ref")) == (0.75, 0.25)
    finally:
        release(reqs)


def all_gpus_free(timeout: float = 15.0) -> bool:
    """Ray's view of free resources lags a removed placement group by a moment."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("GPU", 0.0) < 16.0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_colocate_all_models_puts_one_engine_on_each_node(cluster):
    assert all_gpus_free()
    args = F.parser().parse_args(SEED_001 + ["--colocate_all_models"])
    F.check(args)
    reqs = requests(args)
    reserve(reqs, gpus=True, timeout_s=20)
    try:
        assert list(reqs) == ["actor"] and reqs["actor"].roles == ["actor", "ref", "engine0", "engine1"]
        engines = [engine_slot(reqs, e, 4) for e in range(2)]
        assert len({s.node for s in engines}) == 2 and [s.local_rank for s in engines] == [0, 0]
        actors = slots(reqs, "actor", 8, 4)
        assert [s.local_rank for s in actors] == [0, 1, 2, 3] * 2 and len({s.node for s in actors}) == 2
        assert [s.node for s in actors[:4]] == [engines[0].node] * 4
    finally:
        release(reqs)


def test_an_impossible_placement_fails_at_once(cluster, capsys):
    assert all_gpus_free()
    t0 = time.monotonic()
    code = main(SEED_001 + ["--actor_num_gpus_per_node", "12", "--ref_num_gpus_per_node", "12",
                                 "--train_batch_size", "192", "--rollout_batch_size", "24", "--total_steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - t0 < 10
    assert err.count("\n") == 0 and "actor 2 node(s) × 12 GPU" in err and "2 node(s) with 8, 8 GPU" in err, err


def test_a_placement_that_is_never_granted_fails_after_its_timeout(cluster, capsys):
    """Each group fits alone, the sum fits the free GPUs, but 6 + 6 actor GPUs leave no node with 4 for
    the engine: the wait ends after --placement_timeout with one line."""
    assert all_gpus_free()
    t0 = time.monotonic()
    code = main(["--actor_num_nodes", "2", "--actor_num_gpus_per_node", "6", "--vllm_num_engines", "1",
                 "--vllm_tensor_parallel_size", "4", "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
                 "--n_samples_per_prompt", "2", "--micro_train_batch_size", "1", "--train_batch_size", "24",
                 "--rollout_batch_size", "12", "--total_steps", "1", "--placement_timeout", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - t0 < 15 and err.count("\n") == 0, err
    assert "engine0 (1 node(s) × 4 GPU) was not granted in 3 s" in err and "16 GPU" in err, err
    assert all_gpus_free()  # nothing left reserved


@pytest.mark.timeout(300)
def test_two_ray_steps_match_the_in_process_loop(cluster, tiny_model_dir, tmp_path, capsys):
    """Same global batch (one engine: the in-process rows and seeds), two DDP ranks against one process,
    one optimizer step per RL step (the mini-batch shuffle is per rank): equal weights up to the float
    order of the all-reduce and the micro-batches (atol 1e-6)."""
    argv = tiny(tiny_model_dir, tmp_path / "ray", 2, "--train_batch_size", "16")
    assert main(argv) == 0, capsys.readouterr().err
    args = F.parser().parse_args(argv)
    cfg = load_config(None, F.overrides(args, gpus=False, total_steps=2) + [f"trainer.output_dir={tmp_path}",
                                                                            "trainer.experiment_name=inline"])
    train_grpo(cfg)
    a = load_file(tmp_path / "ray" / "checkpoints" / "global_step_2" / "model" / "model.safetensors")
    b = load_file(tmp_path / "inline" / "checkpoints" / "global_step_2" / "model" / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert any(not torch.equal(base[k], a[k]) for k in a), "the Ray run did not train"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rollout_engine_ends_the_run_with_one_line(cluster, tiny_model_dir, tmp_path):
    """kill -9 of the engine: the driver stops within 30 s, naming the role and node."""
    env = {**os.environ, "PYTHONPATH": SRC, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "alignrl", "train", "ppo-ray",
                          *tiny(tiny_model_dir, tmp_path / "kill", 500, "--init_kl_coef", "0",
                                "--actor_num_gpus_per_node", "1")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        pid = None
        for line in p.stdout:
            if "workers up:" in line:
                pid = int(line.split("rollout engine 0 on node")[1].split("(pid ")[1].split(")")[0])
            if pid and "step 1 " in line:
                break
        assert pid, "the driver never reported its workers"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    print(f"driver stopped {took:.1f} s after kill -9 of the engine")
    last = err.strip().splitlines()[-1]
    assert p.returncode == 1 and took < 30, (took, err[-2000:])
    assert "rollout engine 0 on node 127.0.0.1" in last and "died" in last, err[-2000:]
