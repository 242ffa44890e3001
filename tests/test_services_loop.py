"""GRPO driven by service URLs: generation and reference servers as subprocesses on loopback, a
config in seed 000's nodes.yaml layout, weights pushed to the generation server after every step."""

import json

import httpx
import pytest
import torch
import yaml

from alignrl.runner import train_grpo
from alignrl.config import load_config
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.rollout.remote import RemoteRolloutEngine, ServiceError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2.0
'''


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


def test_grpo_through_generation_and_reference_services(model_services, tiny_model, tiny_model_dir, tmp_path):
    gen, ref = model_services
    model, tok = tiny_model
    remote = RemoteRolloutEngine(gen.url, tok)
    probe = [tok.encode("12 + 7 =")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    # the base model's own answer (the shared service may hold another test's trained weights until this run's
    # start-up push)
    before, v0 = HFRolloutEngine(model, tok).generate(probe, greedy), remote.weight_version()
    ref_calls = httpx.get(ref.url + "/v1/stats").json()["requests"]

    cfg = load_config(nodes_yaml(tmp_path, tiny_model_dir, gen.url, ref.url, steps=3))
    assert cfg.services.generation_url == gen.url and cfg.model.path == str(tiny_model_dir)
    summary = train_grpo(cfg)

    assert summary["steps"] == 3
    v1 = remote.weight_version()
    assert v1 >= v0 + 4  # the start-up push plus one push per step
    after = remote.generate(probe, greedy)
    changed = (not torch.equal(before.response_ids, after.response_ids)
               or not torch.allclose(before.logprobs, after.logprobs, atol=2e-3))  # served vs local: ~1e-5
    assert changed, "the served model did not change with the pushed weights"
    print(f"greedy log-probs moved by {float((before.logprobs - after.logprobs).abs().max()):.1e}")
    assert httpx.get(ref.url + "/v1/stats").json()["requests"] > ref_calls  # reference log-probs came from it
    out = tmp_path / "output"  # the seed's layout: output/checkpoints, output/logs
    assert (out / "checkpoints" / "global_step_3" / "model" / "model.safetensors").is_file()
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/kl_loss" in r] == [1, 2, 3]


def test_dead_generation_service_is_a_one_line_error_naming_the_url(tiny_model_dir, tmp_path):
    from alignrl.runtime.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    cfg = load_config(nodes_yaml(tmp_path, tiny_model_dir, dead, dead, steps=1),
                      ["services.retries=2", "services.timeout_s=2"])
    with pytest.raises(ServiceError) as e:
        train_grpo(cfg)
    msg = str(e.value)
    assert dead in msg and "\n" not in msg
