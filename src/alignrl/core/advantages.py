"""Advantage estimators: pure tensor functions, shapes in the docstrings.

Sequence-level estimators take `rewards (B,)` and `group (B,)` (long ids of the prompt each sample
answers) and return `(B,)`; token-level ones take `token_rewards (B, T)` and a `mask (B, T)` (1 on
tokens the policy generated) and return `(B, T)`, zero outside the mask. A sample alone in its group
has no baseline and gets advantage 0 (under gpg and opo it keeps its reward, as verl's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from alignrl.core.token_baseline import optimal_token_baseline, tir_optimal_token_baseline


def _group_sums(x: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group sample count and sum of x (B,) -> ((G,), (G,)), G = max(group) + 1."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, group, torch.ones_like(x))
    total = torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)
    return count, total


# Sums a small 1-D tensor over data-parallel ranks (an all-reduce); None: one process.
SumRanks = Callable[[torch.Tensor], torch.Tensor] | None


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sum_ranks: SumRanks = None,
                  divide_by_std: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; any shape, `mask` of x's shape.

    Mean and unbiased variance (n - 1) are taken over the masked entries only; entries outside the
    mask come back 0. One masked entry (or all equal) gives 0, not NaN. With `sum_ranks` the
    statistics are those of the global batch split over ranks, so each rank whitens as one process would.
    `divide_by_std=False` only centres (OpenRLHF's --no_advantage_std_norm).
    """
    total = sum_ranks or (lambda t: t)
    m = mask.to(x.dtype)
    n, s = total(torch.stack([m.sum(), (x * m).sum()]))
    mean = s / n.clamp(min=1)
    if not divide_by_std:
        return (x - mean) * m
    var = total(((x - mean) ** 2 * m).sum()[None])[0] / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def whiten_by(x: torch.Tensor, mask: torch.Tensor, mode: str, sum_ranks: SumRanks = None,
              eps: float = 1e-8) -> torch.Tensor:
    """The batch-wide normalisation of token advantages `mode` (algorithm.whiten_advantages) names: std (whiten),
    center (mean only) or none."""
    if mode == "none":
        return x * mask.to(x.dtype)
    return masked_whiten(x, mask, eps, sum_ranks, divide_by_std=mode == "std")


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards (B,) placed on each response's last real token -> (B, T)."""
    last = (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return last.to(rewards.dtype) * rewards[:, None]


BATCH_STD_EPS = 1e-4  # TRL's epsilon under the batch's std (its scale_rewards=batch)


def batch_std(x: torch.Tensor, sum_ranks: SumRanks = None) -> torch.Tensor:
    """The unbiased std (n - 1) of every entry of x (B,), over all ranks with `sum_ranks`; 0 for one entry."""
    total = sum_ranks or (lambda t: t)
    n, s = total(torch.stack([torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), x.sum()]))
    sq = total(((x - s / n.clamp(min=1)) ** 2).sum()[None])[0]
    return (sq / (n - 1).clamp(min=1)).sqrt()


def normalize_then_sum(per_function: torch.Tensor, group: torch.Tensor, weights: torch.Tensor,
                       eps: float = BATCH_STD_EPS) -> torch.Tensor:
    """TRL's multi_objective_aggregation=normalize_then_sum (GDPO, "Group reward-Decoupled Normalization"): each
    reward function's values (B, K; NaN where it skipped a row) centred on their prompt group's mean and divided by
    the group's unbiased std + eps, then weighted (K,) and summed over the functions, NaN skipped -> (B,). A function
    with fewer than two values in a group gives that group 0 (TRL's NaN std, skipped). Each function then weighs by
    how its values rank within the group, not by its scale."""
    out = torch.zeros(per_function.shape[0], dtype=per_function.dtype, device=per_function.device)
    valid = ~torch.isnan(per_function)
    for g in torch.unique(group):
        rows = group == g
        x, v = per_function[rows], valid[rows]
        count = v.sum(0)
        mean = torch.where(v, x, 0.0).sum(0) / count.clamp(min=1)
        var = (torch.where(v, x - mean, 0.0) ** 2).sum(0) / (count - 1).clamp(min=1)
        std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
        z = torch.where(count > 1, (x - mean) / (std + eps), torch.full_like(x, float("nan")))
        out[rows] = torch.nansum(z * weights.to(x.dtype), dim=1)
    return out


def grpo_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6, std_scope: str = "group", sum_ranks: SumRanks = None) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath"; Dr.GRPO without std,
    Liu et al. 2025, "Understanding R1-Zero-Like Training").

    rewards (B,) float, group (B,) long ids -> advantages (B,). A = r - mean_group(r), divided by the
    unbiased group std when `norm_by_std`. A group of one sample has no baseline and gets 0.
    `std_scope="batch"` divides by the unbiased std of the whole batch's rewards instead (over every rank with
    `sum_ranks`), plus BATCH_STD_EPS, as TRL's scale_rewards=batch (Liu et al. 2025, "Part I: Tricks or Traps?"
    on the batch-level std); the baseline stays the group mean.
    """
    count, total = _group_sums(rewards, group)
    centred = rewards - (total / count)[group]
    _, sq = _group_sums(centred**2, group)
    single = count[group] < 2
    if norm_by_std and std_scope == "batch":
        centred = centred / (batch_std(rewards, sum_ranks) + BATCH_STD_EPS)
    elif norm_by_std:
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[group] + eps)
    return centred.masked_fill(single, 0.0)


def decoupled_group_sum(per_reward: torch.Tensor, group: torch.Tensor, weights: torch.Tensor,
                        norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """verl's GDPO reward (algorithm.adv_estimator=gdpo; "GDPO: Group reward-Decoupled Normalization Policy
    Optimization", arXiv:2601.05242): each of the K reward components (B, K) normalized in its prompt group as
    GRPO's advantage is (`grpo_advantages`: verl runs its GRPO estimator on each component), then weighted (K,) and
    summed -> (B,). The advantage (`_gdpo`) whitens this sum over the batch's tokens."""
    return sum(w * grpo_advantages(per_reward[:, k], group, norm_by_std, eps) for k, w in enumerate(weights.tolist()))


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor, batch_norm: bool = False,
                    sum_ranks: SumRanks = None) -> torch.Tensor:
    """REINFORCE leave-one-out (RLOO; Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs").

    rewards (B,), group (B,) -> (B,). A_i = r_i - mean of the other samples of i's group
    = n / (n - 1) * (r_i - mean_group). A group of one gets 0. `batch_norm`: then (A - mean(A)) /
    (std(A) + BATCH_STD_EPS), the unbiased statistics of the whole batch (over every rank with `sum_ranks`), as
    TRL's RLOO normalize_advantages (its mean is 0 already wherever every group has two samples or more).
    """
    count, total = _group_sums(rewards, group)
    n = count[group]
    baseline = (total[group] - rewards) / (n - 1).clamp(min=1)
    adv = (rewards - baseline).masked_fill(n < 2, 0.0)
    if not batch_norm:
        return adv
    ranks = sum_ranks or (lambda t: t)
    size, summed = ranks(torch.stack([torch.tensor(float(adv.numel()), dtype=adv.dtype, device=adv.device),
                                      adv.sum()]))
    return (adv - summed / size.clamp(min=1)) / (batch_std(adv, sum_ranks) + BATCH_STD_EPS)


def gpg_advantages(rewards: torch.Tensor, group: torch.Tensor, sum_ranks: SumRanks = None) -> torch.Tensor:
    """Group Policy Gradient (GPG; Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning"), as verl computes it (compute_gpg_outcome_advantage).

    rewards (B,), group (B,) -> (B,). A = alpha * (r - mean_group(r)) with alpha = the batch's size over its count
    of nonzero rewards (over every rank with `sum_ranks`): batches with few rewarded samples get larger steps. A
    group of one keeps its reward (its mean is taken as 0, as verl's)."""
    total = sum_ranks or (lambda t: t)
    sizes = torch.tensor([float(rewards.numel()), float((rewards != 0).sum())], dtype=torch.float64,
                         device=rewards.device)
    size, nonzero = total(sizes).tolist()
    count, summed = _group_sums(rewards, group)
    mean = torch.where(count > 1, summed / count.clamp(min=1), torch.zeros_like(summed))
    return (size / max(nonzero, 1.0)) * (rewards - mean[group])


def opo_advantages(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """On-Policy RL with Optimal reward baseline (OPO, arXiv:2505.23585), as verl computes it
    (compute_opo_outcome_advantage).

    rewards (B,), group (B,), mask (B, T) -> (B,). A = r - b_group, b the group's rewards weighted by their
    responses' lengths (masked tokens): sum(len * r) / sum(len), the variance-minimising baseline when a sequence's
    gradient grows with its length. A group of one keeps its reward (baseline 0, as verl's)."""
    length = mask.to(rewards.dtype).sum(-1)
    count, weighted = _group_sums(length * rewards, group)
    _, total_length = _group_sums(length, group)
    # a group of empty responses: verl's 0/0; its rows are masked out whole, so 0 changes nothing they train on
    baseline = torch.where(count > 1, weighted / total_length.clamp(min=1), torch.zeros_like(weighted))
    return rewards - baseline[group]


def passk_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO for pass@k (arXiv:2503.19595, as verl cites it), as verl computes it
    (compute_grpo_passk_outcome_advantage): only the best response of each group learns, with advantage best minus
    second best, divided by the group's unbiased std + eps when `norm_by_std`; every other response gets 0.

    rewards (B,), group (B,) -> (B,). A tie at the top gives the whole group 0. A group of one has no second best:
    ValueError, as verl's (rollout.n >= 2 is checked when the config loads)."""
    out = torch.zeros_like(rewards)
    for g in torch.unique(group).tolist():
        rows = (group == g).nonzero().squeeze(-1)
        r = rewards[rows]
        if r.numel() < 2:
            raise ValueError(f"grpo_passk needs two samples or more of each prompt; group {g} has {r.numel()}")
        top, where = torch.topk(r, 2)
        gap = top[0] - top[1]
        out[rows[where[0]]] = gap / (r.std() + eps) if norm_by_std else gap
    return out


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over the masked tokens only: masked-out tokens (tool output, padding) are
    skipped, neither discounted nor adding their reward. (B, T) -> (B, T), 0 outside the mask."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):  # loop over time, vectorised over samples
        running = m[:, t] * (token_rewards[:, t] + gamma * running) + (1 - m[:, t]) * running
        out[:, t] = running
    return out * m


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            eps: float = 1e-8, sum_ranks: SumRanks = None, whiten: str = "std") -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): discounted return-to-go, whitened over all masked tokens of the batch (`whiten`: a
    mode of `whiten_by`).

    token_rewards (B, T) (an outcome reward sits on the last generated token; add a per-token KL
    penalty with `kl.kl_penalty_rewards`), mask (B, T) -> advantages (B, T), 0 outside the mask.
    Masked-out tokens inside a response are skipped by the return recursion; their rewards are ignored.
    """
    return whiten_by(_discounted_returns(token_rewards, mask, gamma), mask, whiten, sum_ranks, eps)


def shape_outcome(rewards: torch.Tensor, group: torch.Tensor, baseline: str) -> torch.Tensor:
    """Outcome rewards (B,) shaped by their prompt's group, ahead of any per-token KL penalty and the
    returns-to-go, as OpenRLHF's estimators shape them: none; loo, minus the mean of the group's other samples
    (its rloo); mean, minus the group mean (reinforce_baseline, dr_grpo); mean_std, that divided by the group's
    std (group_norm): algorithm.outcome_baseline. A sample alone in its group gets 0 (except with none)."""
    if baseline == "none":
        return rewards
    if baseline == "loo":
        return rloo_advantages(rewards, group)
    return grpo_advantages(rewards, group, norm_by_std=baseline == "mean_std", eps=1e-9)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                                     eps: float = 1e-8, sum_ranks: SumRanks = None) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025, "REINFORCE++", the `-baseline` variant):
    r - mean_group(r) broadcast to every token, then whitened over the batch's masked tokens.

    rewards (B,), group (B,), mask (B, T) -> advantages (B, T), 0 outside the mask. Samples alone in
    their group get 0 and are left out of the whitening statistics.
    """
    count, total = _group_sums(rewards, group)
    single = count[group] < 2
    centred = (rewards - (total / count)[group]).masked_fill(single, 0.0)
    keep = mask.to(rewards.dtype) * (~single).to(rewards.dtype)[:, None]
    return masked_whiten(centred[:, None].expand_as(keep), keep, eps, sum_ranks)


def remax_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models"): each token's reward-to-go minus the reward of the prompt's
    greedy response, as verl's `compute_remax_outcome_advantage`. With the outcome alone on the last token every
    token gets reward - baseline; a per-token KL penalty in the reward stays on the tokens after it.

    token_rewards (B, T), mask (B, T), baseline (B,) greedy-decoding reward of each row's prompt
    -> advantages (B, T), 0 outside the mask.
    """
    m = mask.to(token_rewards.dtype)
    to_go = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    return (to_go - baseline.to(token_rewards.dtype)[:, None]) * m


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = False, eps: float = 1e-8, sum_ranks: SumRanks = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation").

    token_rewards, values, mask (B, T) -> (advantages (B, T), returns (B, T)), both 0 outside the mask.
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next; the value after the last
    generated token is 0. Masked-out tokens (tool/observation tokens) are skipped: the recursion jumps
    over them carrying the next value and the running advantage, and their rewards/values are unused.
    returns = A + V (before whitening); `whiten` normalises the advantages over the mask (verl does).
    """
    m = mask.to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):  # loop over time, vectorised over samples
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        last_gae = m[:, t] * gae + (1 - m[:, t]) * last_gae
        adv[:, t] = last_gae
    adv = adv * m
    returns = (adv + values) * m
    if whiten:
        adv = masked_whiten(adv, m, eps, sum_ranks)
    return adv, returns


@dataclass(frozen=True)
class OutcomeInputs:
    """What every critic-free estimator reads from one step (each takes the fields it needs)."""

    rewards: torch.Tensor  # (B,) sequence rewards (minus the sum of any per-token KL penalty)
    token_rewards: torch.Tensor  # (B, T) per-token rewards (outcome on the last token, minus any KL penalty)
    mask: torch.Tensor  # (B, T) float, 1 on trained tokens
    group: torch.Tensor  # (B,) long prompt ids; groups never span data-parallel ranks
    baseline: torch.Tensor | None = None  # (B,) greedy-response reward of each row's prompt (ReMax)
    norm_by_std: bool = True  # GRPO, grpo_passk: divide by the group std (False: Dr.GRPO)
    gamma: float = 1.0  # REINFORCE++ discount
    sum_ranks: SumRanks = None  # batch-wide whitening over data-parallel ranks
    outcome: torch.Tensor | None = None  # (B,) the outcome rewards alone, before any KL penalty (None: rewards)
    outcome_baseline: str = "none"  # REINFORCE++: a group shaping of the outcome (shape_outcome)
    whiten: str = "std"  # REINFORCE++: the batch normalisation of its returns (whiten_by)
    outcome_clip: tuple = ()  # REINFORCE++ with a group shaping: (low, high) clamp of the shaped outcome
    std_scope: str = "group"  # GRPO and RLOO: batch divides by the whole batch's std (grpo_, rloo_advantages)
    # the optimal token baselines (core.token_baseline): the policy's log-probs of the response tokens, their sums of
    # squared probabilities over the vocabulary, both (B, T) from one forward; rollout IS weights (B, T) or None
    logprobs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    reward_mask: torch.Tensor | None = None  # (B, T) the mask the outcome was put by, before rejection (None: mask)


def _grpo(x: OutcomeInputs) -> torch.Tensor:
    return grpo_advantages(x.rewards, x.group, norm_by_std=x.norm_by_std, std_scope=x.std_scope, sum_ranks=x.sum_ranks)


def _grpo_vectorized(x: OutcomeInputs) -> torch.Tensor:
    # verl's trainer passes norm_adv_by_std_in_grpo to its grpo alone, so its grpo_vectorized always divides
    return grpo_advantages(x.rewards, x.group, norm_by_std=True, std_scope=x.std_scope, sum_ranks=x.sum_ranks)


def _rloo(x: OutcomeInputs) -> torch.Tensor:
    # algorithm.grpo_std_scope=batch: the batch's std, as it is GRPO's (TRL's RLOO --normalize_advantages)
    return rloo_advantages(x.rewards, x.group, batch_norm=x.std_scope == "batch", sum_ranks=x.sum_ranks)


def _reinforce_pp(x: OutcomeInputs) -> torch.Tensor:
    token_rewards = x.token_rewards
    if x.outcome_baseline != "none":  # the group shapes the outcome alone; the KL penalty stays on its tokens
        outcome = x.rewards if x.outcome is None else x.outcome
        shaped = shape_outcome(outcome, x.group, x.outcome_baseline)
        if x.outcome_clip:  # OpenRLHF clamps the shaped reward (its compute_reward), not the raw one
            shaped = shaped.clamp(*x.outcome_clip)
        shift = shaped - outcome
        # on the outcome's own token, though rejection took it out of x.mask
        token_rewards = token_rewards + outcome_token_rewards(shift, x.mask if x.reward_mask is None else x.reward_mask)
    return reinforce_pp_advantages(token_rewards, x.mask, x.gamma, sum_ranks=x.sum_ranks, whiten=x.whiten)


def _reinforce_pp_baseline(x: OutcomeInputs) -> torch.Tensor:
    return reinforce_pp_baseline_advantages(x.rewards, x.group, x.mask, sum_ranks=x.sum_ranks)


def _gpg(x: OutcomeInputs) -> torch.Tensor:
    return gpg_advantages(x.rewards, x.group, x.sum_ranks)


def _opo(x: OutcomeInputs) -> torch.Tensor:
    return opo_advantages(x.rewards, x.group, x.mask)


def _grpo_passk(x: OutcomeInputs) -> torch.Tensor:
    return passk_advantages(x.rewards, x.group, x.norm_by_std)


def _remax(x: OutcomeInputs) -> torch.Tensor:
    return remax_advantages(x.token_rewards, x.mask, x.baseline)


def _gdpo(x: OutcomeInputs) -> torch.Tensor:
    """verl's GDPO: the rewards (already `decoupled_group_sum`, in the reward stage) on every token, whitened over the
    batch's masked tokens (over every rank with `sum_ranks`)."""
    mask = x.mask.to(x.rewards.dtype)
    return masked_whiten(x.rewards[:, None] * mask, mask, sum_ranks=x.sum_ranks)


# The critic-free estimators, one signature: OutcomeInputs -> advantages (B,) or (B, T). GAE (PPO with a
# critic) is `gae_advantages`, fed by the critic's values instead.
ADVANTAGES: dict[str, Callable[[OutcomeInputs], torch.Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
    "remax": _remax,
    "gpg": _gpg,
    "gdpo": _gdpo,
    "opo": _opo,
    "grpo_passk": _grpo_passk,
    # verl's vectorized forms: rloo_vectorized is alignrl's rloo exactly (0 for a group of one, where verl's loop rloo
    # keeps the reward); grpo_vectorized gives verl's grpo's numbers with the std division on, as alignrl's grpo does
    # for every group of two or more (one alone: 0 here, r / (1 + eps) in verl; rollout.n >= 2 is checked)
    "rloo_vectorized": _rloo,
    "grpo_vectorized": _grpo_vectorized,
    "optimal_token_baseline": optimal_token_baseline,
    "tir_optimal_token_baseline": tir_optimal_token_baseline,
}
