"""Padding-free (packed) forwards: the same log-probs, entropy and gradients as the padded forward, one model call
per micro-batch, and one-line errors for models that cannot run packed."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from alignrl.rl.producer import batched_logprobs
from alignrl.data.collate import prompt_groups
from alignrl.models.folder import ModelError
from alignrl.models.logprobs import ForwardLayout, response_logprobs
from alignrl.models.packing import pack
from alignrl.train.actor import PolicyLossSpec
from test_actor import _actor, _experience, _shared_batch

PACKED = (ForwardLayout(remove_padding=True), ForwardLayout(share_prompt=True, remove_padding=True))


def _outputs(model, batch, layout, weights):
    pid, pm, rid, rm = batch
    model.zero_grad()
    lp, ent = response_logprobs(model, pid, pm, rid, rm, 0.8, with_entropy=True, layout=layout)
    (lp * weights).sum().backward()
    return lp.detach(), ent, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", PACKED, ids=["rows", "shared-prompts"])
def test_packed_forward_matches_the_padded_one_in_one_call(tiny_model, layout):
    model = copy.deepcopy(tiny_model[0]).train()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention covered
    for resp_len in (7, 1):
        pid, pm, rid, rm, _ = _shared_batch(model.config.vocab_size, resp_len)
        weights = torch.randn(rm.shape, generator=torch.Generator().manual_seed(0))
        expected = _outputs(model, (pid, pm, rid, rm), ForwardLayout(), weights)
        shapes = []
        hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
        got = _outputs(model, (pid, pm, rid, rm), layout, weights)
        hook.remove()
        prompt_tokens = pm[prompt_groups(pid, pm)[0]].sum() if layout.share_prompt else pm.sum()
        assert shapes == [(1, int(prompt_tokens + rm.sum()))]  # one call, no padding token in it
        torch.testing.assert_close(got[0], expected[0], atol=2e-5, rtol=0)
        torch.testing.assert_close(got[1], expected[1], atol=2e-5, rtol=0)
        for a, b in zip(got[2], expected[2]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert bool((got[0] != 0).any()) and bool((got[0][~rm] == 0).all())
        torch.testing.assert_close(batched_logprobs(model, pid, pm, rid, rm, 0.8, 5, layout),
                                   batched_logprobs(model, pid, pm, rid, rm, 0.8, 5), atol=2e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"  # the routing lasts one call


def test_packed_update_takes_the_padded_gradient(tiny_model):
    model, tok = tiny_model
    exp = _experience(model, tok, [1.0, 0.0, 0.5, 0.0])
    grads = []
    for layout in (ForwardLayout(), ForwardLayout(share_prompt=True, remove_padding=True)):
        m = copy.deepcopy(model)
        actor = _actor(m, lr=1e-3)
        actor.layout = layout
        actor.update(exp, PolicyLossSpec(), mini_batch=4, micro_batch=2, epochs=1,
                     generator=torch.Generator().manual_seed(0))
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    scale = grads[0].abs().max()
    torch.testing.assert_close(grads[1] / scale, grads[0] / scale, atol=1e-5, rtol=0)


def test_pack_layout_of_shared_prompts():
    """Two rows of one prompt (2 real tokens of 3) and a row of another: the prompt is packed once, each response
    attends to it and causally to itself, and the first response token is predicted by the prompt's last token."""
    pid = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    pm = pid != 0
    rid = torch.tensor([[11, 12], [13, 0], [14, 15]])
    rm = rid != 0
    p = pack(pid, pm, rid, rm, prompt_groups(pid, pm))
    first_prompt = 0 if p.input_ids[0, 0] == 5 else 3  # where prompt [5, 6] went among the packed prompts
    packed = p.input_ids[0].tolist()
    assert sorted(packed[:5]) == [5, 6, 7, 8, 9] and packed[5:] == [11, 12, 13, 14, 15]
    assert p.position_ids[0, 5:].tolist() == [2, 3, 2, 3, 4]  # after 2, 2 and 3 prompt tokens
    assert p.targets.tolist() == [11, 12, 13, 14, 15]
    assert p.keep.tolist()[:3] == [first_prompt + 1, 5, first_prompt + 1]  # token 6, token 11, token 6
    sees = {}  # packed token -> the packed tokens it attends to, read off the buckets' slots
    for bucket in p.buckets:
        for s, row in enumerate(bucket.q_index.tolist()):
            for j, token in enumerate(row):
                sees.setdefault(token, []).append([packed[k] for k in bucket.k_index[s][bucket.mask[s, 0, j]].tolist()])
    assert sees[6] == [[5, 6, 11, 12]]  # response token 12: its prompt, then causally itself
    assert sees[7] == [[5, 6, 13]] and sees[9] == [[7, 8, 9, 14, 15]]
    assert sees[first_prompt + 1] == [[5, 6]]  # the prompt's last token sees only its prompt, once


def test_a_model_whose_attention_does_not_dispatch_is_one_line(tiny_model):
    model = tiny_model[0]

    class Ignores(torch.nn.Module):  # a custom model that drops what it does not know
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, packing=None, **kw):
            return self.inner(**kw)

    pid, pm, rid, rm, _ = _shared_batch(model.config.vocab_size)
    with pytest.raises(ModelError, match="cannot run packed: set actor.use_remove_padding=false"):
        response_logprobs(Ignores(), pid, pm, rid, rm, layout=PACKED[1])
    with pytest.raises(ModelError, match="need a transformers model"):
        response_logprobs(torch.nn.Linear(2, 2), pid, pm, rid, rm, layout=PACKED[0])
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=0,
                                           layer_types=["sliding_attention"]))
    with pytest.raises(ModelError, match=r"longer than the sliding_window \(4\): set actor.use_remove_padding=false"):
        response_logprobs(sliding, pid % 64, pm, rid % 64, rm, layout=PACKED[0])
    ids, one = torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.bool)  # 3 tokens: within the window
    torch.testing.assert_close(response_logprobs(sliding, ids, one, ids[:, :1] + 2, one[:, :1], layout=PACKED[0])[0],
                               response_logprobs(sliding, ids, one, ids[:, :1] + 2, one[:, :1])[0], atol=2e-5, rtol=0)
    assert sliding.config._attn_implementation == "sdpa"  # restored after the error too


def test_packed_values_match_the_padded_ones(tiny_model_dir):
    from alignrl.models.value import load_value_model, response_values

    critic = load_value_model(str(tiny_model_dir), log=lambda *_: None).train()
    pid, pm, rid, rm, _ = _shared_batch(critic.config.vocab_size)
    weights = torch.randn(rm.shape, generator=torch.Generator().manual_seed(1))
    out = []
    for packed in (False, True):
        critic.zero_grad()
        v = response_values(critic, pid, pm, rid, rm, remove_padding=packed)
        (v * weights).sum().backward()
        out.append((v.detach(), [p.grad.clone() for p in critic.parameters() if p.grad is not None]))
    torch.testing.assert_close(out[1][0], out[0][0], atol=2e-5, rtol=0)
    assert bool((out[1][0] != 0).any()) and len(out[1][1]) == len(out[0][1])
    for a, b in zip(out[1][1], out[0][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
