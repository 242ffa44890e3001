"""Run under torchrun (two gloo ranks), or imported for the one-process reference: online DPO steps of the RL
trainer (`PolicyTrainer.train`, algorithm.adv_estimator=online_dpo) on fixed global batches of prompt pairs, each
rank training its contiguous share of the pairs as the ZeroMQ and Ray placements hand it out (`shard_groups`).

    --strategies S ...  one run per training engine (ddp, fsdp2), each from the base weights; rank 0 writes
                        weights_<S>.safetensors and metrics_<S>.json (each step's metrics, averaged over the ranks as
                        the loop logs them)

The batches hold an answer none of whose tokens are trained (a multi-turn answer of tool output only) in the first
rank's share and none in the second's: the share of answers the loss counts differs between the ranks, so a count
taken per rank instead of over every rank shows in the weights.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from alignrl.config import load_config
from alignrl.data.records import Rollout, ScoredBatch, Scores
from alignrl.models.logprobs import response_logprobs
from alignrl.rl.rollout_ops import shard_groups
from alignrl.rl.trainer import PolicyTrainer
from alignrl.runtime.env import barrier, init_distributed, mean_metrics, shutdown
from alignrl.train.actor import Actor
from alignrl.train.engines import OptimSpec, build_engine

PAIRS, PROMPT, RESPONSE, STEPS = 4, 5, 6, 2
EMPTY_ROW = 1  # rows 0-3 (pairs 0 and 1) are the first rank's share of a batch


def settings(model_dir: str, strategy: str):
    return load_config(None, [f"model.path={model_dir}", "algorithm.adv_estimator=online_dpo", "rollout.n=2",
                              f"data.train_batch_size={PAIRS}", f"actor.ppo_mini_batch_size={PAIRS}",
                              "actor.ppo_micro_batch_size=2", "actor.use_kl_loss=false", "algorithm.dpo_beta=0.5",
                              f"trainer.strategy={strategy}", "trainer.seed=3"])


def fixed_batch(model, step: int) -> ScoredBatch:
    """PAIRS prompts, two answers each (rows 2p and 2p + 1), ragged; the reference a perturbed copy of the policy so
    the first step's pairs weigh differently; one tie of rewards (the first answer is chosen)."""
    g = torch.Generator().manual_seed(100 + step)
    rows, vocab = 2 * PAIRS, model.config.vocab_size
    group = torch.arange(rows) // 2
    prompt_ids = torch.randint(3, vocab, (PAIRS, PROMPT), generator=g)[group]
    p_len = torch.randint(2, PROMPT + 1, (PAIRS,), generator=g)[group]
    prompt_mask = torch.arange(PROMPT)[None] >= (PROMPT - p_len)[:, None]  # left-padded
    response_ids = torch.randint(3, vocab, (rows, RESPONSE), generator=g)
    r_len = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    response_mask = torch.arange(RESPONSE)[None] < r_len[:, None]  # right-padded
    trained = response_mask.clone()
    trained[EMPTY_ROW] = False  # attended to, never trained
    with torch.no_grad():
        lp, _ = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)
    ref = (lp + 0.5 * torch.randn(lp.shape, generator=g)) * response_mask
    rewards = torch.randint(0, 3, (rows,), generator=g).float()
    rewards[6:8] = 1.0  # the last pair ties
    ro = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, lp * response_mask,
                 torch.zeros(rows, dtype=torch.bool), group, loss_mask=trained)
    return ScoredBatch(ro, Scores(rewards, torch.zeros(rows, dtype=torch.bool)), trained, ref, group)


class NoSink:
    def publish(self, version: int) -> None:
        pass


def train_steps(env, model_dir: str, strategy: str) -> tuple[dict, list[dict]]:
    """STEPS online DPO steps from the base weights: (full weights after, each step's metrics averaged over ranks)."""
    cfg = settings(model_dir, strategy)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    batches = [fixed_batch(model, step) for step in range(1, STEPS + 1)]  # all from the base weights
    # Adam's first step is lr·g/(|g|+eps): a larger eps than the default keeps a last-bit difference of a tiny
    # gradient element (the ranks sum in another order) from becoming an lr-sized one
    spec = OptimSpec(lr=1e-2, weight_decay=0.01, total_steps=10, grad_clip=1.0, eps=1e-4)
    engine = build_engine("single" if env.world_size == 1 else strategy, model, spec, env)
    trainer = PolicyTrainer(cfg, Actor(engine), NoSink(), env=env)
    metrics = []
    for step, batch in enumerate(batches, start=1):
        got = trainer.train(step, shard_groups(batch, env.rank, env.world_size))
        metrics.append(mean_metrics(env, {k: v for k, v in got.items() if k.startswith(("dpo/", "online_dpo/"))}))
    return engine.full_state_dict(), metrics


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--strategies", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu", timeout_s=float(os.environ.get("ALIGNRL_DIST_TIMEOUT", "60")))
    out = Path(args.out)
    for strategy in args.strategies:
        weights, metrics = train_steps(env, args.model, strategy)
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.clone().contiguous() for k, v in weights.items()}, str(out / f"weights_{strategy}.tmp"))
            os.replace(out / f"weights_{strategy}.tmp", out / f"weights_{strategy}.safetensors")
            (out / f"metrics_{strategy}.json").write_text(json.dumps(metrics))
        barrier(env)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
