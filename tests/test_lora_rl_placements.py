"""LoRA adapters and frozen prefixes in the placements whose rollout engines hold their own plain model: the ZeroMQ
samplers and Ray's rollout engines (test_ray_runs, on that module's Ray cluster) receive the merged weights (after the
first publish only the parameters a step changes) and make the batches the in-process loop makes."""

import pytest
import torch
from safetensors.torch import load_file

from alignrl.config import load_config
from alignrl.runner import train_grpo
from alignrl.runtime.ports import free_ports
from zmqpipeline import finish, overrides, sampler, spawn, weights

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2", "actor.entropy_coeff=0.05"]
FREEZE = ["actor.freeze_prefix=[model.embed_tokens,model.layers.0]", "actor.entropy_coeff=0.05"]


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("what, extra, transport", [
    ("lora", LORA + ["actor.use_kl_loss=true", "pipeline.ref_logprobs=trainer"], "zmq"),  # ref: adapters off
    ("freeze", FREEZE, "shared")])
def test_zmq_samplers_generate_from_the_merged_weights(tiny_model_dir, tmp_path, what, extra, transport):
    """k = 0, one sampler: the sampler's plain model, fed the merged (or the unfrozen) weights, makes the batches
    the in-process loop makes from the trained model itself, so the runs end at the same weights. The in-process
    loop generates through the adapters (x·W + s·x·A·B), the sampler through the merged W + s·B·A: float rounding
    apart, the same model (tolerance 1e-5 against a step of ~1e-2 per weight). Frozen: the entropy bonus's sums
    differ in their last bits between a sampler's forward and the trainer's (as without a frozen prefix), 1e-6."""
    ports = free_ports(2)
    steps = 2  # step 2's batch is the one the sampler made from the weights step 1 trained
    extra = [*extra, "trainer.save_freq=1"]
    train_grpo(load_config(None, overrides(tiny_model_dir, tmp_path, "inline", steps, ports, *extra)))
    trainer = spawn("train", "grpo", *overrides(tiny_model_dir, tmp_path, "zmq", steps, ports, *extra,
                                                 "pipeline.placement=zmq", "pipeline.peer_timeout_s=120",
                                                 f"pipeline.weight_transport={transport}"))
    finish(trainer, sampler(tiny_model_dir, ports))
    a, b = weights(tmp_path / "inline", steps), weights(tmp_path / "zmq", steps)
    base = weights(tmp_path / "inline", 1)
    assert any(not torch.equal(a[k], base[k]) for k in a), "step 2 trained nothing"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6 if what == "freeze" else 1e-5, msg=k)
    if what == "freeze":
        first = load_file(tiny_model_dir / "model.safetensors")  # the frozen part never moved
        frozen = [k for k in first if k.startswith(("model.embed_tokens", "model.layers.0"))]
        assert frozen and all(torch.equal(first[k], b[k]) for k in frozen)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_generation_service_is_pushed_the_merged_weights(model_services, tiny_model_dir, tmp_path):
    """services.generation_url with LoRA: every push (the start-up one and one a step) carries the whole plain model
    with the adapters merged in, under its own names; after the run the service generates as the merged checkpoint
    does locally."""
    from alignrl.models.loader import load_model
    from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
    from alignrl.rollout.remote import RemoteRolloutEngine

    gen, _ = model_services
    cfg = load_config(None, overrides(tiny_model_dir, tmp_path, "http", 2, free_ports(2), *LORA) + [
        f"services.generation_url={gen.url}", "trainer.save_freq=1"])
    train_grpo(cfg)
    merged_dir = tmp_path / "http" / "checkpoints" / "global_step_2" / "model"
    model, tok = load_model(str(merged_dir))
    base = weights(tmp_path / "http", 2)
    assert any(not torch.equal(base[k], v) for k, v in load_file(tiny_model_dir / "model.safetensors").items())
    probe = [tok.encode("12 + 7 ="), tok.encode("3 * 4 =")]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    local = HFRolloutEngine(model, tok).generate(probe, greedy)
    served = RemoteRolloutEngine(gen.url, tok).generate(probe, greedy)
    assert torch.equal(local.response_ids, served.response_ids)
    torch.testing.assert_close(served.logprobs, local.logprobs, rtol=0, atol=1e-4)
