"""TRL DPOTrainer's options that change what a DPO-family loss reads. Pure tensor functions.

* f-divergences (Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse
  Divergence Constraints"): the logits h = (log π_c - log π_ref,c) - (log π_r - log π_ref,r) of the pairwise losses
  become the difference of f'(u) at the two responses, u = π/π_ref each response's probability ratio. reverse_kl is
  DPO's own h; js_divergence subtracts softplus(a_c) - softplus(a_r) (a = log u); alpha_divergence is
  (u_r^-α - u_c^-α)/α, its exponentials capped below float overflow as TRL caps them.
* LD-DPO (Liu et al. 2024, "Length Desensitization in Direct Preference Optimization"): a response's log-prob is
  the sum over its first l_p tokens, l_p the shorter response's length of the pair (the "public" part), plus
  ld_alpha times the sum over the rest (the "verbose" part).
* WPO (Zhou et al. 2024, "Weighted Preference Optimization", eq. 2): each pair's loss is weighted by
  min(1, exp(w_c + w_r)), w a response's token mean of log π(y_t) - log Σ_v π(v)², the policy's probability of the
  response relative to what it would sample itself. The weight carries no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F_DIVERGENCES = ("reverse_kl", "js_divergence", "alpha_divergence")


def exp_cap(dtype: torch.dtype) -> float:
    """The largest exponent whose exp stays finite in `dtype`, floored to 4 decimals (88.7228 for float32)."""
    top = torch.log(torch.tensor(torch.finfo(dtype).max, dtype=dtype)).item()
    return float(torch.floor(torch.tensor(top * 1e4, dtype=torch.float64)) / 1e4)


def capped_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) with x held below `exp_cap`, so that a large ratio gives a large finite value, not inf."""
    return torch.exp(x.clamp(max=exp_cap(x.dtype)))


def f_divergence_logits(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, kind: str,
                        alpha: float = 1.0) -> torch.Tensor:
    """(B,) the logits the pairwise losses scale by β, under the f-divergence `kind` (see the module note); rc, rr
    are zeros for reference_free."""
    a_c, a_r = pc - rc, pr - rr  # log u of the chosen and the rejected response
    if kind == "alpha_divergence":
        return (capped_exp(-alpha * a_r) - capped_exp(-alpha * a_c)) / alpha
    h = (pc - pr) - (rc - rr)
    if kind == "js_divergence":
        return h - (F.softplus(a_c) - F.softplus(a_r))
    if kind != "reverse_kl":
        raise ValueError(f"unknown f-divergence {kind!r}; one of {', '.join(F_DIVERGENCES)}")
    return h


def length_desensitised_logps(token_logps: torch.Tensor, mask: torch.Tensor, n_pairs: int,
                              ld_alpha: float) -> torch.Tensor:
    """(2B,) each response's LD-DPO log-prob from its (2B, T) per-token log-probs and mask (rows [0, B) chosen,
    [B, 2B) rejected): tokens up to the pair's shorter length count fully, later ones times ld_alpha. A token's
    place is its rank among its response's real tokens, so padding anywhere does not shift it."""
    m = mask.to(token_logps.dtype)
    lengths = m.sum(-1)
    public = torch.minimum(lengths[:n_pairs], lengths[n_pairs:]).repeat(2)
    rank = m.cumsum(-1)  # 1 at the first real token
    front = m * (rank <= public[:, None]).to(m.dtype)
    return (token_logps * front).sum(-1) + ld_alpha * (token_logps * (m - front)).sum(-1)


@torch.no_grad()
def wpo_weights(token_logps: torch.Tensor, log_sum_sq: torch.Tensor, mask: torch.Tensor, n_pairs: int
                ) -> torch.Tensor:
    """(B,) WPO's pair weights: `token_logps` (2B, T) the policy's log-prob of each response token, `log_sum_sq`
    (2B, T) log Σ_v π(v)² at the same places (logsumexp of twice the log-softmax), `mask` the real tokens."""
    m = mask.to(token_logps.dtype)
    per_response = ((token_logps - log_sum_sq) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return torch.exp(per_response[:n_pairs] + per_response[n_pairs:]).clamp(max=1.0)
