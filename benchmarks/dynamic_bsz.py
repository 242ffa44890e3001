#!/usr/bin/env python
"""Seconds per actor update: micro-batches by a token budget (actor.use_dynamic_bsz) vs a fixed row count, on a
long-tailed mix of response lengths (most short, a few long), same model, batch and gradient.

    python benchmarks/dynamic_bsz.py [--model demo] [--rows 64] [--micro 8] [--budget 0] [--rounds 5]

The fixed split takes `--micro` rows a micro-batch (length-sorted, so padding is already small); the budget is
`--micro` × the mean padded row length unless given, so both hold about as many tokens on average: the budget packs
many short rows together and gives the long ones micro-batches of their own. Runs alternate fixed / budget so both
share whatever else the machine is doing; the first round is warm-up. Prints the median seconds of each, the
micro-batch counts, the largest micro-batch's padded tokens (what bounds activation memory), and
`ratio fixed/budget` (> 1: the budget is faster); the two gradients are checked equal.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from alignrl.data.records import Experience
from alignrl.models.loader import load_model
from alignrl.runtime.env import SINGLE
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.minibatch import TokenBudget, micro_batches


def long_tailed(vocab: int, rows: int, seed: int = 0) -> Experience:
    """Response lengths drawn long-tailed: 85% of 8-32 tokens, 15% of 160-256; prompts of 16-48 tokens."""
    g = torch.Generator().manual_seed(seed)
    long = torch.rand(rows, generator=g) < 0.15
    r_len = torch.where(long, torch.randint(160, 257, (rows,), generator=g), torch.randint(8, 33, (rows,), generator=g))
    p_len = torch.randint(16, 49, (rows,), generator=g)
    prompt_mask = torch.arange(48)[None] >= 48 - p_len[:, None]
    response_mask = torch.arange(256)[None] < r_len[:, None]
    return Experience(torch.randint(3, vocab, (rows, 48), generator=g) * prompt_mask, prompt_mask,
                      torch.randint(3, vocab, (rows, 256), generator=g) * response_mask, response_mask,
                      torch.randn(rows, 256, generator=g) * response_mask - 2.0, None,
                      torch.randn(rows, generator=g)[:, None].expand(rows, 256) * response_mask)


def update(model, exp: Experience, micro) -> tuple[float, torch.Tensor]:
    m = copy.deepcopy(model)
    actor = Actor(build_engine("single", m, OptimSpec(lr=1e-6, total_steps=10), SINGLE))
    t0 = time.perf_counter()
    actor.update(exp, PolicyLossSpec(), mini_batch=len(exp), micro_batch=micro, epochs=1,
                 generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - t0, torch.cat([p.grad.flatten() for p in m.parameters()])


def shape(exp: Experience, micro) -> tuple[int, int]:
    """(micro-batches, the largest one's padded tokens)."""
    chunks = micro_batches(torch.arange(len(exp)), exp, micro, None, SINGLE)
    length = exp.prompt_mask.sum(-1) + exp.response_mask.sum(-1)
    return len(chunks), max(len(c) * int(length[c].max()) for c in chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="HF folder or 'demo' (the embedded tiny model)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--budget", type=int, default=0, help="tokens a micro-batch (0: --micro × mean row length)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    exp = long_tailed(model.config.vocab_size, args.rows)
    mean_len = float((exp.prompt_mask.sum(-1) + exp.response_mask.sum(-1)).float().mean())
    budget = TokenBudget(args.budget or int(args.micro * mean_len))
    fixed_s, budget_s = [], []
    for r in range(args.rounds + 1):
        (tf, gf), (tb, gb) = update(model, exp, args.micro), update(model, exp, budget)
        if r:  # the first round is warm-up
            fixed_s.append(tf)
            budget_s.append(tb)
    scale = gf.abs().max()
    torch.testing.assert_close(gb / scale, gf / scale, atol=1e-5, rtol=0)
    (nf, pf), (nb, pb) = shape(exp, args.micro), shape(exp, budget)
    f, b = statistics.median(fixed_s), statistics.median(budget_s)
    print(f"fixed  {args.micro} rows/micro-batch: {f:.3f} s  ({nf} micro-batches, largest {pf} padded tokens)")
    print(f"budget {budget.tokens} tokens/micro-batch: {b:.3f} s  ({nb} micro-batches, largest {pb} padded tokens)")
    print(f"gradients equal (max |diff| / max |grad| <= 1e-5); ratio fixed/budget = {f / b:.2f}x")


if __name__ == "__main__":
    main()
