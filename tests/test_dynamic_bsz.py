"""Dynamic batch size (actor.use_dynamic_bsz, verl's use_dynamic_bsz): micro-batches made by a token budget give
the fixed-count split's gradient, fit the budget, and every rank of a launch runs as many of them."""

import copy

import torch

from alignrl.data.records import Experience
from alignrl.runtime.env import SINGLE
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.minibatch import TokenBudget, budget_split, micro_batches


def long_tailed(vocab: int, rows: int = 8, seed: int = 0) -> Experience:
    """Responses of long-tailed lengths (most short, one long), left-padded prompts, random advantages."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, 6, (rows,), generator=g)
    prompt_mask = torch.arange(5)[None] >= 5 - p_len[:, None]
    r_len = torch.tensor([2, 3, 2, 4, 3, 2, 16, 3][:rows])
    response_mask = torch.arange(16)[None] < r_len[:, None]
    prompt_ids = torch.randint(3, vocab, (rows, 5), generator=g) * prompt_mask
    response_ids = torch.randint(3, vocab, (rows, 16), generator=g) * response_mask
    old = torch.randn(rows, 16, generator=g) * response_mask - 2.0
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, 16) * response_mask
    return Experience(prompt_ids, prompt_mask, response_ids, response_mask, old, None, adv)


def _grad_after_update(model, exp, micro) -> torch.Tensor:
    m = copy.deepcopy(model)
    actor = Actor(build_engine("single", m, OptimSpec(lr=1e-3, total_steps=10, grad_clip=1.0), SINGLE))
    actor.update(exp, PolicyLossSpec(), mini_batch=len(exp), micro_batch=micro, epochs=1,
                 generator=torch.Generator().manual_seed(0))
    return torch.cat([p.grad.flatten() for p in m.parameters()])  # the step's accumulated gradient stays in .grad


def test_a_token_budget_gives_the_fixed_splits_gradient(tiny_model):
    model, _ = tiny_model
    exp = long_tailed(model.config.vocab_size)
    fixed = _grad_after_update(model, exp, 2)
    for budget in (21, 40, 200):  # the long row alone, a few rows, everything in one micro-batch
        dynamic = _grad_after_update(model, exp, TokenBudget(budget))
        scale = fixed.abs().max()
        torch.testing.assert_close(dynamic / scale, fixed / scale, atol=1e-5, rtol=0)


def test_micro_batches_fit_the_budget_and_cover_every_row():
    exp = long_tailed(100)
    rows = torch.arange(len(exp))
    chunks = micro_batches(rows, exp, TokenBudget(24), None, SINGLE)
    assert sorted(torch.cat(chunks).tolist()) == rows.tolist()
    length = exp.prompt_mask.sum(-1) + exp.response_mask.sum(-1)
    for c in chunks:  # padded size within the budget, except a row that alone exceeds it
        assert len(c) * int(length[c].max()) <= 24 or len(c) == 1
    assert len(chunks) < len(exp)  # short rows share micro-batches; a count of 1 would make 8


def test_budget_split_by_hand():
    order = torch.arange(5)
    assert [c.tolist() for c in budget_split(order, [2, 2, 3, 3, 9], 8)] == [[0, 1], [2, 3], [4]]
    assert [c.tolist() for c in budget_split(order, [1, 1, 1, 1, 1], 100)] == [[0, 1, 2, 3, 4]]
    assert budget_split(order[:0], [], 10) == []


def test_a_rank_with_fewer_micro_batches_splits_to_the_launchs_count(monkeypatch):
    """Another rank needs 5 micro-batches: this one splits its largest until it runs 5 too (ZeRO-3 gathers the
    weights at every forward, so the ranks' forwards must pair up)."""
    from alignrl.train import minibatch

    monkeypatch.setattr(minibatch, "all_reduce_sum", lambda env, values, op=None: [5.0])
    exp = long_tailed(100)
    chunks = micro_batches(torch.arange(len(exp)), exp, TokenBudget(200), None, SINGLE)
    assert len(chunks) == 5 and all(len(c) for c in chunks)
    assert sorted(torch.cat(chunks).tolist()) == list(range(len(exp)))
