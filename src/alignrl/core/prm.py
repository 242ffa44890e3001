"""The loss of a process reward model (PRM) as OpenRLHF's `PRMLoss` computes it, over a causal LM's logits. Pure
tensor functions.

A row is a solution whose every step ends in a placeholder token; each step has a label. The model's logits AT the
placeholder position (its prediction of the token after the placeholder) are read over the K reward tokens alone
(e.g. "+" and "-"): a softmax over those K logits is the model's belief in each label, and the loss is the
cross-entropy of that belief against the step's target distribution over the K tokens:

* a hard label names one reward token: the target is one-hot (OpenRLHF's labels given as tokens);
* a soft label p in [0, 1] (two reward tokens only): the target is (p, 1 - p), p on the first reward token, the
  positive one (OpenRLHF's float labels).

Step accuracy is OpenRLHF's: the arg-max of the K logits equals the arg-max of the target (for a soft label, the
first token on a tie, as torch's arg-max). Only the positions `step_mask` marks count; every other position (the
text, padding, steps left out of training) is ignored whatever its logits and targets hold.

The loss returned is the SUM of the marked steps' cross-entropies divided by `total_steps` (every step of the
optimizer step, over micro-batches and ranks), so any split of a batch adds up to the whole batch's step mean; without
`total_steps` it is this batch's own step mean. (OpenRLHF's `PRMLoss` is each micro-batch's own step mean, averaged
over micro-batches: the same only with one micro-batch per optimizer step; here every step weighs the same.)

OpenRLHF's other mode, its `--reward_tokens` unset (`prm_vocab_loss`): a hard label is the id of its label token, and
the cross-entropy is over the WHOLE vocabulary at each marked position; a step is right when the vocabulary's arg-max
is the label token. Normalisation and metrics are the same as above.
"""

from __future__ import annotations

import torch


def reward_log_probs(logits: torch.Tensor, reward_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """(..., K) log-softmax over the K reward tokens' logits of (..., V) logits, in float32."""
    ids = torch.as_tensor(reward_ids, dtype=torch.long, device=logits.device)
    return torch.log_softmax(logits.index_select(-1, ids).float(), dim=-1)


def step_terms(logits: torch.Tensor, step_mask: torch.Tensor, targets: torch.Tensor,
               reward_ids: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy (N,), correct (N,) bool) of the N positions `step_mask` (B, T) marks: `logits` (B, T, V),
    `targets` (B, T, K) each a distribution over the K reward tokens (rows at unmarked positions are never read).
    The logits are gathered at the marked positions first: the (N, V) rows alone go to float32."""
    picked = reward_log_probs(logits[step_mask], reward_ids)  # (N, K)
    target = targets[step_mask].to(picked.dtype)
    ce = -(target * picked).sum(-1)
    return ce, picked.argmax(-1) == target.argmax(-1)


def prm_loss(logits: torch.Tensor, step_mask: torch.Tensor, targets: torch.Tensor,
             reward_ids: torch.Tensor | list[int], total_steps: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, metrics) of a batch: the summed step cross-entropy over `total_steps` (default: this batch's marked
    steps). Metrics: this batch's step-mean loss (prm/loss) and its correct and counted steps as `acc_sum` and
    `acc_count`, which `preference.common.totals_per_count` turns into an exact accuracy over micro-batches and
    ranks. A batch with no marked step gives a zero loss that still reaches every parameter (a backward needs it)."""
    return reduced(logits, *step_terms(logits, step_mask, targets, reward_ids), total_steps)


def reduced(logits: torch.Tensor, ce: torch.Tensor, correct: torch.Tensor, total_steps: float | None
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, metrics) of the marked steps' (cross-entropy, correct): `prm_loss`'s normalisation and metrics."""
    n = int(ce.numel())
    if n == 0:
        return logits.sum() * 0.0, {"prm/loss": 0.0, "acc_sum": 0.0, "acc_count": 0.0}
    loss = ce.sum() / float(total_steps if total_steps else n)
    return loss, {"prm/loss": float(ce.detach().mean()), "acc_sum": float(correct.sum()), "acc_count": float(n)}


def label_token_ids(targets: torch.Tensor, reward_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """(B, T) the token id of each position's hard label: the reward token its one-hot (B, T, K) target names (an
    all-zero target, an unmarked position, reads as the first token; nothing reads it)."""
    ids = torch.as_tensor(reward_ids, dtype=torch.long, device=targets.device)
    return ids[targets.argmax(-1)]


def vocab_step_terms(logits: torch.Tensor, step_mask: torch.Tensor, label_ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy (N,), correct (N,) bool) over the whole vocabulary at the N positions `step_mask` (B, T)
    marks: `logits` (B, T, V), `label_ids` (B, T) each step's label token id (unmarked positions are never read).
    Correct: the vocabulary's arg-max is the label token (OpenRLHF's accuracy with --reward_tokens unset)."""
    picked = torch.log_softmax(logits[step_mask].float(), dim=-1)  # (N, V): only the marked rows go to float32
    labels = label_ids[step_mask].to(device=picked.device, dtype=torch.long)
    ce = -picked.gather(-1, labels[:, None]).squeeze(-1)
    return ce, picked.argmax(-1) == labels


def prm_vocab_loss(logits: torch.Tensor, step_mask: torch.Tensor, label_ids: torch.Tensor,
                   total_steps: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """`prm_loss` with the cross-entropy over the whole vocabulary against each step's label token id (`label_ids`
    (B, T)): the same normalisation by `total_steps` and the same metrics."""
    return reduced(logits, *vocab_step_terms(logits, step_mask, label_ids), total_steps)


def positive_probs(logits: torch.Tensor, step_mask: torch.Tensor, reward_ids: torch.Tensor | list[int]
                   ) -> torch.Tensor:
    """(N,) the probability of the first reward token (the positive label) at each marked step, in row order."""
    return reward_log_probs(logits[step_mask], reward_ids)[:, 0].exp()
