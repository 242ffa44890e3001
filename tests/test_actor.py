"""The actor's update moves probability toward positive advantages, and accumulation is exact."""

import copy

import torch

from alignrl.core.advantages import grpo_advantages
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.records import Experience
from alignrl.models.logprobs import ForwardLayout, response_logprobs
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.runtime.env import SINGLE
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


def _shared_batch(vocab: int, resp_len: int = 7):
    """3 prompts x 4 samples in shuffled order, ragged left-padded prompts and right-padded responses."""
    g = torch.Generator().manual_seed(3)
    p_len = torch.tensor([3, 6, 6])
    prompts = torch.randint(3, vocab, (3, 6), generator=g) * (torch.arange(6)[None] >= 6 - p_len[:, None])
    rows = torch.randperm(12, generator=g) % 3
    r_len = torch.randint(1, resp_len + 1, (12,), generator=g)
    response_mask = torch.arange(resp_len)[None] < r_len[:, None]
    response_ids = torch.randint(3, vocab, (12, resp_len), generator=g) * response_mask
    return prompts[rows], prompts[rows] != 0, response_ids, response_mask, rows


def test_shared_prompt_forward_matches_one_pass(tiny_model):
    from alignrl.rl.producer import batched_logprobs

    model, _ = tiny_model
    model = copy.deepcopy(model).train()
    for resp_len in (7, 1):  # 1: the prompt's last logits are all the loss needs; the second call is made anyway
        pid, pm, rid, rm, rows = _shared_batch(model.config.vocab_size, resp_len)
        batches = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True)
        weights = torch.randn(rm.shape, generator=torch.Generator().manual_seed(0))
        out = {}
        for share in (False, True):
            model.zero_grad()
            lp, ent = response_logprobs(model, pid, pm, rid, rm, 0.8, with_entropy=True, layout=ForwardLayout(share))
            (lp * weights).sum().backward()
            out[share] = lp.detach(), ent, [p.grad.clone() for p in model.parameters()]
        hook.remove()
        assert batches == [12, 3, 12]  # one-pass, then shared: the prompts once, then the responses
        torch.testing.assert_close(out[True][0], out[False][0], atol=2e-5, rtol=0)
        torch.testing.assert_close(out[True][1], out[False][1], atol=2e-5, rtol=0)
        for a, b in zip(out[True][2], out[False][2]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert bool((out[True][0] != 0).any())
        # the no-grad path (reference, old policy) in chunks of 5 rows: same log-probs
        torch.testing.assert_close(batched_logprobs(model, pid, pm, rid, rm, 0.8, 5, ForwardLayout(True)),
                                   batched_logprobs(model, pid, pm, rid, rm, 0.8, 5), atol=2e-5, rtol=0)
    # every rank must make the same calls (FSDP2 / ZeRO-3 gather weights in each): two, even when no prompt
    # repeats and the responses are one token wide
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    one_each = torch.tensor([rows.tolist().index(k) for k in range(3)])  # a row of each of the 3 prompts
    with torch.no_grad():
        response_logprobs(model, pid[one_each], pm[one_each], rid[one_each, :1], rm[one_each, :1],
                          layout=ForwardLayout(True))
    hook.remove()
    assert [c[0] for c in calls] == [3, 3]


def test_prompt_groups_and_chunks_keep_a_prompt_together():
    from alignrl.data.collate import length_sorted_chunks, prompt_groups

    pid, pm, _, rm, rows = _shared_batch(100)
    first, inverse = prompt_groups(pid, pm)
    assert len(first) == 3 and torch.equal(pid[first][inverse], pid)
    assert all(len(set(rows[inverse == k].tolist())) == 1 for k in range(3))  # a group is one source prompt
    chunks = length_sorted_chunks(torch.arange(12), pm, rm, 4, inverse)
    assert sorted(torch.cat(chunks).tolist()) == list(range(12))
    assert [len(set(rows[c].tolist())) for c in chunks] == [1, 1, 1]  # 4 samples of a prompt per chunk
    # without prompt ids: ordered by real length only, as before
    plain = torch.cat(length_sorted_chunks(torch.arange(12), pm, rm, 4))
    lengths = (pm.sum(-1) + rm.sum(-1))[plain]
    assert bool((lengths[1:] >= lengths[:-1]).all())


def test_by_prompt_shuffle_keeps_a_prompts_samples_in_one_mini_batch():
    from alignrl.data.collate import prompt_groups
    from alignrl.train.minibatch import shuffled_rows

    pid, pm, rid, rm, rows = _shared_batch(100)
    group = prompt_groups(pid, pm)[1]
    orders = [shuffled_rows(12, torch.Generator().manual_seed(s), group) for s in range(4)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(12))
        assert [len(set(rows[mb].tolist())) for mb in order.split(4)] == [1, 1, 1]  # mini-batches of 4: one prompt
    assert len({tuple(rows[o].tolist()) for o in orders}) > 1  # the prompts' order is random


def test_share_prompt_with_a_model_that_returns_no_cache_is_one_line(tiny_model):
    import pytest

    from alignrl.models.folder import ModelError

    model, _ = tiny_model

    class NoCache(torch.nn.Module):  # a custom model whose forward ignores use_cache
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, **kw):
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(logits=self.inner(**kw).logits)  # the logits alone, no cache

    pid, pm, rid, rm, _ = _shared_batch(model.config.vocab_size)
    with pytest.raises(ModelError, match="set actor.share_prompt=false"):
        response_logprobs(NoCache(), pid, pm, rid, rm, layout=ForwardLayout(True))
