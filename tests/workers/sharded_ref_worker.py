"""One rank of the sharded-reference test (run by torchrun, two gloo ranks): the base model sharded over the
ranks scores rows of uneven shares (so the ranks run different numbers of micro-batches, one of them none),
and each rank compares its rows with a whole copy of the model scoring the same rows."""

import argparse
import json
from dataclasses import replace

import torch

from alignrl.rl.producer import LocalRefScorer
from alignrl.config import RunConfig
from alignrl.runtime.env import barrier, init_distributed, shutdown
from alignrl.models.sharded_load import held_elements
from alignrl.placements.sharded_ref import build_sharded_ref
from alignrl.models import loader
from alignrl.models.loader import frozen_copy, load_model
from alignrl.models.logprobs import ForwardLayout


def rows(n: int, vocab: int, gen: torch.Generator):
    """`n` rows of left-padded prompts and right-padded responses of varied lengths (two rows share a prompt)."""
    pids, pmask = torch.zeros(n, 6, dtype=torch.long), torch.zeros(n, 6, dtype=torch.bool)
    rids, rmask = torch.zeros(n, 5, dtype=torch.long), torch.zeros(n, 5, dtype=torch.bool)
    for i in range(n):
        p, r = 2 + i % 5, 1 + (3 * i) % 5
        pids[i, 6 - p:] = torch.randint(3, vocab, (p,), generator=gen)
        pmask[i, 6 - p:] = True
        rids[i, :r] = torch.randint(3, vocab, (r,), generator=gen)
        rmask[i, :r] = True
    pids[1], pmask[1] = pids[0], pmask[0]
    return pids, pmask, rids, rmask


def failing(sharded, whole, batch, env, out: str) -> None:
    """The whole load's shards score one share as a whole copy does (written down); then rank 1 fails in its next
    forward, after the ranks agreed on two: rank 0 must not wait it out."""
    mine = tuple(t[slice(0, 5) if env.rank == 0 else slice(5, 9)] for t in batch)
    worst = float((sharded.logprobs(*mine) - LocalRefScorer(whole, 1.0, 2).logprobs(*mine)).abs().max())
    with open(f"{out}.{env.rank}.json", "w") as f:
        json.dump({"held": held_elements(sharded.model), "worst": worst}, f)
    bad = batch[0][:4] + (whole.config.vocab_size if env.rank == 1 else 0)
    sharded.logprobs(bad, *(t[:4] for t in batch[1:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fail", action="store_true", help="a folder of .bin weights (not read by rows: loaded whole, then "
                    "sharded); after one good call, rank 1 gets token ids past the vocabulary")
    a = ap.parse_args()
    env = init_distributed("cpu")
    cfg = RunConfig()
    cfg = replace(cfg, model=replace(cfg.model, path=a.model, dtype="float32"),
                  actor=replace(cfg.actor, logprob_micro_batch_size=2))
    whole_load = loader.load_model
    if not a.fail:
        loader.load_model = None  # the shards are read by rows: a whole load (the fallback) would fail here
    sharded = build_sharded_ref(cfg, env)
    loader.load_model = whole_load
    whole = frozen_copy(load_model(a.model, "float32")[0])
    vocab = whole.config.vocab_size
    batch = rows(9, vocab, torch.Generator().manual_seed(0))
    if a.fail:
        failing(sharded, whole, batch, env, a.out)
        return
    # (rank 0's rows, rank 1's rows): 3 micro-batches against 1, none against 5, then the same shares
    shares = [(slice(0, 5), slice(5, 7)), (slice(0, 0), slice(0, 9)), (slice(2, 4), slice(4, 6))]
    worst = 0.0
    for layout in (ForwardLayout(), ForwardLayout(share_prompt=True), ForwardLayout(remove_padding=True)):
        sharded.layout = layout
        local = LocalRefScorer(whole, cfg.rollout.temperature, 2, layout)
        for share in shares:
            mine = tuple(t[share[env.rank]] for t in batch)
            got = sharded.logprobs(*mine)
            want = local.logprobs(*mine) if len(mine[0]) else torch.zeros(mine[2].shape)
            assert got.shape == want.shape, (got.shape, want.shape)
            worst = max(worst, float((got - want).abs().max()) if got.numel() else 0.0)
    total = sum(p.numel() for p in whole.parameters())
    with open(f"{a.out}.{env.rank}.json", "w") as f:
        json.dump({"held": held_elements(sharded.model), "total": total, "worst": worst}, f)
    # both ranks past their last collective before the group goes: a rank that exited while the other's gloo threads
    # still ran aborted ("terminate called without an active exception")
    barrier(env)
    shutdown()


if __name__ == "__main__":
    main()
