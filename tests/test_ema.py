"""The policy's exponential moving average (actor.ema_beta; OpenRLHF's --enable_ema --ema_beta): moved after every
optimizer step, written to each checkpoint's ema/ folder as a loadable model, and carried on by a resumed run."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import ConfigError, load_config
from alignrl.runner import train_grpo
from alignrl.train import ema_shards
from alignrl.train.ema import PolicyAverage
from alignrl.train.ema_shards import FSDP2Shards, SavedTensors, ZeroPartitions
from smallrun import overrides, weights

EMA = ["actor.ema_beta=0.5", "actor.lr_scheduler=constant", "trainer.max_checkpoints=0"]


class Engine:
    """A one-process engine stand-in: each step adds 1 to the weights."""

    def __init__(self, is_main: bool = True):
        self.model, self.env, self.gathers = torch.nn.Linear(2, 2), SimpleNamespace(is_main=is_main), 0

    def full_state_dict(self, main_only: bool = False):
        self.gathers += 1
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
    assert engine.gathers == 0  # rank 0 reads the whole weights it holds: nothing is gathered
    other = Engine(is_main=False)  # a rank beside rank 0 of a whole-weights engine keeps no average at all
    alone = PolicyAverage(other, 0.9)
    alone.stepping(other).step()
    assert alone.average == {} and other.gathers == 0


def test_a_bf16_policy_is_averaged_from_its_fp32_master_weights():
    engine = Engine()
    engine.model.to(torch.bfloat16)
    shadow = torch.nn.Linear(2, 2)  # what train.engines.master steps: fp32 copies, paired with the model's weights
    engine.master = SimpleNamespace(pairs=list(zip(shadow.parameters(), engine.model.parameters())))
    average = PolicyAverage(engine, 0.5)
    with torch.no_grad():
        shadow.weight.add_(1e-4)  # below bf16's resolution near these weights: the bf16 model would not show it
    want = shadow.weight.detach() - 0.5e-4
    average.update()
    torch.testing.assert_close(average.average["weight"], want, rtol=0, atol=1e-7)
    assert average.average["weight"].dtype == torch.float32


def saved_full(tmp_path, full: torch.Tensor) -> SavedTensors:
    from safetensors.torch import save_file

    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    return SavedTensors([tmp_path / "model.safetensors"])


@pytest.mark.parametrize("rows,world", [(7, 3), (2, 3), (4, 3), (6, 2)])
def test_a_resume_reads_each_fsdp2_ranks_rows_as_torch_chunks_them(rows, world, tmp_path):
    from torch.distributed.tensor import Shard

    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    saved = saved_full(tmp_path, full)
    chunks = list(full.chunk(world))  # FSDP2's split; ranks past the last chunk hold none
    for rank in range(world):
        mine = chunks[rank] if rank < len(chunks) else full[:0]
        p = SimpleNamespace(placements=(Shard(0),), shape=full.shape, to_local=lambda mine=mine: mine,
                            device_mesh=SimpleNamespace(size=lambda: world, get_local_rank=lambda r=rank: r))
        assert torch.equal(FSDP2Shards().read(saved, "w", p), mine)


@pytest.mark.parametrize("shape,world", [((3, 5), 2), ((7,), 3), ((2, 2), 4)])
def test_a_resume_reads_each_zero3_ranks_flat_partition_padded(shape, world, tmp_path, monkeypatch):
    full = torch.arange(1, 1 + int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)
    saved = saved_full(tmp_path, full)
    size = -(-full.numel() // world)  # ZeRO-3's partition: the flattened weight padded to a multiple of the ranks
    padded = torch.cat([full.reshape(-1), torch.zeros(size * world - full.numel())])
    for rank in range(world):
        monkeypatch.setattr(ema_shards.dist, "get_rank", lambda group=None, r=rank: r)
        p = SimpleNamespace(ds_tensor=torch.empty(size), ds_numel=full.numel(), ds_shape=full.shape)
        assert torch.equal(ZeroPartitions().read(saved, "w", p), padded[rank * size:(rank + 1) * size])


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
