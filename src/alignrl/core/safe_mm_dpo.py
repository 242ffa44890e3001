"""Safe-MM-DPO: DPO with two frozen judges, MM-DPO's margin-scaled β and Safe RLHF's Lagrange multiplier.
Pure tensor math; the trainer (`alignrl.preference.dpo`) supplies the scores, the log-probs and the all-reduce.

Per pair (x, y_w, y_l), from a helpfulness reward model R and a harmlessness judge whose safety score S is
higher for safer text (a cost model's cost C enters as S = -C):

* margins δ_H = R(y_w) - R(y_l), δ_S = S(y_w) - S(y_l);
* MM-DPO's dynamic scale (Zhang et al. 2025, "MM-RLHF", arXiv 2502.10391): β(δ) = β_ori·(1 + w·(1 - e^(-k|δ|))),
  clamped to [β_ori, (1+w)·β_ori]: pairs the judge separates clearly pull harder. The absolute value keeps β
  growing with the judge's confidence when a noisy label makes δ negative. β is a constant of the loss (no
  gradient flows into the judges' scores);
* two DPO losses on the same pairs, L_H with β_H = β(δ_H) and L_S with β_S = β(δ_S), mixed by the multiplier λ:
  L = L_H/(1+λ) + λ·L_S/(1+λ), plus kl_coeff·KL(π‖π_ref) on the chosen responses when kl_coeff > 0;
* after every optimizer step λ moves in log space as in Safe RLHF (Dai et al. 2023, arXiv 2310.12773, eq. 31):
  ln λ ← ln λ + λ_lr·λ·J_C, where J_C is an exponential moving average (0.95) of the policy's expected cost
  E[softmax(log π(y_w), log π(y_l))·(C_w, C_l)] + cost_threshold, and λ is clamped to [1e-6, 10]. A policy
  that puts its probability on the costlier response raises λ (safety weighs more); a safe one lowers it.

The λ step follows the reference Safe-MM-DPO script in its signs, its EMA (the first estimate is taken as it
is, then 0.95·old + 0.05·new), the order (the step uses the updated EMA and the λ before the step) and the clamp.
It differs in what J_C averages over: that script takes the last micro-batch of one rank, this one the whole
global batch of the optimizer step (every micro-batch, every rank: `ExpectedCost` is summed across ranks), so λ
is the same on every rank and the same as one process on the same global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["dynamic_beta", "safe_mm_dpo_loss", "expected_cost", "LagrangeState", "lambda_step",
           "LAMBDA_MIN", "LAMBDA_MAX", "EMA_DECAY"]

LAMBDA_MIN, LAMBDA_MAX = 1e-6, 10.0
EMA_DECAY = 0.95


def dynamic_beta(beta_ori: float, w: float, k: float, delta: torch.Tensor) -> torch.Tensor:
    """(B,) β(δ) = β_ori·(1 + w·(1 - exp(-k·|δ|))) in [β_ori, (1+w)·β_ori], without gradient."""
    d = delta.detach().abs()
    beta = beta_ori * (1.0 + w * (1.0 - torch.exp(-k * d)))
    lo, hi = beta_ori, beta_ori * (1.0 + w)
    return beta.clamp(min=min(lo, hi), max=max(lo, hi))


def _dpo_terms(h: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """(B,) -log σ(β·h), h the log-ratio gap of DPO."""
    return -F.logsigmoid(beta * h)


def safe_mm_dpo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                     global_pairs: float | None = None, *, help_chosen: torch.Tensor, help_rejected: torch.Tensor,
                     safety_chosen: torch.Tensor, safety_rejected: torch.Tensor, safety_lambda: float,
                     w: float = 0.5, k: float = 0.5, kl: torch.Tensor | None = None, kl_coeff: float = 0.0,
                     **_) -> tuple[torch.Tensor, dict[str, float]]:
    """The Safe-MM-DPO loss of B pairs (module doc). pc/pr/rc/rr: (B,) policy and reference log-probs of the
    chosen and rejected responses; `beta` is β_ori; help_*: R(y); safety_*: S(y) (higher = safer); `kl`: (B,)
    KL(π‖π_ref) of each chosen response (needed when kl_coeff > 0). As the other preference losses, the loss is
    the sum over this batch's pairs divided by `global_pairs` (default B), so the pieces of a global batch add up
    to its mean."""
    n = float(global_pairs) if global_pairs else float(max(pc.numel(), 1))
    h = (pc - rc) - (pr - rr)
    d_h, d_s = help_chosen - help_rejected, safety_chosen - safety_rejected
    beta_h, beta_s = dynamic_beta(beta, w, k, d_h), dynamic_beta(beta, w, k, d_s)
    lam = float(safety_lambda)
    loss_h, loss_s = _dpo_terms(h, beta_h).sum() / n, _dpo_terms(h, beta_s).sum() / n
    loss = loss_h / (1.0 + lam) + lam * loss_s / (1.0 + lam)
    loss_kl = torch.zeros((), device=pc.device)
    if kl_coeff > 0:
        if kl is None:
            raise ValueError("kl_coeff > 0 needs the per-pair KL of the chosen responses")
        loss_kl = kl_coeff * kl.sum() / n
        loss = loss + loss_kl
    with torch.no_grad():
        scale = n / max(pc.numel(), 1)  # the batch's own means, whatever global_pairs is
        metrics = {"loss_total": float(loss) * scale, "loss_helpful": float(loss_h) * scale,
                   "loss_safety": float(loss_s) * scale, "loss_kl": float(loss_kl) * scale,
                   "reward_helpful_mean": float(torch.cat([help_chosen, help_rejected]).mean()),
                   "reward_safety_mean": float(torch.cat([safety_chosen, safety_rejected]).mean()),
                   "delta_helpful_mean": float(d_h.mean()), "delta_safety_mean": float(d_s.mean()),
                   "lambda": lam, "beta_helpful_mean": float(beta_h.mean()), "beta_safety_mean": float(beta_s.mean()),
                   "kl_divergence": float(kl.mean()) if kl is not None else 0.0}
    return loss, metrics


def expected_cost(pc: torch.Tensor, pr: torch.Tensor, cost_chosen: torch.Tensor,
                  cost_rejected: torch.Tensor) -> tuple[float, float]:
    """(sum over pairs, number of pairs) of the policy's expected cost on each pair: the policy's choice between
    its two responses, softmax(log π(y_w), log π(y_l)), weighting their costs C = -S. Returned as a sum and a count
    so that micro-batches and ranks add up before the mean."""
    with torch.no_grad():
        p = torch.softmax(torch.stack([pc.detach().float(), pr.detach().float()], -1), -1)
        per_pair = p[:, 0] * cost_chosen.float() + p[:, 1] * cost_rejected.float()
        return float(per_pair.sum()), float(per_pair.numel())


@dataclass
class LagrangeState:
    """The multiplier λ and the moving average of J_C (None until the first optimizer step). Kept in every
    checkpoint (`state_dict`) and identical on every rank (`step` takes the global batch's mean cost)."""

    value: float
    cost_ema: float | None = None
    updates: int = 0

    def state_dict(self) -> dict:
        return {"lambda": self.value, "cost_ema": self.cost_ema, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        ema = state.get("cost_ema")
        self.value, self.cost_ema = float(state["lambda"]), None if ema is None else float(ema)
        self.updates = int(state.get("updates", 0))

    def step(self, mean_cost: float, lambda_lr: float, cost_threshold: float) -> None:
        """One update after an optimizer step (`lambda_step`)."""
        self.value, self.cost_ema = lambda_step(self.value, self.cost_ema, mean_cost, lambda_lr, cost_threshold)
        self.updates += 1


def lambda_step(value: float, cost_ema: float | None, mean_cost: float, lambda_lr: float,
                cost_threshold: float) -> tuple[float, float | None]:
    """One Safe RLHF update of λ from the global batch's mean expected cost: J = E[C] + d, EMA ← J (first step) or
    0.95·EMA + 0.05·J, ln λ ← ln λ + λ_lr·λ·EMA, λ clamped to [1e-6, 10]; returns (λ, EMA). A non-finite cost
    leaves both as they were."""
    if not math.isfinite(mean_cost):
        return value, cost_ema
    j = mean_cost + cost_threshold
    ema = j if cost_ema is None else EMA_DECAY * cost_ema + (1.0 - EMA_DECAY) * j
    log_lam = math.log(value) + lambda_lr * value * ema
    return min(max(math.exp(min(log_lam, 50.0)), LAMBDA_MIN), LAMBDA_MAX), ema
