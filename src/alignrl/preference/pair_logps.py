"""A causal LM's log-probabilities of a preference batch's responses, and its KL to the reference on them.

`logp_reduction` says what one response's log-probability is:
* sum (default): log π(y|x), the sum over the response's tokens, as DPO defines it;
* sequence_mean: the mean log-probability over every token of prompt + response that has one before it (the
  reference Safe-MM-DPO script's reading). It does not depend on length, so β means something else with it.

One forward serves both responses of every pair (rows [0, B) chosen, [B, 2B) rejected); with `keep_logits` the
chosen rows' response logits come back too, for the KL term, without a second forward. `policy_logps` adds TRL's
LD-DPO (ld_alpha) and WPO (use_weighting) on the policy's side (`alignrl.core.dpo_options`); the reference's
log-probs stay plain sums, as TRL's.
"""

from __future__ import annotations

import torch

from alignrl.core.dpo_options import length_desensitised_logps, wpo_weights
from alignrl.data.collate import position_ids


def _token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, T, V), (N, T) -> (N, T) log-prob of each target, one row at a time in float32 (no full-batch copy)."""
    return torch.stack([torch.log_softmax(logits[i].float(), -1).gather(-1, targets[i, :, None]).squeeze(-1)
                        for i in range(logits.shape[0])])


def pair_logps(model, batch, reduction: str = "sum", keep_logits: bool = False):
    """(chosen (B,), rejected (B,), the chosen rows' response logits (B, R, V) or None)."""
    c, r, logits, _, _ = policy_logps(model, batch, reduction, keep_logits)
    return c, r, logits


def policy_logps(model, batch, reduction: str = "sum", keep_logits: bool = False, ld_alpha: float | None = None,
                 weigh: bool = False):
    """`pair_logps` with TRL DPOTrainer's options of the policy: `ld_alpha` (LD-DPO: a response's tokens past its
    pair's shorter length count ld_alpha times) and `weigh` (WPO: the pairs' weights, detached, else None), as
    (chosen, rejected, logits or None, weights or None, chosen's plain log-probs: the NLL term's, which LD-DPO
    leaves whole, as TRL's cross-entropy does). Both read the summed reduction's per-token log-probs."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    r, b = batch.response_ids.shape[1], batch.n_pairs
    whole = reduction == "sequence_mean"
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask), use_cache=False,
                logits_to_keep=0 if whole else r + 1)
    logits = out.logits
    weights = None
    if whole:  # position t predicts token t+1; a token counts when it and the one before it are real
        valid = (mask[:, 1:] & mask[:, :-1]).float()
        lp = (_token_logps(logits[:, :-1], ids[:, 1:]) * valid).sum(-1) / valid.sum(-1).clamp(min=1.0)
    else:
        tok = _token_logps(logits[:, :-1], batch.response_ids)
        lp = plain = (tok * batch.response_mask.float()).sum(-1)
        if ld_alpha is not None:
            lp = length_desensitised_logps(tok, batch.response_mask, b, ld_alpha)
        if weigh:
            weights = wpo_weights(tok.detach(), _log_sum_sq(logits[:, :-1]), batch.response_mask, b)
    chosen_logits = logits[:b, -r - 1:-1] if keep_logits else None
    return lp[:b], lp[b:], chosen_logits, weights, (lp if whole else plain)[:b]


@torch.no_grad()
def _log_sum_sq(logits: torch.Tensor) -> torch.Tensor:
    """(N, T, V) -> (N, T) log Σ_v π(v)² at each place (WPO's normaliser), one row at a time in float32."""
    return torch.stack([torch.logsumexp(2.0 * torch.log_softmax(logits[i].float(), -1), -1)
                        for i in range(logits.shape[0])])


def token_means(chosen: torch.Tensor, rejected: torch.Tensor, batch, reduction: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The responses' token-mean log-probs (SimPO's and ORPO's ā) from `pair_logps`' sums; means stay as they are."""
    if reduction == "sequence_mean":
        return chosen, rejected
    counts = batch.response_mask.sum(-1).clamp(min=1).to(chosen.dtype)
    return chosen / counts[:batch.n_pairs], rejected / counts[batch.n_pairs:]


def chosen_nll(chosen: torch.Tensor, batch, reduction: str) -> torch.Tensor:
    """(B,) each chosen response's negative log-likelihood per token (OpenRLHF's DPO NLL term): `chosen` as
    `pair_logps` gives it, a sum over the response's tokens (divided by their count here) or already a mean."""
    if reduction == "sequence_mean":
        return -chosen
    return -chosen / batch.response_mask[:batch.n_pairs].sum(-1).clamp(min=1).to(chosen.dtype)


def response_kl(policy_logits: torch.Tensor, ref_logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) KL(π‖π_ref) per response: Σ_v π·(log π - log π_ref) at each response token, averaged over its real
    tokens. Exact over the vocabulary (the reference script's estimate), gradient through π only."""
    out = []
    for i in range(policy_logits.shape[0]):
        lp = torch.log_softmax(policy_logits[i].float(), -1)
        lq = torch.log_softmax(ref_logits[i].float().detach(), -1)
        per_token = (lp.exp() * (lp - lq)).sum(-1)
        m = response_mask[i].float()
        out.append((per_token * m).sum() / m.sum().clamp(min=1.0))
    return torch.stack(out)
