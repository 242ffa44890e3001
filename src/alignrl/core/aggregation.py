"""Loss aggregation: how a per-token loss (B, T) under a mask (B, T) becomes one scalar.

Every mode takes a global count as its third argument (tokens for token-mean, sequences for the
seq-* modes). Passing the count of the whole mini-batch makes micro-batch losses, and their
gradients, add up to exactly the mini-batch ones however the mini-batch is split. Without it the
count is this batch's own. A sequence counts when it has at least one masked token.
"""

from __future__ import annotations

import torch


def _count(local: torch.Tensor, global_count: float | None, like: torch.Tensor) -> torch.Tensor:
    if global_count is None:
        return local.clamp(min=1)
    return torch.as_tensor(global_count, dtype=like.dtype, device=like.device).clamp(min=1)


def n_sequences(mask: torch.Tensor) -> float:
    """Number of rows of mask (B, T) with at least one token: the count the seq-* modes divide by."""
    return float((mask.sum(-1) > 0).sum())


def token_mean(loss: torch.Tensor, mask: torch.Tensor, global_tokens: float | None = None) -> torch.Tensor:
    """Sum of masked token losses over `global_tokens` (default: this batch's token count).

    Passing the token count of the whole mini-batch makes micro-batch losses add up to exactly the
    mini-batch loss, however the mini-batch is split (DAPO, Yu et al. 2025, token-level loss).
    """
    denom = mask.sum() if global_tokens is None else torch.as_tensor(global_tokens, dtype=loss.dtype)
    return (loss * mask).sum() / denom.clamp(min=1)


def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, global_seqs: float | None = None) -> torch.Tensor:
    """Token sum per sequence, averaged over sequences. loss, mask (B, T) -> scalar."""
    seq = (loss * mask).sum(-1)
    return seq.sum() / _count((mask.sum(-1) > 0).sum().to(loss.dtype), global_seqs, loss)


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, global_seqs: float | None = None) -> torch.Tensor:
    """Token mean per sequence, averaged over sequences (the GRPO paper's 1/G sum 1/|o_i| sum_t,
    Shao et al. 2024). loss, mask (B, T) -> scalar."""
    seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return seq.sum() / _count((mask.sum(-1) > 0).sum().to(loss.dtype), global_seqs, loss)


def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, global_seqs: float | None = None,
                            max_len: float | None = None) -> torch.Tensor:
    """Token sums divided by a constant length, averaged over sequences (Dr.GRPO, Liu et al. 2025,
    "Understanding R1-Zero-Like Training": no per-response length bias). loss, mask (B, T) -> scalar.

    `max_len` should be the configured maximum response length (`config.checks.response_cap`: a
    multi-turn episode's cap, not the per-turn limit); the default T is only constant when every
    micro-batch is padded to the same width.
    """
    length = float(mask.shape[-1]) if max_len is None else float(max_len)
    return seq_mean_token_sum(loss, mask, global_seqs) / length


LOSS_AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   global_tokens: float | None = None, global_seqs: float | None = None,
                   max_len: float | None = None) -> torch.Tensor:
    """Dispatch to LOSS_AGGREGATIONS[mode], giving it the global count it needs. (B, T) -> scalar."""
    if mode == "token-mean":
        return token_mean(loss, mask, global_tokens)
    if mode == "seq-mean-token-sum-norm":
        return seq_mean_token_sum_norm(loss, mask, global_seqs, max_len)
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {sorted(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode](loss, mask, global_seqs)
