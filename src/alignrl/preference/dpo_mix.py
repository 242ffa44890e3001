"""bco_pair's running reward mean across ranks, and TRL's multi-loss DPO (MPO): a list loss_type's weighted sum.

bco_pair's δ (`core.preference.RewardMean`) moves with every micro-batch, as TRL's DPOTrainer updates its
RunningMoments at every loss: each rank's mean reward of the micro-batch (chosen and rejected responses together) is
averaged over ranks (TRL gathers one value per rank) and enters the running mean with a count of the world size. It
is the same on every rank, saved in the DPO checkpoint and restored on resume (`preference.checkpoints`).

A list loss_type, e.g. [sigmoid,bco_pair,sft] with loss_weights [0.8,0.2,1.0], trains Σ w_i·loss_i over its
losses, each on the inputs it reads alone (simpo's and ipo_token_mean's token means, the others' sums; sft: the
chosen responses' NLL, each response's token mean), and logs each loss's own per-pair mean as `loss/<name>`.

`trl_keywords` gives a loss the keywords of TRL's DPOTrainer options it reads: the logits under f_divergence_type
(each loss of a list on its own inputs) and WPO's pair weights (use_weighting).
"""

from __future__ import annotations

import torch

from alignrl.core.dpo_options import f_divergence_logits
from alignrl.core.preference import DPO_LOSSES, RewardMean, sft_loss
from alignrl.preference.configs import F_DIVERGENCE_LOSSES, LENGTH_NORMALISED, DPOConfig
from alignrl.preference.pair_logps import token_means


def uses_bco(cfg: DPOConfig) -> bool:
    names = cfg.loss_type if isinstance(cfg.loss_type, (list, tuple)) else [cfg.loss_type]
    return "bco_pair" in names


class BcoDelta:
    """bco_pair's δ of a run, shared by its ranks."""

    def __init__(self, env) -> None:
        self.env, self.running = env, RewardMean()

    def update(self, pc, pr, rc, rr, beta: float) -> float:
        """Takes in this micro-batch's rewards (a collective: every rank runs the same micro-batches); returns δ."""
        from alignrl.runtime.env import all_reduce_sum

        with torch.no_grad():
            mine = float(torch.cat([beta * (pc - rc), beta * (pr - rr)]).mean())
        world = self.env.world_size
        return self.running.update(all_reduce_sum(self.env, [mine])[0] / world, float(world))

    def state_dict(self) -> dict[str, float]:
        return self.running.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.running.load_state_dict(state)


def trl_keywords(cfg: DPOConfig, name: str, pc, pr, rc, rr, weight: torch.Tensor | None) -> dict:
    """A loss's keywords of f_divergence_type (`h`, for the losses of DPO's logits) and use_weighting (`pair_weight`,
    WPO's weights; None when off)."""
    out = {} if weight is None else {"pair_weight": weight}
    if cfg.f_divergence_type != "reverse_kl" and name in F_DIVERGENCE_LOSSES:
        out["h"] = f_divergence_logits(pc, pr, rc, rr, cfg.f_divergence_type, cfg.f_alpha_divergence_coef)
    return out


def mixed_loss(cfg: DPOConfig, pc, pr, rc, rr, nll, batch, gpairs: float, bco: BcoDelta | None,
               weight: torch.Tensor | None = None, **extra) -> tuple[torch.Tensor, dict[str, float]]:
    """Σ w_i·loss_i of a list loss_type over one micro-batch; `pc`, `pr`: summed (or sequence_mean) log-probs;
    `weight`: WPO's pair weights or None; `extra`: the keywords every loss takes (label_smoothing, ...). The rewards
    metrics are the first preference loss's (each loss reports the same ones, on its own inputs)."""
    weights = list(cfg.loss_weights) or [1.0] * len(cfg.loss_type)
    means = None
    if any(n in LENGTH_NORMALISED for n in cfg.loss_type):  # the reference's too (zeros without a reference)
        means = (*token_means(pc, pr, batch, cfg.logp_reduction), *token_means(rc, rr, batch, cfg.logp_reduction))
    total, metrics, parts = None, {}, {}
    for name, w in zip(cfg.loss_type, weights):
        c, r, c_ref, r_ref = means if name in LENGTH_NORMALISED else (pc, pr, rc, rr)
        kw = {"bco_delta": bco.update(c, r, c_ref, r_ref, cfg.beta)} if name == "bco_pair" else {}
        fn = sft_loss if name == "sft" else DPO_LOSSES[name]
        value, m = fn(c, r, c_ref, r_ref, cfg.beta, gpairs, nll=nll, **kw, **extra,
                      **trl_keywords(cfg, name, c, r, c_ref, r_ref, weight))
        total = w * value if total is None else total + w * value
        parts[f"loss/{name}"] = float(value.detach()) * gpairs / batch.n_pairs
        if not metrics and name != "sft":
            metrics = {k: v for k, v in m.items() if k != "dpo/loss"}
        metrics.update({k: v for k, v in m.items() if k == "bco/delta"})
    return total, {**metrics, **parts}
