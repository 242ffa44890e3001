"""KTO on unpaired feedback (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"), as
TRL's `KTOTrainer` and OpenRLHF's `KTOLoss` compute it, and TRL's unpaired APO-zero. Pure tensor functions.

Shapes: B rows, each a prompt with one completion labelled desirable or not. Log-probs are sums over the completion's
tokens (B,). The implicit reward of a row is β·(log π - log π_ref).

* kto: the reference point z0 is an estimate of KL(π‖π_ref): the mean of log π - log π_ref over mismatched
  (prompt_i, completion_j) pairs, clamped at 0 and detached (no gradient flows through it). A desirable row's loss
  is 1 - σ(β·(logratio - z0)), an undesirable row's 1 - σ(β·(z0 - logratio)).
* apo_zero_unpaired: no reference point; 1 - σ(β·logratio) for a desirable row, σ(β·logratio) for an
  undesirable one.

Each row's loss is multiplied by desirable_weight or undesirable_weight. Like `core.preference`, the loss returned is
the SUM over this batch's rows divided by `global_rows` (every row of the optimizer step, over micro-batches and
ranks), so the losses of any split of a batch add up to the loss of the whole batch, given the same z0.
"""

from __future__ import annotations

import torch

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
NEEDS_KL = ("kto",)  # the losses that read the reference point z0


def kl_estimate(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """The mean of log π - log π_ref over mismatched pairs (detached, not yet clamped: the caller averages it over
    ranks first, as TRL and OpenRLHF clamp the mean of all ranks)."""
    return (policy_kl_logps.detach().float() - ref_kl_logps.detach().float()).mean()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, beta: float,
             kl: torch.Tensor | float = 0.0, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             global_rows: float | None = None, loss_type: str = "kto") -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, metrics) of B rows; `desirable` (B,) bool; `kl`: the raw KL estimate (clamped at 0 here), read by
    loss_type kto alone. Metrics: the weighted mean loss of these rows (kto/loss), the mean implicit reward of their
    desirable and undesirable rows (rewards/chosen, rewards/rejected; 0.0 when there are none) and z0 (kl)."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; one of {', '.join(KTO_LOSS_TYPES)}")
    logratio = policy_logps.float() - ref_logps.float()
    good = desirable.bool()
    z0 = torch.as_tensor(kl, dtype=logratio.dtype, device=logratio.device).detach().clamp(min=0.0)
    if loss_type == "kto":
        per_row = torch.where(good, 1 - torch.sigmoid(beta * (logratio - z0)),
                              1 - torch.sigmoid(beta * (z0 - logratio)))
    else:  # apo_zero_unpaired: push desirable likelihoods up and undesirable ones down, from the reference
        per_row = torch.where(good, 1 - torch.sigmoid(beta * logratio), torch.sigmoid(beta * logratio))
    weights = torch.where(good, torch.full_like(per_row, desirable_weight),
                          torch.full_like(per_row, undesirable_weight))
    weighted = per_row * weights
    n = float(global_rows) if global_rows else float(max(per_row.numel(), 1))
    loss = weighted.sum() / n
    with torch.no_grad():
        rewards = beta * logratio
        # a micro-batch may hold rows of one kind only: sums and counts, which the step's log divides in total
        metrics = {"kto/loss": float(weighted.mean()) if weighted.numel() else 0.0,
                   "rewards/chosen_sum": float(rewards[good].sum()), "rewards/chosen_count": float(good.sum()),
                   "rewards/rejected_sum": float(rewards[~good].sum()), "rewards/rejected_count": float((~good).sum()),
                   "kl": float(z0) if loss_type in NEEDS_KL else 0.0}
    return loss, metrics


def weight_balance(n_desirable: int, n_undesirable: int, desirable_weight: float,
                   undesirable_weight: float) -> float | None:
    """(desirable rows × desirable_weight) / (undesirable rows × undesirable_weight), which the KTO paper (and TRL's
    warning) recommends keeping within [1, 4/3]; None when either side has no row or no weight."""
    if n_undesirable * undesirable_weight <= 0 or n_desirable * desirable_weight <= 0:
        return None
    return (n_desirable * desirable_weight) / (n_undesirable * undesirable_weight)
