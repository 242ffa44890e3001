"""Nash-MD (Munos et al. 2024, "Nash Learning from Human Feedback"; TRL's NashMDTrainer) as token advantages of the RL
loop. Pure tensor functions.

Each prompt's pair is the policy's answer y and an answer y' sampled from the geometric mixture of the policy and the
reference (`rl.reference_pairs`). The probability that y is preferred to y' is σ(r(y) - r(y')), from the two rewards,
and TRL's loss per pair is the REINFORCE estimate of the regularized game's gradient on y alone:

    β · Σ_t sg(log π_t - log π_ref,t) · log π_t  -  (p - 1/2) · Σ_t log π_t

(1/2 a control variate; the first term the KL to the reference by REINFORCE), averaged over the pairs. With the
update's -A·log π summed over each answer's tokens and averaged over the 2P answers (seq-mean-token-sum), the
advantage of a token of y is 2 · ((p - 1/2) - β · (log π_t - log π_ref,t)); y' trains nothing (advantage 0): it only
scores y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignrl.core.online_dpo import pair_rows


@dataclass(frozen=True)
class MixtureInputs:
    """One batch of rows, two per prompt in the loop's group order: the policy's answer, then the mixture's."""
    rewards: torch.Tensor  # (B,) each answer's reward
    group: torch.Tensor  # (B,) the prompt index of each row; each index exactly twice
    logprobs: torch.Tensor  # (B, R) each token's log-prob under the policy the batch trains from
    ref_logprobs: torch.Tensor  # (B, R) the same under the reference
    mask: torch.Tensor  # (B, R) the tokens that train


def nash_md_advantages(x: MixtureInputs, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token advantages (B, R) whose -A·log π update, aggregated as seq-mean-token-sum, is the gradient of TRL's
    Nash-MD loss at the log-probs given, and its metrics (TRL's names: `nash_md/score` its loss/score,
    `nash_md/kl` its loss/kl, `nash_md/probability` its rewards/probabilities)."""
    policy, mixture = pair_rows(x.group)
    mask = x.mask.to(x.logprobs.dtype)
    probability = torch.sigmoid(x.rewards[policy] - x.rewards[mixture]).to(x.logprobs.dtype)  # (P,)
    log_ratio = (x.logprobs[policy] - x.ref_logprobs[policy].to(x.logprobs.device)) * mask[policy]  # (P, R)
    adv = torch.zeros_like(x.logprobs)
    adv[policy] = 2.0 * ((probability - 0.5)[:, None] - beta * log_ratio) * mask[policy]
    sums = (x.logprobs[policy] * mask[policy]).sum(-1)
    pairs = len(policy)
    metrics = {"nash_md/probability": float(probability.mean()) if pairs else 0.5,
               "nash_md/score": float(((probability - 0.5) * sums).mean()) if pairs else 0.0,
               "nash_md/kl": float(log_ratio.sum(-1).mean()) if pairs else 0.0,
               "nash_md/scores_margin": float((x.rewards[policy] - x.rewards[mixture]).mean()) if pairs else 0.0}
    return adv, metrics
