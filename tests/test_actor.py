"""The actor's update moves probability toward positive advantages, and accumulation is exact."""

import copy

import torch

from alignrl.core.advantages import grpo_advantages
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.records import Experience
from alignrl.models.logprobs import response_logprobs
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.dist.env import SINGLE
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine


def _experience(model, tok, rewards):
    prompts = encode_prompts(tok, synthetic.generate("train", 1, seed=0), 64)
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=len(rewards), max_new_tokens=6, seed=0))
    adv = grpo_advantages(torch.tensor(rewards), ro.group)
    return Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, ro.logprobs, None, adv)


def _actor(model, lr=1e-2):
    return Actor(build_engine("single", model, OptimSpec(lr=lr, total_steps=10, grad_clip=1.0), SINGLE))


def _seq_logp(model, exp):
    with torch.no_grad():
        lp, _ = response_logprobs(model, exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask)
    return lp.sum(-1)


def test_update_raises_rewarded_and_lowers_unrewarded(tiny_model):
    model, tok = tiny_model
    model = copy.deepcopy(model)
    exp = _experience(model, tok, [1.0, 0.0, 0.0, 1.0])
    before = _seq_logp(model, exp)
    _actor(model).update(exp, PolicyLossSpec(), mini_batch=4, micro_batch=4, epochs=1,
                         generator=torch.Generator().manual_seed(0))
    delta = _seq_logp(model, exp) - before
    assert delta[0] > 0 and delta[3] > 0 and delta[1] < 0 and delta[2] < 0


def test_micro_batch_split_gives_identical_gradient(tiny_model):
    model, tok = tiny_model
    exp = _experience(model, tok, [1.0, 0.0, 0.5, 0.0])
    results = []
    for micro in (4, 2, 1):
        m = copy.deepcopy(model)
        _actor(m, lr=1e-3).update(exp, PolicyLossSpec(), mini_batch=4, micro_batch=micro, epochs=1,
                                  generator=torch.Generator().manual_seed(0))
        # the accumulated (token-mean over the whole mini-batch) gradient stays in .grad after the step
        results.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    scale = results[0].abs().max()
    torch.testing.assert_close(results[0] / scale, results[1] / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(results[0] / scale, results[2] / scale, atol=1e-5, rtol=0)
