"""Policy updates for one process: PPO mini-batches, micro-batch gradient accumulation, clipping.

The loss of a mini-batch is token-mean over the whole mini-batch: each micro-batch divides its
token sum by the mini-batch token count, so accumulation gives exactly the mini-batch gradient
whatever the micro-batch size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from alignrl.core.losses import KL_ESTIMATORS, POLICY_LOSSES, token_mean
from alignrl.data.collate import length_sorted_chunks
from alignrl.data.records import Experience
from alignrl.models.logprobs import response_logprobs
from alignrl.train.optim import build_optimizer


@dataclass(frozen=True)
class PolicyLossSpec:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # 0 disables the KL term
    kl_type: str = "k3"
    entropy_coeff: float = 0.0
    temperature: float = 1.0


def policy_loss(logp, entropy, exp: Experience, spec: PolicyLossSpec, global_tokens: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip + KL-to-reference - entropy bonus, all token-mean over `global_tokens`."""
    mask = exp.response_mask.to(logp.dtype)
    loss, metrics = POLICY_LOSSES["ppo_clip"](logp, exp.old_logprobs, exp.advantages, mask,
                                              spec.clip_low, spec.clip_high, global_tokens, is_weight=exp.is_weight)
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
    """The trainable policy with its optimizer; `update` runs PPO epochs over an Experience batch."""

    def __init__(self, model, *, lr: float, weight_decay: float, betas, warmup_steps: int, total_steps: int,
                 schedule: str, min_lr_ratio: float, grad_clip: float):
        self.model = model
        self.optimizer, self.scheduler = build_optimizer(
            [p for p in model.parameters() if p.requires_grad], lr, weight_decay, betas, warmup_steps,
            total_steps, schedule, min_lr_ratio)
        self.grad_clip = grad_clip

    def update(self, exp: Experience, spec: PolicyLossSpec, mini_batch: int, micro_batch: int, epochs: int,
               generator: torch.Generator) -> dict[str, float]:
        """`mini_batch` and `micro_batch` are in sequences. Mini-batches are shuffled each epoch."""
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        for _ in range(epochs):
            order = torch.randperm(len(exp), generator=generator)
            for start in range(0, len(exp), mini_batch):
                mb = order[start:start + mini_batch]
                tokens = float(exp.response_mask[mb].sum())
                self.optimizer.zero_grad(set_to_none=True)
                for rows in length_sorted_chunks(mb, exp.prompt_mask, exp.response_mask, micro_batch):
                    micro = exp.select(rows)
                    logp, ent = response_logprobs(self.model, micro.prompt_ids, micro.prompt_mask,
                                                  micro.response_ids, micro.response_mask,
                                                  spec.temperature, with_entropy=True,
                                                  entropy_grad=spec.entropy_coeff > 0)
                    loss, m = policy_loss(logp, ent, micro, spec, tokens)
                    loss.backward()
                    share = float(micro.response_mask.sum()) / max(tokens, 1.0)
                    for k, v in m.items():
                        sums[k].append(v * share)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                      self.grad_clip if self.grad_clip > 0 else float("inf"))
                sums["actor/grad_norm"].append(float(norm))
                self.optimizer.step()
                self.scheduler.step()
        n_mini = epochs * ((len(exp) + mini_batch - 1) // mini_batch)
        out = {k: sum(v) / n_mini for k, v in sums.items()}  # each mini-batch contributes weight 1
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
