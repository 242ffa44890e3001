"""The policy's exponential moving average (actor.ema_beta; OpenRLHF's --enable_ema --ema_beta): moved after every
optimizer step, written to each checkpoint's ema/ folder as a loadable model, and carried on by a resumed run."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError, load_config
from alignrl.runner import train_grpo
from alignrl.train.ema import PolicyAverage
from smallrun import overrides, weights

EMA = ["actor.ema_beta=0.5", "actor.lr_scheduler=constant", "trainer.max_checkpoints=0"]


class Engine:
    """A one-process engine stand-in: each step adds 1 to the weights."""

    def __init__(self):
        self.model, self.env = torch.nn.Linear(2, 2), SimpleNamespace(is_main=True)

    def full_state_dict(self, main_only: bool = False):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def step(self, skip: bool = False) -> float:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        return 0.0


def test_every_optimizer_step_moves_the_average_by_one_minus_beta():
    engine = Engine()
    start = engine.model.weight.detach().clone()
    average = PolicyAverage(engine, 0.9)
    stepping = average.stepping(engine)
    want = start.clone()
    for k in range(1, 4):
        stepping.step()
        want = 0.9 * want + 0.1 * (start + k)
        torch.testing.assert_close(average.average["weight"], want)
    assert stepping.model is engine.model  # everything else is the engine's


def test_checkpoints_hold_the_average_and_a_resume_carries_it_on(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # the policy as each update of the average sees it: 16 sequences a step in mini-batches of 2 prompts × 4, so two
    # optimizer steps (and updates) to each RL step, the intermediate policy in no checkpoint
    seen, update = [], PolicyAverage.update

    def record(self):  # a copy: a one-process engine's state dict is the model's own tensors
        seen.append({k: v.clone() for k, v in self.engine.full_state_dict().items()})
        update(self)

    monkeypatch.setattr(PolicyAverage, "update", record)
    assert train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "straight", 3, 1) + EMA))["steps"] == 3
    monkeypatch.undo()
    run = tmp_path / "straight"
    assert len(seen) == 6  # every optimizer step's update, then a checkpoint after each second one
    assert all(torch.equal(seen[2 * s - 1][k], v) for s in (1, 3) for k, v in weights(run, s).items())
    want = load_file(tiny_model_dir / "model.safetensors")  # the average starts at the base weights
    for policy in seen:
        want = {k: 0.5 * v.float() + 0.5 * policy[k].float() for k, v in want.items()}
    for k, v in load_file(run / "checkpoints" / "global_step_3" / "ema" / "model.safetensors").items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6)
    ema = run / "checkpoints" / "global_step_3" / "ema"
    loaded = AutoModelForCausalLM.from_pretrained(str(ema))  # a model folder of its own, tokenizer beside it
    assert (ema / "tokenizer_config.json").is_file() and loaded.dtype == torch.float32
    policy, average = weights(run, 3), load_file(ema / "model.safetensors")
    assert any(not torch.equal(policy[k].float(), average[k]) for k in average)  # the average trails the policy
    train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "resumed", 2, 2) + EMA))
    train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "resumed", 3, 3) + EMA))
    resumed = load_file(tmp_path / "resumed" / "checkpoints" / "global_step_3" / "ema" / "model.safetensors")
    assert resumed.keys() == average.keys() and all(torch.equal(resumed[k], average[k]) for k in average)


def test_openrlhfs_flags_and_the_lora_refusal():
    from alignrl.compat import openrlhf_keys as K
    from alignrl.compat.openrlhf_flags import parser

    args = parser().parse_args(["--enable_ema", "--ema_beta", "0.99"])
    assert "actor.ema_beta=0.99" in K.overrides(args, gpus=False, total_steps=5)
    assert not any("ema" in line for line in K.unused_here(args, gpus=False))
    plain = parser().parse_args(["--ema_beta", "0.99"])  # without --enable_ema, OpenRLHF keeps no average
    assert not any(o.startswith("actor.ema_beta") for o in K.overrides(plain, gpus=False, total_steps=5))
    with pytest.raises(ConfigError, match="actor.ema_beta averages all the policy's weights"):
        load_config(None, ["actor.ema_beta=0.99", "model.lora_rank=4"])
