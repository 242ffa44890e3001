"""Pairwise preference losses: reward model, cost model and the DPO family. Pure tensor functions.

Shapes: B preference pairs. Scores are one scalar per response (B,); log-probs are per-sequence sums
over response tokens (B,). Every loss returns `(loss, metrics)`: the loss is the SUM over this batch's
pairs divided by `global_pairs` (the number of pairs in the global batch across ranks and
micro-batches; defaults to B), so summing the losses of any split of a batch gives the loss of the
whole batch, which is what the training engines expect. Metrics are plain floats over this batch.

Safe-MM-DPO (`safe_mm_dpo`: two judges, margin-scaled β, a Lagrange multiplier that moves) lives in
`alignrl.core.safe_mm_dpo` and is listed in DPO_LOSSES with the others; `safe_odpo` (once `safe`) is the fixed-λ
utility order with an ODPO offset.

TRL's other pairwise losses (robust, exo_pair, nca_pair, sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop)
follow its formulas, and so do the reference-free losses of its CPO and ORPO trainers (simpo, cpo, orpo: the caller
passes zeros for the reference). ipo_token_mean is TRL's IPO: the IPO loss on token-mean log-probs of the policy
and the reference (the caller divides; `ipo` takes sums, as OpenRLHF's). bco_pair reads δ, a running mean of the
rewards over the micro-batches so far (`RewardMean`), which the trainer keeps, shares across ranks and checkpoints. `sft_loss` (the chosen responses' NLL)
is a part of TRL's multi-loss DPO, never a loss_type alone. Left out on purpose: KTO's unpaired data and
listwise/ranking losses; they need different data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from alignrl.core.safe_mm_dpo import safe_mm_dpo_loss

__all__ = ["safe_mm_dpo_loss", "bradley_terry_loss", "safe_rlhf_cost_loss", "dpo_sigmoid_loss", "dpo_ipo_loss",
           "slic_hinge_loss", "odpo_loss", "safe_preference_offset", "safe_odpo_loss", "DPO_LOSSES",
           "reward_accuracy"]


def _norm(n: int, global_pairs: float | None) -> float:
    return float(global_pairs) if global_pairs else float(max(n, 1))


def reward_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(B,) 1 where chosen > rejected, 0 where below, 0.5 on ties: chance is 0.5, and a DPO policy that
    still equals its reference (all implicit rewards 0) scores exactly chance instead of 0."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


# ---------------------------------------------------------------- reward and cost models


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | None = None, global_pairs: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Pairwise reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022, "InstructGPT"):
    -log σ(r_c - r_r - m). `margin` (B,) is the Llama-2 preference margin m(r) (Touvron et al. 2023,
    "Llama 2"): the chosen score must exceed the rejected one by m; None means m = 0."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).sum() / _norm(diff.numel(), global_pairs)
    with torch.no_grad():
        metrics = {"rm/accuracy": float(reward_accuracy(chosen_scores, rejected_scores).mean()),
                   "rm/score_margin": float((chosen_scores - rejected_scores).mean()),
                   "rm/chosen_score": float(chosen_scores.mean()),
                   "rm/rejected_score": float(rejected_scores.mean())}
    return loss, metrics


def safe_rlhf_cost_loss(chosen_costs: torch.Tensor, rejected_costs: torch.Tensor, chosen_unsafe: torch.Tensor,
                        rejected_unsafe: torch.Tensor, global_pairs: float | None = None, sign_weight: float = 1.0
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """Cost-model loss of Safe RLHF (Dai et al. 2023, "Safe RLHF").

    The preferred ("chosen") response is the safer one, so the rejected one is the more harmful y_w of
    the paper: -log σ(c_r - c_c) orders the pair, and -log σ(s·c) for each response, with s = +1 when
    that response is unsafe and -1 when safe, pins the sign: c > 0 means harmful, c < 0 safe, which is
    what makes `E[c] <= 0` a meaningful constraint in PPO-Lagrangian. `*_unsafe` are (B,) bool/float.
    `sign_weight` scales the sign (classification) term; 0 leaves the pairwise term alone, whose costs then have
    no meaningful zero."""
    s_c = 2.0 * chosen_unsafe.float() - 1.0
    s_r = 2.0 * rejected_unsafe.float() - 1.0
    pair = -F.logsigmoid(rejected_costs - chosen_costs)
    sign = -F.logsigmoid(s_c * chosen_costs) - F.logsigmoid(s_r * rejected_costs)
    loss = (pair + sign_weight * sign).sum() / _norm(pair.numel(), global_pairs)
    with torch.no_grad():
        sign_ok = torch.cat([(chosen_costs > 0) == chosen_unsafe.bool(), (rejected_costs > 0) == rejected_unsafe.bool()])
        metrics = {"cost/accuracy": float(reward_accuracy(rejected_costs, chosen_costs).mean()),
                   "cost/sign_accuracy": float(sign_ok.float().mean()),
                   "cost/pair_loss": float(pair.mean()), "cost/sign_loss": float(sign.mean()),
                   "cost/chosen_cost": float(chosen_costs.mean()),
                   "cost/rejected_cost": float(rejected_costs.mean())}
    return loss, metrics


# ---------------------------------------------------------------- DPO family
# Each takes (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
# global_pairs) as (B,) sequence log-prob sums, plus keywords some variants read. TRL's DPOTrainer options
# (`alignrl.core.dpo_options`): `h`, the logits when an f-divergence replaces DPO's h (the losses of h read it), and
# `pair_weight`, WPO's (B,) weights of the pairs' losses (every loss of TRL's DPOTrainer reads it).


def _dpo_metrics(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                 losses: torch.Tensor) -> dict[str, float]:
    """The implicit rewards β·(log π - log π_ref) of DPO (Rafailov et al. 2023)."""
    with torch.no_grad():
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        return {"dpo/loss": float(losses.mean()), "rewards/chosen": float(chosen.mean()),
                "rewards/rejected": float(rejected.mean()),
                "rewards/accuracy": float(reward_accuracy(chosen, rejected).mean()),
                "rewards/margin": float((chosen - rejected).mean()),
                "logps/chosen": float(pc.mean()), "logps/rejected": float(pr.mean())}


def _h(pc, pr, rc, rr, h: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) log-ratio difference h = (log π_c - log π_ref,c) - (log π_r - log π_ref,r), or the `h` given."""
    return (pc - rc) - (pr - rr) if h is None else h


def _pairwise(losses: torch.Tensor, pc, pr, rc, rr, beta: float, global_pairs: float | None,
              pair_weight: torch.Tensor | None = None):
    if pair_weight is not None:  # WPO: the pair's whole loss, as TRL weighs it
        losses = losses * pair_weight
    return losses.sum() / _norm(losses.numel(), global_pairs), _dpo_metrics(pc, pr, rc, rr, beta, losses)


def dpo_sigmoid_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                     global_pairs: float | None = None, *, label_smoothing: float = 0.0, h=None, pair_weight=None,
                     **_) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7): -log σ(β·h). With label smoothing
    ε it is conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"), as TRL's sigmoid loss:
    each label flipped with probability ε, -(1-ε)·log σ(β·h) - ε·log σ(-β·h)."""
    z = beta * _h(pc, pr, rc, rr, h)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def dpo_ipo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                 global_pairs: float | None = None, *, h=None, pair_weight=None, **_
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences"): (h - 1/(2τ))², with τ = beta. It regresses the log-ratio gap to a finite
    target, so it does not push it to infinity on deterministic preferences as DPO does."""
    losses = (_h(pc, pr, rc, rr, h) - 1.0 / (2.0 * beta)) ** 2
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def slic_hinge_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                    global_pairs: float | None = None, *, h=None, pair_weight=None, **_
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Hinge (SLiC-HF, Zhao et al. 2023, "Calibrating Sequence Likelihood..."; on the reference-
    normalised gap as in Liu et al. 2024, RSO): max(0, 1 - β·h)."""
    losses = torch.relu(1.0 - beta * _h(pc, pr, rc, rr, h))
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def odpo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
              global_pairs: float | None = None, *, offset: torch.Tensor | None = None, **_
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO with an offset (Amini et al. 2024, "Direct Preference Optimization with an Offset"):
    -log σ(β·h - Δ). The preferred response must beat the other by the margin Δ (B,), not just win."""
    z = beta * _h(pc, pr, rc, rr)
    if offset is not None:
        z = z - offset
    losses = -F.logsigmoid(z)
    metrics = _dpo_metrics(pc, pr, rc, rr, beta, losses)
    if offset is not None:
        metrics["safe/offset"] = float(offset.mean())
    return losses.sum() / _norm(losses.numel(), global_pairs), metrics


def safe_preference_offset(help_a: torch.Tensor, help_b: torch.Tensor, cost_a: torch.Tensor, cost_b: torch.Tensor,
                           safety_lambda: float, offset_alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which response of each pair (a, b) is preferred, and by how much, from a helpfulness reward
    model and a harmlessness cost model (all (B,)).

    The combined utility is the Lagrangian of Safe RLHF (Dai et al. 2023) at a fixed
    multiplier: u = r_help - λ·c_harm. Returns (swap (B,) bool: True where b is preferred over a,
    offset (B,) >= 0): Δ = α·log(1 + |u_a - u_b|), ODPO's offset as a monotone function of the score
    gap (Amini et al. 2024); log(1 + ·) gives no offset at equal utilities and keeps large gaps of
    unnormalised scorers from demanding huge margins."""
    u_a = help_a - safety_lambda * cost_a
    u_b = help_b - safety_lambda * cost_b
    swap = u_b > u_a
    offset = offset_alpha * torch.log1p((u_a - u_b).abs())
    return swap, offset.detach()


def safe_odpo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float,
                   global_pairs: float | None = None, *, help_chosen: torch.Tensor, help_rejected: torch.Tensor,
                   cost_chosen: torch.Tensor, cost_rejected: torch.Tensor, safety_lambda: float = 1.0,
                   offset_alpha: float = 0.5, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """Safety-aware DPO: the pair's order comes from the Safe RLHF utility r - λ·c of the two frozen
    scorers (a labelled "chosen" that the scorers rank below "rejected" is trained the other way), and
    the margin from ODPO's offset on the utility gap (see `safe_preference_offset`). With equal scores
    it is plain DPO on the labelled order."""
    swap, offset = safe_preference_offset(help_chosen, help_rejected, cost_chosen, cost_rejected, safety_lambda,
                                          offset_alpha)
    w_pc, w_pr = torch.where(swap, pr, pc), torch.where(swap, pc, pr)
    w_rc, w_rr = torch.where(swap, rr, rc), torch.where(swap, rc, rr)
    loss, metrics = odpo_loss(w_pc, w_pr, w_rc, w_rr, beta, global_pairs, offset=offset)
    metrics["safe/swapped_frac"] = float(swap.float().mean())
    # reward metrics stay on the labelled order, comparable with the other losses and the held-out eval
    metrics.update({k: v for k, v in _dpo_metrics(pc, pr, rc, rr, beta, torch.zeros(1)).items()
                    if k.startswith("rewards/")})
    return loss, metrics


# ---------------------------------------------------------------- TRL's other pairwise losses (DPOConfig.loss_type)


def robust_dpo_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, label_smoothing: float = 0.0,
                    h=None, pair_weight=None, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """rDPO (Chowdhury et al. 2024, "Provably Robust DPO"): an unbiased loss under labels flipped with probability ε,
    ((1-ε)·(-log σ(z)) + ε·log σ(-z)) / (1 - 2ε), z = β·h."""
    z = beta * _h(pc, pr, rc, rr, h)
    losses = (-(1.0 - label_smoothing) * F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (
        1.0 - 2.0 * label_smoothing)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def exo_pair_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, label_smoothing: float = 0.0,
                  h=None, pair_weight=None, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """EXO (Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment", eq. 16): the reverse
    KL from the label distribution (1-ε, ε) to σ(±z); ε = label_smoothing, 1e-3 when 0 (as TRL)."""
    eps = label_smoothing or 1e-3
    z = beta * _h(pc, pr, rc, rr, h)
    losses = z.sigmoid() * (F.logsigmoid(z) - math.log(1.0 - eps)) + (-z).sigmoid() * (F.logsigmoid(-z)
                                                                                       - math.log(eps))
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def nca_pair_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, pair_weight=None, **_
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """NCA (Chen et al. 2024, "Noise Contrastive Alignment"): -log σ(r_c) - ½·log σ(-r_c) - ½·log σ(-r_r) on the
    implicit rewards r = β·(log π - log π_ref); it raises the chosen response's own likelihood, not just the gap."""
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    losses = -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def sppo_hard_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, pair_weight=None, **_
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """SPPO with hard probabilities (Wu et al. 2024, "Self-Play Preference Optimization", eq. 4.7 with P = 1 for the
    winner, 0 for the loser): (a - 1/(2β))² + (b + 1/(2β))², a and b the two log-ratios to the reference."""
    losses = (pc - rc - 0.5 / beta) ** 2 + (pr - rr + 0.5 / beta) ** 2
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def aot_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, label_smoothing: float = 0.0,
             paired: bool = False, pair_weight=None, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """AOT (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport"): the sigmoid
    loss on sorted quantities of the micro-batch (so, as TRL's, it depends on how the batch is split): `paired`
    (aot_pair) sorts the chosen and the rejected log-ratios apart; aot sorts the policy's and the reference's
    chosen-minus-rejected gaps apart."""
    if paired:
        delta = torch.sort(pc - rc, dim=0)[0] - torch.sort(pr - rr, dim=0)[0]
    else:
        delta = torch.sort(pc - pr, dim=0)[0] - torch.sort(rc - rr, dim=0)[0]
    z = beta * delta
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def apo_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, down: bool = False, pair_weight=None,
             **_
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """APO (D'Oosterlinck et al. 2024, "Anchored Preference Optimization", eqs. 7 and 8). apo_zero, when the chosen
    responses beat the model's own: raise the chosen likelihood, lower the rejected, 1 - σ(β·a) + σ(β·b).
    apo_down, when they do not: lower both, the rejected more, σ(β·a) + 1 - σ(β·(a - b))."""
    a, b = pc - rc, pr - rr
    if down:
        losses = torch.sigmoid(beta * a) + 1.0 - torch.sigmoid(beta * (a - b))
    else:
        losses = 1.0 - torch.sigmoid(beta * a) + torch.sigmoid(beta * b)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def discopop_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, discopop_tau: float = 0.05,
                  pair_weight=None, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """DiscoPOP (Chris Lu et al. 2024, "Discovering Preference Optimization Algorithms with and for LLMs", eq. 5):
    the logistic and the exponential loss of z = β·h, blended by σ(z/τ) (τ = discopop_tau)."""
    z = beta * _h(pc, pr, rc, rr)
    mix = torch.sigmoid(z / discopop_tau)
    losses = -F.logsigmoid(z) * (1.0 - mix) + torch.exp(-z) * mix
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)


def bco_pair_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, bco_delta: float = 0.0,
                  pair_weight=None, **_
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """BCO on pairs (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment"), TRL's
    bco_pair: each response a binary classification of its implicit reward r = β·(log π - log π_ref) shifted by δ,
    -log σ(r_c - δ) - log σ(-(r_r - δ)); δ = bco_delta, the running mean of the rewards (`RewardMean`)."""
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    losses = -F.logsigmoid(chosen - bco_delta) - F.logsigmoid(-(rejected - bco_delta))
    loss, metrics = _pairwise(losses, pc, pr, rc, rr, beta, global_pairs, pair_weight)
    metrics["bco/delta"] = float(bco_delta)
    return loss, metrics


class RewardMean:
    """bco_pair's δ: the running mean of the micro-batches' mean rewards, as TRL's RunningMoments keeps it (its mean;
    the variance is not read). Each update brings `count` values (TRL: one per rank) whose mean is `batch_mean`;
    the mean starts at 0 with a count of 1e-24, so the first update sets it. A non-finite batch mean (a step the
    engine then skips) is left out, so that one bad micro-batch does not turn every later loss into NaN."""

    def __init__(self) -> None:
        self.mean, self.count = 0.0, 1e-24

    def update(self, batch_mean: float, count: float = 1.0) -> float:
        if not math.isfinite(batch_mean):
            return self.mean
        total = self.count + count
        self.mean += (batch_mean - self.mean) * count / total
        self.count = total
        return self.mean

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.count = float(state["mean"]), float(state["count"])


def sft_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, nll: torch.Tensor, pair_weight=None,
             **_
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """The chosen responses' NLL (`nll`, (B,)), "sft" in TRL's multi-loss DPO (MPO: Wang et al. 2024, "Enhancing the
    Reasoning Ability of Multimodal Large Language Models via Mixed Preference Optimization")."""
    return _pairwise(nll, pc, pr, rc, rr, beta, global_pairs, pair_weight)


# ---------------------------------------------------------------- reference-free (rc = rr = 0 is passed)


def simpo_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, simpo_gamma: float = 0.5,
               label_smoothing: float = 0.0, **_) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO (Meng et al. 2024, "Simple Preference Optimization with a Reference-Free Reward"): -log σ(β·(ā_c - ā_r)
    - γ) on the responses' token-mean log-probs ā (pc, pr), γ = simpo_gamma; label smoothing as TRL's CPO."""
    z = beta * (pc - pr) - simpo_gamma
    losses = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return _pairwise(losses, pc, pr, rc, rr, beta, global_pairs)


def orpo_loss(pc, pr, rc, rr, beta: float, global_pairs: float | None = None, *, nll: torch.Tensor, **_
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """ORPO (Hong et al. 2024, "Monolithic Preference Optimization without Reference Model"): the chosen responses'
    NLL (`nll`, (B,)) minus λ·log σ(log odds(ā_c) - log odds(ā_r)), odds(ā) = e^ā / (1 - e^ā), on token-mean
    log-probs ā (pc, pr), λ = beta. A token mean of exactly 0 (every token certain) is held just below it."""
    c, r = pc.clamp(max=-1e-6), pr.clamp(max=-1e-6)
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds)
    losses = nll - beta * ratio
    loss, metrics = _pairwise(losses, pc, pr, rc, rr, beta, global_pairs)
    metrics.update({"orpo/log_odds_ratio": float(ratio.detach().mean()),
                    "orpo/log_odds_chosen": float(log_odds.detach().mean())})
    return loss, metrics


DpoLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]

DPO_LOSSES: dict[str, DpoLoss] = {
    "safe_mm_dpo": safe_mm_dpo_loss,  # alignrl.core.safe_mm_dpo
    "safe_odpo": safe_odpo_loss,
    "sigmoid": dpo_sigmoid_loss,
    "cdpo": dpo_sigmoid_loss,  # the name some recipes give the sigmoid loss with label smoothing
    "ipo": dpo_ipo_loss,
    "ipo_token_mean": dpo_ipo_loss,  # TRL's ipo: on the token means of policy and reference log-probs
    "hinge": slic_hinge_loss,
    "safe": safe_odpo_loss,  # the older name of safe_odpo
    "robust": robust_dpo_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_pair": functools.partial(aot_loss, paired=True),
    "apo_zero": apo_loss,
    "apo_down": functools.partial(apo_loss, down=True),
    "discopop": discopop_loss,
    "bco_pair": bco_pair_loss,
    "simpo": simpo_loss,
    "cpo": dpo_sigmoid_loss,  # CPO: DPO's loss on the policy's own log-probs (with its NLL term: nll_loss_coef)
    "orpo": orpo_loss,
}
# the losses of sorted batch quantities: a micro-batch's loss depends on the rest of its batch
BATCH_SORTED_LOSSES = ("aot", "aot_pair")
