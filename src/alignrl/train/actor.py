"""The policy loss and the actor: the trainable policy on a training engine, updated with the PPO
mini-batch loop of `train.minibatch` (token-mean over the whole mini-batch, so accumulation gives
exactly the mini-batch gradient whatever the micro-batch size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignrl.core.losses import KL_ESTIMATORS, POLICY_LOSSES, token_mean
from alignrl.data.records import Experience
from alignrl.models.logprobs import Layout, response_logprobs
from alignrl.train.minibatch import minibatch_updates
from alignrl.train.engines.base import TrainEngine


@dataclass(frozen=True)
class PolicyLossSpec:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # 0 disables the KL term
    kl_type: str = "k3"
    entropy_coeff: float = 0.0
    temperature: float = 1.0
    name: str = "ppo_clip"  # a key of POLICY_LOSSES
    clip_c: float | None = None  # dual-clip constant (> 1), PPO only
    loss_agg: str = "token-mean"  # a key of LOSS_AGGREGATIONS
    max_len: float | None = None  # the constant of seq-mean-token-sum-norm (max response length)


def policy_loss(logp, entropy, exp: Experience, spec: PolicyLossSpec, global_tokens: float, global_seqs: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss (aggregated by `spec.loss_agg` over the mini-batch's global counts) + KL to the
    reference - entropy bonus (both token-mean)."""
    mask = exp.response_mask.to(logp.dtype)
    extra = {"clip_c": spec.clip_c} if spec.name == "ppo_clip" else {}
    loss, metrics = POLICY_LOSSES[spec.name](logp, exp.old_logprobs, exp.advantages, mask, spec.clip_low,
                                             spec.clip_high, global_tokens, is_weight=exp.is_weight,
                                             loss_agg=spec.loss_agg, global_seqs=global_seqs, max_len=spec.max_len,
                                             **extra)
    if spec.kl_coef > 0 and exp.ref_logprobs is not None:
        kl = token_mean(KL_ESTIMATORS[spec.kl_type](logp, exp.ref_logprobs), mask, global_tokens)
        loss = loss + spec.kl_coef * kl
        metrics["actor/kl_loss"] = float(kl.detach()) * global_tokens / max(1.0, float(mask.sum()))
    if entropy is not None:
        ent = token_mean(entropy, mask, global_tokens)
        if spec.entropy_coeff > 0:
            loss = loss - spec.entropy_coeff * ent
        metrics["actor/entropy"] = float(ent.detach()) * global_tokens / max(1.0, float(mask.sum()))
    return loss, metrics


class Actor:
    """The trainable policy on a TrainEngine; `update` runs PPO epochs over an Experience batch (this
    rank's share of it under data parallelism)."""

    def __init__(self, engine: TrainEngine, layout: Layout = Layout()):
        self.engine = engine
        self.model = engine.model  # unwrapped: generation, no-grad log-probs, save_pretrained
        self.layout = layout  # how a micro-batch goes through the model (models.logprobs)

    def update(self, exp: Experience, spec: PolicyLossSpec, mini_batch: int, micro_batch: int, epochs: int,
               generator: torch.Generator) -> dict[str, float]:
        """`mini_batch` (this rank's share) and `micro_batch` are in sequences. Mini-batches are shuffled
        each epoch."""
        self.engine.module.train()

        def micro_loss(rows, micro: Experience, tokens: float, seqs: float):
            # forward through the engine's module: DDP / DeepSpeed hook gradient reduction there
            logp, ent = response_logprobs(self.engine.module, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                          micro.attended, spec.temperature, with_entropy=True,
                                          entropy_grad=spec.entropy_coeff > 0, layout=self.layout)
            return policy_loss(logp, ent, micro, spec, tokens, seqs)

        return minibatch_updates(exp, micro_loss, self.engine, mini_batch, micro_batch, epochs, generator, "actor",
                                 by_prompt=self.layout.share_prompt)
