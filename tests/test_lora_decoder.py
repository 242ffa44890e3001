"""The in-process engine's fast decoder (`rollout.decoder.KVDecoder`) on a policy with LoRA adapters: it decodes on
the projections' weights with the adapters' deltas added, without touching the model's parameters, and samples
what the merged plain model samples."""

import copy
import json

import pytest
import torch

from alignrl.interfaces import SamplingParams
from alignrl.models.loader import load_model
from alignrl.models.lora import LoraSpec, add_adapters
from alignrl.rollout import decoder
from alignrl.rollout.hf_engine import HFRolloutEngine

PROMPTS = [[5, 17, 33, 2, 9], [40, 8], [12, 12, 7, 3]]


def _with_adapters(model_dir, spec: LoraSpec):
    """The tiny model with adapters whose B matrices are random (peft starts them at zero: no delta)."""
    model, tokenizer = load_model(str(model_dir))
    torch.manual_seed(0)
    wrapped = add_adapters(model, spec)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return wrapped.eval(), tokenizer


def _generate(model, tokenizer, params):
    return HFRolloutEngine(model, tokenizer).generate(PROMPTS, params)


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7),
                                    SamplingParams(n=1, temperature=0.0, max_new_tokens=10)])
def test_lora_policy_decodes_fast_as_the_merged_model(tiny_model_dir, params, monkeypatch):
    wrapped, tokenizer = _with_adapters(tiny_model_dir, LoraSpec(rank=4, alpha=8, target_modules="all-linear"))
    assert decoder.KVDecoder.supports(wrapped)
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    made = []
    monkeypatch.setattr(decoder.KVDecoder, "step", _counting(decoder.KVDecoder.step, made))
    got = _generate(wrapped, tokenizer, params)
    assert made, "the LoRA policy did not use the fast decoder"
    for k, v in wrapped.state_dict().items():  # the adapters were added into new tensors, never into the weights
        assert torch.equal(v, before[k]), k
    merged = copy.deepcopy(wrapped).merge_and_unload()
    want = _generate(merged, tokenizer, params)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    # and the adapters changed what is generated (a zero delta would make the comparison empty)
    plain = _generate(load_model(str(tiny_model_dir))[0].eval(), tokenizer, params)
    assert not torch.allclose(plain.logprobs, want.logprobs, atol=1e-3)


def _counting(step, calls: list):
    def counted(self, tokens):
        calls.append(len(tokens))
        return step(self, tokens)
    return counted


def test_lora_variants_and_disabled_merged_adapters_take_the_model_forward(tiny_model_dir):
    wrapped, tokenizer = _with_adapters(tiny_model_dir, LoraSpec(rank=4, target_modules=("q_proj", "down_proj")))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    merged = copy.deepcopy(wrapped).merge_and_unload()
    wrapped.merge_adapter()  # merged in place: the base weight holds the delta, which is not added twice
    assert decoder.KVDecoder.supports(wrapped)
    assert torch.equal(_generate(wrapped, tokenizer, params).response_ids,
                       _generate(merged, tokenizer, params).response_ids)
    with wrapped.disable_adapter():  # its forward unmerges first: only the model's own forward knows that
        assert not decoder.KVDecoder.supports(wrapped)
    wrapped.unmerge_adapter()
    layer = wrapped.get_base_model().model.layers[0].self_attn.q_proj
    layer.lora_variant["default"] = object()  # DoRA and the other variants compute more than base + B·A
    assert not decoder.KVDecoder.supports(wrapped)


@pytest.mark.timeout(300)
def test_lora_grpo_step_samples_what_the_trainer_scores(tiny_model_dir, tmp_path):
    """The engine's log-probs (fast decoder on base + deltas) are the trainer's recomputation through the adapters."""
    from alignrl.config import load_config
    from alignrl.runner import train_grpo

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                             "trainer.experiment_name=lora", "trainer.total_training_steps=2", "data.train_size=16",
                             "data.val_size=4", "data.train_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=6",
                             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4", "actor.lr=1e-2",
                             "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
                             "trainer.logger=[jsonl]", "model.lora_rank=4", "model.lora_alpha=8"])
    train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "lora" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/kl_vs_trainer" in r]
    # step 2 generates after an update moved the adapters: the decoder read the new deltas
    assert len(steps) == 2 and all(abs(r["rollout/kl_vs_trainer"]) < 1e-5 for r in steps), steps


def test_a_lora_policys_kv_cache_goes_by_its_models_own_argument_name(tiny_model_dir):
    """peft's forward takes any keyword and hands it on: the cache's name is the wrapped model's (transformers 5.2x
    warns at every call that still uses `past_key_values`), under a DDP-style `module` wrapper too."""
    import inspect

    from alignrl.models.kv_cache import cache_arg

    wrapped, _ = _with_adapters(tiny_model_dir, LoraSpec(rank=4, alpha=8, target_modules="all-linear"))
    base = wrapped.get_base_model()
    name = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
    holder = torch.nn.Module()
    holder.module = wrapped
    assert cache_arg(wrapped, 1) == cache_arg(holder, 1) == {name: 1}
