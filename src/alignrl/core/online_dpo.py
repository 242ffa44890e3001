"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's OnlineDPOTrainer)
as advantages of the RL loop. Pure tensor functions.

Each prompt's two sampled answers form a pair: the one of higher reward is chosen (a tie: the first, as TRL's
`first >= second`). The DPO loss of the pairs (sigmoid or IPO, `core.preference`) reads the answers' summed log-probs
under the policy and the reference. Its gradient with respect to a sequence's summed log-prob, ∂L/∂S_i, is all the
update needs: the per-token loss -A_i · log π aggregated as seq-mean-token-sum (a token sum per sequence, averaged
over the 2P sequences) has the gradient -A_i / 2P on each of row i's tokens, so A_i = -2P · ∂L/∂S_i makes the update
the DPO loss's own gradient at the weights the log-probs were taken with. That holds for one optimizer step per batch
taken from those weights, which is TRL's online DPO: one step per generated batch. The log-probs are taken at
temperature 1, as TRL's (`RunConfig.logprob_temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignrl.core.preference import DPO_LOSSES

ONLINE_DPO_LOSSES = ("sigmoid", "ipo")  # TRL's OnlineDPOConfig.loss_type


@dataclass(frozen=True)
class PairInputs:
    """One batch of rows, two per prompt, in the loop's group order."""
    rewards: torch.Tensor  # (B,) each answer's reward
    group: torch.Tensor  # (B,) the prompt index of each row; each index exactly twice
    logp_sums: torch.Tensor  # (B,) the answer's log-prob under the policy the batch trains from, summed over its tokens
    ref_sums: torch.Tensor  # (B,) the same under the reference


def pair_rows(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second): the row indices of each prompt's two answers, in order of the prompts' first rows. A prompt
    with other than two rows is a ValueError (the config asks for rollout.n=2; a dynamic filter keeps whole groups)."""
    order = torch.argsort(group, stable=True)
    ids, counts = torch.unique_consecutive(group[order], return_counts=True)
    if len(ids) and not bool((counts == 2).all()):
        bad = int(ids[counts != 2][0])
        raise ValueError(f"online DPO pairs two answers per prompt; prompt {bad} has {int(counts[ids == bad][0])}: "
                         "set rollout.n=2")
    pairs = order.view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def chosen_rejected(x: PairInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (P,) of each pair's chosen and rejected answer: the higher reward, a tie going to the first."""
    first, second = pair_rows(x.group)
    first_wins = x.rewards[first] >= x.rewards[second]
    return torch.where(first_wins, first, second), torch.where(first_wins, second, first)


def online_dpo_advantages(x: PairInputs, beta: float, loss_type: str = "sigmoid", xpo_alpha: float | None = None,
                          first_chosen: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-row advantages (B,) whose -A·log π update, aggregated as seq-mean-token-sum, is the gradient of the pairs'
    mean DPO loss (`loss_type`: sigmoid or ipo) at the log-probs given; and the loss's metrics (`dpo/loss`,
    `rewards/chosen`, ... as the offline DPO trainer logs them, plus the answers' reward margin).

    `xpo_alpha`: XPO's loss (Xie et al. 2024; TRL's XPOTrainer), each pair's second answer the reference model's:
    the DPO loss plus alpha times the policy's summed log-prob of that answer, whose descent makes what the
    reference would say less likely, so the policy explores away from it. A tie of rewards goes to the policy's
    answer (the first), as TRL's `model_scores >= ref_scores`.

    `first_chosen`: SPIN's pairs (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong
    Language Models"), each prompt's first answer its target response and the second the opponent's: the target is
    chosen whatever the rewards say (they are logged, not read)."""
    if loss_type not in ONLINE_DPO_LOSSES:
        raise ValueError(f"online DPO loss {loss_type!r}: choose one of {', '.join(ONLINE_DPO_LOSSES)}")
    chosen, rejected = pair_rows(x.group) if first_chosen else chosen_rejected(x)
    pairs = len(chosen)
    sums = x.logp_sums.detach().double().requires_grad_(True)  # in float64: the weights of near-equal pairs
    ref = x.ref_sums.detach().double()
    with torch.enable_grad():
        loss, metrics = DPO_LOSSES[loss_type](sums[chosen], sums[rejected], ref[chosen], ref[rejected], beta,
                                              float(max(pairs, 1)))
        if xpo_alpha is not None:
            second = pair_rows(x.group)[1]
            exploration = xpo_alpha * sums[second].sum() / max(pairs, 1)
            loss = loss + exploration
            metrics["xpo/loss"] = float(exploration.detach())
            metrics["xpo/policy_chosen"] = float((chosen != second).double().mean()) if pairs else 0.0
        (grad,) = torch.autograd.grad(loss, sums)
    advantages = (-2.0 * max(pairs, 1) * grad).to(x.logp_sums.dtype)
    metrics["online_dpo/kl"] = float((x.logp_sums - x.ref_sums).mean())  # TRL's objective/kl: per answer, summed
    metrics["online_dpo/scores_margin"] = float((x.rewards[chosen] - x.rewards[rejected]).mean()) if pairs else 0.0
    return advantages, metrics
