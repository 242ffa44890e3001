"""PPO-ptx (Ouyang et al. 2022, "Training language models to follow instructions with human feedback"; OpenRLHF's
--pretrain_data / --ptx_coef): a language-model loss on pretraining texts added to the actor's updates, so the
policy keeps what it knew while RL moves it.

As OpenRLHF does it, each micro-batch of the update is followed by one micro-batch of texts, whose token-mean
cross-entropy (every token a target) is backpropagated times `coef` into the same optimizer step. Here the term of
each micro-batch is also weighted by that micro-batch's share of the mini-batch's response tokens (over all ranks),
as the policy loss is, so the optimizer step sees coef x the token-weighted mean of its texts' losses however the
mini-batch is split. The texts of a step are drawn from a permutation seeded by the run's seed and the step, so a
resumed run draws the same texts without any saved position; data-parallel ranks take turns through it, so each
draws other texts (as OpenRLHF's distributed sampler gives each rank its own rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignrl.data.pretrain_text import PretrainTexts
from alignrl.models.logprobs import chunked_logprobs


def language_model_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of next-token prediction over the attended tokens of right-padded rows. Each row's
    log-probs come from its own logits, upcast a chunk at a time (`chunked_logprobs`), never from a second or fp32
    copy of the whole (B, L, V); rows of one token predict nothing, and a batch of them gives a zero loss."""
    device = next(model.parameters()).device
    ids, mask = input_ids.to(device), attention_mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    lengths = mask.sum(-1).tolist()
    total, count = logits.sum() * 0.0, 0  # zero with a graph: a batch without targets still backpropagates
    for row, n in enumerate(lengths):
        if n >= 2:
            total = total - chunked_logprobs(logits[row, :n - 1], ids[row, 1:n]).sum()
            count += n - 1
    return total / max(count, 1)


@dataclass
class PretrainMix:
    """The pretraining texts mixed into the actor's updates; `coef` the weight of their loss."""

    texts: PretrainTexts
    coef: float
    micro_batch: int
    seed: int
    rank: int = 0  # this process's data-parallel rank among `ranks`
    ranks: int = 1

    def for_step(self, step: int):
        """The draws of one update: each call gives the next micro-batch of texts (input_ids, attention_mask),
        cycling through a permutation of all texts seeded by (seed, step), the ranks' draws taking turns."""
        order = torch.randperm(len(self.texts), generator=torch.Generator().manual_seed(self.seed * 104_729 + step))
        draws = 0

        def draw() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal draws
            start = (draws * self.ranks + self.rank) * self.micro_batch
            draws += 1
            return self.texts.batch([int(order[(start + i) % len(order)]) for i in range(self.micro_batch)])

        return draw
