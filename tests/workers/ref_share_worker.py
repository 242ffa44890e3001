"""One rank of the ZeroMQ trainer's sharded-reference test (run by torchrun, two gloo ranks): a sampler scored a
prefix of each batch's reference rows that covers one rank's share whole and the other's in part (or neither, or
both), and each rank completes its own share with the reference sharded over both ranks. A rank with no rows left
still calls it, so the ranks' collective forwards pair up; each rank's rows must equal a whole copy's."""

import argparse
import json

import torch

from alignrl.config import load_config
from alignrl.data.records import ScoredBatch, Scores
from alignrl.interfaces import SamplingParams
from alignrl.models.loader import frozen_copy, load_model
from alignrl.placements.sharded_ref import build_sharded_ref
from alignrl.placements.zmq.ref_share import RefShare
from alignrl.rl.producer import LocalRefScorer
from alignrl.rl.rollout_ops import shard_groups
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.runtime.env import barrier, init_distributed, shutdown

GROUPS, N = 4, 2


def batch_with(ro, ref_lp) -> ScoredBatch:
    b = len(ro.group)
    return ScoredBatch(ro, Scores(torch.zeros(b), torch.zeros(b, dtype=torch.bool)), ro.response_mask.clone(),
                       ref_lp, ro.group.clone())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    env = init_distributed("cpu")
    cfg = load_config(None, [f"model.path={a.model}", "model.dtype=float32", "pipeline.ref_logprobs=balance",
                             "pipeline.max_staleness=1", f"data.train_batch_size={GROUPS}", f"rollout.n={N}",
                             "actor.ppo_mini_batch_size=2", "actor.kl_loss_coef=0.01",
                             "actor.logprob_micro_batch_size=3"])
    share = RefShare(cfg, build_sharded_ref(cfg, env))
    model, tok = load_model(a.model, "float32")
    whole = LocalRefScorer(frozen_copy(model), cfg.logprob_temperature, cfg.actor.forward_micro_batch)
    prompts = [tok.encode(p) for p in ("1+1=", "23+4=", "7*8=", "100-1=")]
    # the same seed on both ranks: the same rollout, as rank 0 broadcasts one batch to every rank
    ro = HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=N, temperature=1.0, max_new_tokens=6,
                                                                      seed=3))
    full = whole.logprobs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    want = shard_groups(batch_with(ro, full), env.rank, env.world_size).ref_logprobs
    worst, computed = 0.0, []
    # the sampler's groups: rank 0's share whole and rank 1's in part, rank 0's in part only, none, all
    for groups in (3, 1, 0, GROUPS):
        done, metrics = share.complete(shard_groups(batch_with(ro, full[:groups * N] if groups else None),
                                                    env.rank, env.world_size))
        assert done.ref_logprobs.shape == want.shape, (done.ref_logprobs.shape, want.shape)
        worst = max(worst, float((done.ref_logprobs - want).abs().max()))
        computed.append(metrics["pipeline/ref_rows_trainer"])
    with open(f"{a.out}.{env.rank}.json", "w") as f:
        json.dump({"worst": worst, "computed": computed}, f)
    barrier(env)  # both ranks past their last collective before the group goes
    shutdown()


if __name__ == "__main__":
    main()
