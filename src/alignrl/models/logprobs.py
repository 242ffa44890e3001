"""Per-token log-probs and entropy of a response under a causal LM.

Only the response positions go through the LM head (`logits_to_keep`), and log-softmax is taken
in chunks of rows so a long batch never holds two full-vocabulary float copies at once.
"""

from __future__ import annotations

import torch

from alignrl.core.entropy import entropy_from_logits
from alignrl.data.collate import position_ids


def _chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """logits (N, V), targets (N,) -> log-prob of each target (N,), `chunk_rows` rows upcast at a time."""
    parts = []
    for start in range(0, logits.shape[0], chunk_rows):
        logp = torch.log_softmax(logits[start:start + chunk_rows].float(), dim=-1)
        parts.append(logp.gather(-1, targets[start:start + chunk_rows, None]).squeeze(-1))
    return torch.cat(parts)


def model_device(model) -> torch.device:
    """Where the model's (local shard of the) weights live: inputs go there."""
    return next(model.parameters()).device


def response_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                      response_mask: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of `response_ids` given left-padded prompts; entropy (B, R) if asked.

    Logits are divided by `temperature` so the values match what the sampler drew from. The entropy
    carries a gradient only with `entropy_grad` (an entropy bonus); as a metric it costs no graph.
    """
    dev = model_device(model)
    prompt_ids, prompt_mask, response_ids, response_mask = (t.to(dev) for t in (prompt_ids, prompt_mask, response_ids,
                                                                                response_mask))
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    r = response_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask),
                use_cache=False, logits_to_keep=r + 1)
    logits = out.logits[:, :-1]  # (B, R, V): position P-1+t predicts response token t
    if temperature != 1.0:
        logits = logits / temperature
    b, _, v = logits.shape
    lp = _chunked_logprobs(logits.reshape(b * r, v), response_ids.reshape(-1)).view(b, r) * response_mask
    if not with_entropy:
        return lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = entropy_from_logits(logits)
    return lp, ent * response_mask
