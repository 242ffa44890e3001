"""GRPO driven by service URLs: generation and reference servers as subprocesses on loopback, a
config in seed 000's nodes.yaml layout, weights pushed to the generation server after every step."""

import json
import sys

import httpx
import pytest
import torch
import yaml

from alignrl.algos.runner import train_grpo
from alignrl.config import load_config
from alignrl.rollout.hf_engine import SamplingParams
from alignrl.rollout.remote import RemoteRolloutEngine, ServiceError
from alignrl.serve.common import ServiceProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2.0
'''


@pytest.fixture(scope="module")
def services(tiny_model_dir):
    with ServiceProcess(["generate", "--model", str(tiny_model_dir)]) as gen, \
            ServiceProcess(["ref", "--model", str(tiny_model_dir)]) as ref:
        yield gen, ref


def nodes_yaml(tmp_path, tiny_model_dir, gen_url, ref_url, steps=3):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = {
        "training": {"master_node": "127.0.0.1", "master_port": 29500,
                     "services": {"generation": {"url": gen_url}, "reference": {"url": ref_url}}},
        "models": {"base_path": str(tiny_model_dir.parent),
                   "train": {"name": "tiny", "path": str(tiny_model_dir)},
                   "output": {"path": str(tmp_path / "output"), "checkpoint_dir": "checkpoints", "log_dir": "logs"}},
        # the rest is ordinary alignrl config
        "data": {"train_size": 64, "val_size": 8, "val_size_during_training": 8, "train_batch_size": 4},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "actor": {"ppo_mini_batch_size": 4, "lr": 3e-3, "use_kl_loss": True, "kl_loss_coef": 0.01},
        "algorithm": {"reward_fn": f"{reward}:compute_score"},
        "trainer": {"total_training_steps": steps, "test_freq": 0, "save_freq": 1, "progress_bar": False},
        "services": {"timeout_s": 60, "retries": 2},
    }
    path = tmp_path / "nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_grpo_through_generation_and_reference_services(services, tiny_model, tiny_model_dir, tmp_path):
    gen, ref = services
    _, tok = tiny_model
    remote = RemoteRolloutEngine(gen.url, tok)
    probe = [tok.encode("12 + 7 =")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    before, v0 = remote.generate(probe, greedy), remote.weight_version()
    ref_calls = httpx.get(ref.url + "/v1/stats").json()["requests"]

    cfg = load_config(nodes_yaml(tmp_path, tiny_model_dir, gen.url, ref.url, steps=3))
    assert cfg.services.generation_url == gen.url and cfg.model.path == str(tiny_model_dir)
    summary = train_grpo(cfg)

    assert summary["steps"] == 3
    v1 = remote.weight_version()
    assert v1 >= v0 + 4  # the start-up push plus one push per step
    after = remote.generate(probe, greedy)
    changed = (not torch.equal(before.response_ids, after.response_ids)
               or not torch.allclose(before.logprobs, after.logprobs, atol=1e-4))
    assert changed, "the served model did not change with the pushed weights"
    assert httpx.get(ref.url + "/v1/stats").json()["requests"] > ref_calls  # reference log-probs came from it
    out = tmp_path / "output"  # the seed's layout: output/checkpoints, output/logs
    assert (out / "checkpoints" / "global_step_3" / "model" / "model.safetensors").is_file()
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/kl_loss" in r] == [1, 2, 3]


def test_dead_generation_service_is_a_one_line_error_naming_the_url(tiny_model_dir, tmp_path):
    from alignrl.dist.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    cfg = load_config(nodes_yaml(tmp_path, tiny_model_dir, dead, dead, steps=1),
                      ["services.retries=2", "services.timeout_s=2"])
    with pytest.raises(ServiceError) as e:
        train_grpo(cfg)
    msg = str(e.value)
    assert dead in msg and "\n" not in msg


def test_seed_launcher_trains_zero3_on_two_ranks_through_the_services(services, tiny_model_dir, tmp_path):
    """Seed 000 end to end: nodes.yaml + hostfile + config/deepspeed/zero3.json, ./scripts/launch_distributed.sh."""
    import os
    import subprocess
    from pathlib import Path

    from alignrl.dist.launch import free_port

    gen, ref = services
    root = Path(__file__).resolve().parents[1]
    path = nodes_yaml(tmp_path, tiny_model_dir, gen.url, ref.url, steps=2)
    cfg = yaml.safe_load(path.read_text())
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# node slots\nlocalhost slots=2\n")
    cfg["training"].update({"master_port": free_port(), "hostfile": str(hostfile)})
    cfg["trainer"].update({"strategy": "deepspeed", "deepspeed_config": str(root / "config/deepspeed/zero3.json")})
    path.write_text(yaml.safe_dump(cfg))
    v0 = httpx.get(gen.url + "/v1/weight_version").json()["weight_version"]
    env = {**os.environ, "CONFIG": str(path), "ALIGNRL": sys.executable.replace("python", "alignrl"),
           "OMP_NUM_THREADS": "1", "ALIGNRL_DIST_TIMEOUT": "60"}
    r = subprocess.run(["bash", str(root / "scripts/launch_distributed.sh")], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "nodes=1 node_rank=0 procs_per_node=2" in r.stdout and "strategy deepspeed" in r.stdout
    assert httpx.get(gen.url + "/v1/weight_version").json()["weight_version"] >= v0 + 3
    out = tmp_path / "output"
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
    assert (out / "checkpoints" / "global_step_2" / "model" / "model.safetensors").is_file()
