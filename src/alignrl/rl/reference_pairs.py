"""XPO's rollouts (Xie et al. 2024, "Exploratory Preference Optimization"; TRL's XPOTrainer): each prompt's pair holds
the policy's answer and the reference model's, sampled in the producer's process from the reference it already holds
for the log-probs (`RolloutMaker.ref`). The pair is then online DPO's (`core.online_dpo`), whose exploration term reads
the second answer of each pair as the reference's: the rows of a prompt are the policy's first, the reference's second.

Only an in-process reference can answer: a reference service (`services.reference_url`) returns log-probs, not text,
and a reference sharded over the ranks runs its forwards as collectives, which a sampling loop of its own per rank
cannot; both are one line at start.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from alignrl.config import RunConfig
from alignrl.data.records import Rollout
from alignrl.errors import ConfigError
from alignrl.interfaces import RefScorer, RolloutEngine, SamplingParams, derived_seed
from alignrl.models.lora import AdaptersOffScorer, adapters_off
from alignrl.rl.producer import LocalRefScorer
from alignrl.rl.rollout_ops import concat_rollouts, take_rows
from alignrl.rollout.hf_engine import HFRolloutEngine


class AdaptersOffEngine:
    """Generation from the base of a model trained with LoRA adapters (the reference), on the same module."""

    def __init__(self, engine: HFRolloutEngine, model: torch.nn.Module):
        self.engine, self.model, self.pad_id = engine, model, engine.pad_id

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        with adapters_off(self.model):
            return self.engine.generate(prompts, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("the reference's answers come from frozen weights: nothing loads into them")


class ReferencePairEngine:
    """A RolloutEngine of two answers per prompt: `policy`'s first, `reference`'s second. Weights published to it
    go to the policy's engine; the reference is frozen."""

    def __init__(self, policy: RolloutEngine, reference: HFRolloutEngine | AdaptersOffEngine):
        self.policy, self.reference = policy, reference

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        if params.n != 2:
            raise ValueError(f"XPO pairs the policy's answer with the reference's: rollout.n=2 (got {params.n})")
        one = replace(params, n=1)
        mine = self.policy.generate(prompts, one)
        # the reference draws its own random numbers: at the start both models are the same, and the same draws
        # would give each prompt two identical answers, a pair that teaches nothing
        theirs = self.reference.generate(prompts, replace(one, seed=derived_seed(params.seed, 1)))
        return pair_rows(mine, theirs, self.reference.pad_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.policy.load_weights(named_tensors)


def pair_rows(first: Rollout, second: Rollout, pad_id: int) -> Rollout:
    """One rollout of P groups of two rows from two of P rows each (one per prompt, in the same prompt order): each
    group's first row from `first`, its second from `second`."""
    both = concat_rollouts(first, second, pad_id)
    prompts = len(first.group)
    rows = torch.arange(2 * prompts).view(2, prompts).t().reshape(-1)  # 0, P, 1, P+1, ...
    return take_rows(both, rows, torch.arange(prompts).repeat_interleave(2))


def reference_answers(cfg: RunConfig, engine: RolloutEngine, ref: RefScorer | None, tokenizer) -> RolloutEngine:
    """`engine` itself, or under algorithm.adv_estimator=xpo the pair engine of it and the reference `ref` holds."""
    if cfg.algorithm.adv_estimator != "xpo":
        return engine
    if isinstance(ref, AdaptersOffScorer):  # the policy's own module with its adapters off
        return ReferencePairEngine(engine, AdaptersOffEngine(HFRolloutEngine(ref.model, tokenizer), ref.model))
    if isinstance(ref, LocalRefScorer):
        return ReferencePairEngine(engine, HFRolloutEngine(ref.model, tokenizer))
    raise ConfigError("algorithm.adv_estimator=xpo samples each prompt's second answer from the reference model, "
                      "which must be loaded where the rollouts are made; this run's is "
                      f"{'not there' if ref is None else type(ref).__name__} (a reference service, a reference "
                      "sharded over the ranks, or pipeline.ref_logprobs=trainer): drop services.reference_url, "
                      "use a strategy that keeps whole copies (ddp), or set pipeline.ref_logprobs=sampler")
