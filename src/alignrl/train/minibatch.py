"""The PPO update loop shared by the actor and the critic: epochs × shuffled mini-batches, each one
optimizer step accumulated over length-grouped micro-batches.

The micro-batch loss receives the mini-batch's token count, so token-mean losses accumulate to exactly
the mini-batch loss whatever the micro-batch size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from alignrl.core.aggregation import n_sequences
from alignrl.data.collate import length_sorted_chunks
from alignrl.data.records import Experience

# (rows of the full batch, those rows as a trimmed Experience, mini-batch token count, mini-batch
# sequence count) -> (loss, metrics)
MicroLoss = Callable[[torch.Tensor, Experience, float, float], tuple[torch.Tensor, dict[str, float]]]


def minibatch_updates(exp: Experience, micro_loss: MicroLoss, optimizer, scheduler, params, grad_clip: float,
                      mini_batch: int, micro_batch: int, epochs: int, generator: torch.Generator,
                      prefix: str) -> dict[str, float]:
    """Runs the updates; returns metrics averaged over mini-batches (each weighted 1)."""
    params = list(params)
    sums: dict[str, list[float]] = defaultdict(list)
    for _ in range(epochs):
        order = torch.randperm(len(exp), generator=generator)
        for start in range(0, len(exp), mini_batch):
            mb = order[start:start + mini_batch]
            tokens = float(exp.response_mask[mb].sum())
            seqs = n_sequences(exp.response_mask[mb])
            optimizer.zero_grad(set_to_none=True)
            for rows in length_sorted_chunks(mb, exp.prompt_mask, exp.response_mask, micro_batch):
                micro = exp.select(rows)
                loss, m = micro_loss(rows, micro, tokens, seqs)
                loss.backward()
                share = float(micro.response_mask.sum()) / max(tokens, 1.0)
                for k, v in m.items():
                    sums[k].append(v * share)
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
            sums[f"{prefix}/grad_norm"].append(float(norm))
            optimizer.step()
            scheduler.step()
    n_mini = epochs * ((len(exp) + mini_batch - 1) // mini_batch)
    out = {k: sum(v) / n_mini for k, v in sums.items()}
    out[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
    return out
