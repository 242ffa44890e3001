"""verl's optimal token baselines (algorithm.adv_estimator=optimal_token_baseline, tir_optimal_token_baseline).

Each token t of a response gets the advantage G_t - B_t: G_t its reward-to-go (the rewards of tokens t.. summed), and
B_t one baseline per prompt and step, the mean of G_t over the prompt's responses weighted by W_t:

    B_t = sum_i G_t,i W_t,i / (sum_i W_t,i + eps),   W_t = sum_{j<=t} w_j,   w_j = 1 - 2 pi(a_j) + sum_v pi(v)^2

w_j is |onehot(a_j) - pi|^2, the squared norm of the score of token j's logits: W_t is the variance a path has built up
by step t, so the paths whose gradients are noisiest shape the baseline most. With rollout importance weights rho, w_j
is scaled by rho_j^2 (the baseline that minimises the variance of the truncated-IS gradient). A response alone in its
group keeps its reward-to-go; the longest response of a group, where it runs on past every other, gets baseline 0
there (verl's handle_zero_tail: nothing else is alive to compare with).

optimal_token_baseline compares the responses column by column of the padded batch; tir_optimal_token_baseline first
moves each response's trained tokens to the left (tool observations and rejected tokens dropped), so that the k-th
trained token of each response meets the k-th of the others. With a mask without holes the two agree.

Shapes: token_rewards, mask, log-probs, sums of squared probabilities, IS weights (B, T); group (B,) long.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenBaselineInputs(Protocol):
    """The fields of core.advantages.OutcomeInputs these estimators read (named here, so this module does not import
    the registry that imports it)."""

    token_rewards: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    logprobs: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None
    is_weights: torch.Tensor | None

EPS = 1e-8  # verl's epsilon under the weight sum


def reward_to_go(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t: the masked rewards of tokens t.. summed (B, T)."""
    return (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def path_weights(logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor,
                 is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """W_t: the per-token score norms 1 - 2 pi(a) + sum pi^2 (times rho^2 with IS weights) summed up to t (B, T)."""
    w = 1.0 - 2.0 * logprobs.exp() + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights.to(w.dtype) ** 2
    return (w * mask).cumsum(-1)


def _tail_rows(lengths: torch.Tensor, group: torch.Tensor, member: torch.Tensor, n_groups: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each row is its group's only longest member, of a group of two or more; the second-longest length of
    its group): from that column on it alone is alive, and its baseline is 0."""
    lengths = torch.where(member, lengths, torch.full_like(lengths, -1))  # non-members never count
    count = torch.zeros(n_groups, dtype=torch.long, device=group.device).index_add_(0, group, member.long())
    top = torch.full((n_groups,), -1, dtype=lengths.dtype, device=lengths.device)
    top = top.scatter_reduce(0, group, lengths, "amax")
    is_top = member & (lengths == top[group])
    n_top = torch.zeros(n_groups, dtype=torch.long, device=group.device).index_add_(0, group, is_top.long())
    below = torch.where(is_top, torch.full_like(lengths, -1), lengths)
    second = torch.full((n_groups,), -1, dtype=lengths.dtype, device=lengths.device)
    second = second.scatter_reduce(0, group, below, "amax")
    alone_on_top = is_top & (n_top[group] == 1) & (count[group] >= 2)
    return alone_on_top, second[group]


def group_token_baselines(returns: torch.Tensor, weights: torch.Tensor, alive: torch.Tensor, group: torch.Tensor,
                          member: torch.Tensor, zero_tail: bool = True, eps: float = EPS) -> torch.Tensor:
    """B (B, T): each step's W-weighted mean of the returns over the group's `member` rows `alive` at that step; 0 for
    a group of one member, and past the second-longest member's length for a group's one longest member."""
    if returns.numel() == 0:
        return torch.zeros_like(returns)
    n_groups = int(group.max()) + 1
    live = alive.to(returns.dtype) * member[:, None].to(returns.dtype)
    num = torch.zeros((n_groups, returns.shape[1]), dtype=returns.dtype, device=returns.device)
    den = torch.zeros_like(num)
    num.index_add_(0, group, returns * weights * live)
    den.index_add_(0, group, weights * live)
    base = (num / (den + eps))[group]
    count = torch.zeros(n_groups, dtype=torch.long, device=group.device).index_add_(0, group, member.long())
    base = base * (count[group] >= 2)[:, None].to(base.dtype)  # alone: the reward-to-go is the advantage
    if zero_tail:
        lengths = alive.sum(-1).long()
        alone_on_top, second = _tail_rows(lengths, group, member, n_groups)
        columns = torch.arange(returns.shape[1], device=returns.device)
        base = base.masked_fill(alone_on_top[:, None] & (columns[None, :] >= second[:, None]), 0.0)
    return base


def optimal_token_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                                      logprobs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                      is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's optimal_token_baseline (B, T): the baselines taken column by column of the padded batch, every row a
    member of its group."""
    mask = mask.to(token_rewards.dtype)
    returns = reward_to_go(token_rewards, mask)
    weights = path_weights(logprobs.to(returns.dtype), sum_pi_squared.to(returns.dtype), mask, is_weights)
    member = torch.ones(len(group), dtype=torch.bool, device=group.device)
    base = group_token_baselines(returns, weights, mask, group, member)
    return (returns - base) * mask


def tir_optimal_token_baseline_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                                          logprobs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                          is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's tir_optimal_token_baseline (B, T): each row's trained tokens moved left, in order, before the baselines
    are taken, and the advantages put back where the tokens were; a row with no trained token is in no group."""
    mask = mask.to(token_rewards.dtype)
    returns = reward_to_go(token_rewards, mask)
    weights = path_weights(logprobs.to(returns.dtype), sum_pi_squared.to(returns.dtype), mask, is_weights)
    kept = mask.bool()
    order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)  # the trained columns first, in order
    lengths = kept.sum(-1)
    alive = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    packed_returns = returns.gather(-1, order) * alive
    packed_weights = weights.gather(-1, order) * alive
    base = group_token_baselines(packed_returns, packed_weights, alive, group, lengths > 0)
    packed_adv = (packed_returns - base) * alive
    return torch.zeros_like(returns).scatter(-1, order, packed_adv) * mask


def _needs(x: TokenBaselineInputs, name: str) -> None:
    if x.logprobs is None or x.sum_pi_squared is None:
        raise ValueError(f"{name} needs the policy's per-token log-probs and sums of squared probabilities "
                         "(OutcomeInputs.logprobs, .sum_pi_squared), which the RL loop computes for it")


def optimal_token_baseline(x: TokenBaselineInputs) -> torch.Tensor:
    _needs(x, "optimal_token_baseline")
    return optimal_token_baseline_advantages(x.token_rewards, x.mask, x.group, x.logprobs, x.sum_pi_squared,
                                             x.is_weights)


def tir_optimal_token_baseline(x: TokenBaselineInputs) -> torch.Tensor:
    _needs(x, "tir_optimal_token_baseline")
    return tir_optimal_token_baseline_advantages(x.token_rewards, x.mask, x.group, x.logprobs, x.sum_pi_squared,
                                                 x.is_weights)
