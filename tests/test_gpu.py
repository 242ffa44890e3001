"""The CUDA paths: packed (padding-free) forwards on the GPU in fp32 and bf16, a GRPO run on the GPU in each
dtype, NCCL under torchrun, and the ZeroMQ pipeline with its sampler and trainer processes on the GPU in
bf16. Skipped without a CUDA device; the CPU paths of the same code are tested in test_packing.py,
test_runner.py, test_distributed_engines.py and test_pipeline_zmq.py."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignrl.models.logprobs import ForwardLayout, response_logprobs
from conftest import run_group, src_path
from test_actor import _shared_batch
from zmqpipeline import SMALL, finish, overrides, sampler, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(), reason="needs a bf16 GPU"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_packed_forward_on_cuda_matches_the_padded_one(tiny_model, dtype):
    model = copy.deepcopy(tiny_model[0]).to("cuda", dtype).train()
    pid, pm, rid, rm, _ = (t.cuda() for t in _shared_batch(model.config.vocab_size))
    weights = torch.randn(rm.shape, generator=torch.Generator().manual_seed(0)).cuda()
    outs = []
    for layout in (ForwardLayout(), ForwardLayout(share_prompt=True, remove_padding=True)):
        model.zero_grad()
        lp, _ = response_logprobs(model, pid, pm, rid, rm, 0.8, layout=layout)
        (lp.float() * weights).sum().backward()
        outs.append((lp.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    (lp_pad, g_pad), (lp_packed, g_packed) = outs
    tol = 2e-5 if dtype == torch.float32 else 0.1  # bf16 keeps 8 bits of mantissa: a log-prob near -6 moves ~0.03
    assert lp_packed.is_cuda and bool((lp_packed[rm] != 0).all()) and bool((lp_packed[~rm] == 0).all())
    torch.testing.assert_close(lp_packed, lp_pad, atol=tol, rtol=0)
    for a, b in zip(g_packed, g_pad):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)


def _final_weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_grpo_trains_on_cuda(tiny_model_dir, tmp_path, dtype):
    from alignrl.runner import train_grpo
    from alignrl.config import load_config

    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("needs a bf16 GPU")
    torch.cuda.reset_peak_memory_stats()
    summary = train_grpo(load_config(None, SMALL + [
        f"model.path={tiny_model_dir}", f"model.dtype={dtype}", "trainer.device=cuda", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=gpu", "trainer.total_training_steps=2", "trainer.save_freq=2"]))
    assert torch.cuda.max_memory_allocated() > 0  # the run's tensors lived on the GPU
    trained = _final_weights(tmp_path / "gpu", 2)
    base = load_file(next(Path(tiny_model_dir).glob("*.safetensors")))
    assert {v.dtype for v in trained.values()} == {getattr(torch, dtype)}
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in base)
    rows = [json.loads(x) for x in (tmp_path / "gpu" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) for r in rows)
    assert summary is not None


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one device, "
                    "and one rank makes no process group")
def test_nccl_ddp_under_torchrun(tiny_model_dir, tmp_path):
    """One rank per GPU: the ddp engine's NCCL group, its gradient all-reduce and the rank-0 metric
    reduction."""
    n = torch.cuda.device_count()
    out = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                     "-m", "alignrl", "train", "grpo", *SMALL, f"model.path={tiny_model_dir}", "trainer.device=cuda",
                     "trainer.strategy=ddp", f"data.train_batch_size={4 * n}", f"actor.ppo_mini_batch_size={2 * n}",
                     f"trainer.output_dir={tmp_path}", "trainer.experiment_name=nccl",
                     "trainer.total_training_steps=2", "trainer.save_freq=2"],
                    timeout=240, env={**os.environ, "PYTHONPATH": src_path(), "NCCL_DEBUG": "INFO"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NCCL INFO" in out.stdout + out.stderr  # the group ran on NCCL, not gloo
    assert _final_weights(tmp_path / "nccl", 2)


@pytest.mark.timeout(400)
def test_bf16_pipeline_sampler_and_trainer_on_cuda(tiny_model_dir, tmp_path):
    """Trainer and sampler processes each on the GPU, in the trainer's bf16: the sampler loads the model
    in fp32, takes model.dtype from the trainer's hello reply and maps the trainer's weights (CUDA IPC)."""
    from alignrl.runtime.ports import free_ports

    if not torch.cuda.is_bf16_supported():
        pytest.skip("needs a bf16 GPU")
    ports = free_ports(2)
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "zmq", 2, ports, "model.dtype=bfloat16",
                                                 "trainer.device=cuda", "pipeline.placement=zmq",
                                                 "pipeline.max_staleness=1", "pipeline.peer_timeout_s=120"))
    out, err = finish(trainer, sampler(tiny_model_dir, ports, "--gpu-id", "0"))
    assert "receives the weights through CUDA IPC" in out, out[-2000:]  # weight_transport=auto, one GPU
    assert "shared CUDA tensors" not in err, err[-2000:]  # the sampler let go of them before the trainer exited
    assert {v.dtype for v in _final_weights(tmp_path / "zmq", 2).values()} == {torch.bfloat16}


@pytest.mark.timeout(300)
def test_a_sampler_that_cannot_see_the_trainers_gpu_gets_frames(tiny_model_dir, tmp_path):
    """weight_transport=auto with the trainer's weights on the GPU and a sampler on the CPU (CUDA hidden from
    it): that sampler is sent frames copied off the trainer's shared device set, and the run trains."""
    from alignrl.runtime.ports import free_ports

    ports = free_ports(2)
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "cpu_sampler", 2, ports,
                                                 "trainer.device=cuda", "pipeline.placement=zmq",
                                                 "pipeline.max_staleness=1", "pipeline.peer_timeout_s=120"))
    out, _ = finish(trainer, sampler(tiny_model_dir, ports, env={"CUDA_VISIBLE_DEVICES": ""}), timeout=240)
    assert "receives the weights as frames on the sync port" in out, out[-2000:]
    assert _final_weights(tmp_path / "cpu_sampler", 2)
