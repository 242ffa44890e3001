"""Per-token log-probs and entropy of a response under a causal LM.

Only the response positions go through the LM head (`logits_to_keep`), and log-softmax is taken
in chunks of rows so a long batch never holds two full-vocabulary float copies at once.

With `share_prompt`, rows that carry the same prompt (GRPO's rollout.n samples of one prompt) run that
prompt through the model once: its keys and values are handed to each of its responses as a cache, and
gradients flow back through them. Attention sees exactly the same keys as in the one-pass forward, so
log-probs and gradients agree with it up to float rounding; the prompt's compute is divided by the
number of samples that share it. A policy with dropout on in training mode (Qwen2 and Llama configs have it
off) would also share one dropout mask among a prompt's samples instead of drawing one per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignrl.core.entropy import entropy_from_logits
from alignrl.data.collate import position_ids, prompt_groups
from alignrl.models.folder import ModelError
from alignrl.models.kv_cache import cache_arg, returned_cache
from alignrl.models.packing import pack, packed_forward, unpack
from alignrl.models.vision import encoder_in_every_forward, is_vision_model, ranks_share_model, vision_inputs


@dataclass(frozen=True)
class ForwardLayout:
    """How a micro-batch goes through the model: `share_prompt` runs each distinct prompt once (above);
    `remove_padding` packs its real tokens into one row (`models.packing`); `lanes` > 1 lets up to that many
    micro-batches run side by side on a CPU (`runtime.lanes`). All three change only float rounding."""

    share_prompt: bool = False
    remove_padding: bool = False
    lanes: int = 1


def chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """logits (N, V), targets (N,) -> log-prob of each target (N,), `chunk_rows` rows upcast at a time."""
    parts = []
    for start in range(0, logits.shape[0], chunk_rows):
        logp = torch.log_softmax(logits[start:start + chunk_rows].float(), dim=-1)
        parts.append(logp.gather(-1, targets[start:start + chunk_rows, None]).squeeze(-1))
    return torch.cat(parts)


def model_device(model) -> torch.device:
    """Where the model's (local shard of the) weights live: inputs go there."""
    return next(model.parameters()).device


def _response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, images=None) -> torch.Tensor:
    """(B, R, V): position P-1+t of the prompt+response forward predicts response token t. `images`: the rows'
    prompt images (`data.images.ImageRows`), for a vision-language model (`models.vision`)."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    r = response_ids.shape[1]
    vision = vision_inputs(model, ids, mask, images)  # {} without images
    vision.setdefault("position_ids", position_ids(mask))
    out = model(input_ids=ids, attention_mask=mask.long(), **vision, use_cache=False, logits_to_keep=r + 1)
    return out.logits[:, :-1]


def _shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, first: torch.Tensor,
                          inverse: torch.Tensor) -> torch.Tensor:
    """The same (B, R, V) as `_response_logits`, with each distinct prompt (rows `first`; row i carries prompt
    `inverse[i]`) run once and its keys/values indexed out to its rows as their cache.

    Always exactly two model calls, whatever the rows hold: under FSDP2 / ZeRO-3 every call gathers the
    weights collectively (and DDP broadcasts buffers), so every rank must make the same calls. That is why
    the whole response is fed (its last position's logits are dropped) and distinct prompts take this path
    too."""
    pm = prompt_mask[first].long()
    head = model(input_ids=prompt_ids[first], attention_mask=pm, position_ids=position_ids(pm), use_cache=True,
                 logits_to_keep=1)
    first_token = head.logits[inverse, -1:]  # (B, 1, V): the prompt's last position predicts response token 0
    cache = returned_cache(head)
    if not hasattr(cache, "batch_select_indices"):
        raise ModelError(f"actor.share_prompt needs a model that returns its keys/values as a transformers Cache "
                         f"(this one returned {type(cache).__name__}): set actor.share_prompt=false")
    cache.batch_select_indices(inverse)  # differentiable indexing: gradients of all rows sum into the prompt
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    tail = model(input_ids=response_ids, attention_mask=mask, position_ids=position_ids(mask)[:, pm.shape[1]:],
                 **cache_arg(model, cache), use_cache=False)
    return torch.cat([first_token, tail.logits[:, :-1]], 1)


def shares_prompts(model, layout: ForwardLayout, with_images: bool) -> bool:
    """Whether a micro-batch takes the shared-prompt forward: with share_prompt, for text alone. Its two model calls
    against the plain forward's one would pair ranks' collectives wrongly (FSDP2's and ZeRO-3's gathers, DDP's buffer
    broadcasts) where one rank's micro-batch holds an image and another's does not, so a vision-language model shared
    by several ranks takes the plain forward throughout, on every rank alike."""
    return layout.share_prompt and not with_images and not (ranks_share_model() and is_vision_model(model))


def chunked_logprobs_and_sum_pi_squared(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 4096
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V), targets (N,) -> (log-prob of each target, sum over the vocabulary of the squared probabilities)
    (N,) each, from one float copy of `chunk_rows` rows at a time: sum pi^2 = exp(logsumexp(2 log pi))."""
    lps, sums = [], []
    for start in range(0, logits.shape[0], chunk_rows):
        logp = torch.log_softmax(logits[start:start + chunk_rows].float(), dim=-1)
        lps.append(logp.gather(-1, targets[start:start + chunk_rows, None]).squeeze(-1))
        sums.append(torch.logsumexp(2.0 * logp, dim=-1).exp())
    return torch.cat(lps), torch.cat(sums)


def _scaled_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature, layout, images):
    """(logits (N, V) divided by `temperature`, their targets (N,), a function putting (N,) values back as (B, R),
    zero on padding): the one forward every response log-prob computation shares (see `response_logprobs`)."""
    dev = model_device(model)
    prompt_ids, prompt_mask, response_ids, response_mask = (t.to(dev) for t in (prompt_ids, prompt_mask, response_ids,
                                                                                response_mask))
    with_images = images is not None and images.any()
    # packing and prompt sharing are speed-ups for text: rows with images take the plain forward, one model call as a
    # packed one (verl's vision-language scripts set use_remove_padding=True), so a micro-batch holding a tool's or a
    # prompt's image costs its speed-up and nothing else
    groups = prompt_groups(prompt_ids, prompt_mask) if shares_prompts(model, layout, with_images) else None
    with encoder_in_every_forward(model, images):  # the forwards below, whichever layout
        if layout.remove_padding and not with_images:  # (T, V) logits of the attended tokens only, put back by unpack
            packing = pack(prompt_ids, prompt_mask, response_ids, response_mask, groups)
            logits = packed_forward(model, packing, logits_to_keep=packing.keep).logits[0]
            targets, place = packing.targets, lambda x: unpack(x, packing)
        else:  # (B, R, V) logits, padding included, masked after
            logits = (_shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, *groups)
                      if groups is not None else
                      _response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, images))
            b, r, v = logits.shape
            logits, targets = logits.reshape(b * r, v), response_ids.reshape(-1)
            place = lambda x: x.view(b, r) * response_mask  # noqa: E731
    if temperature != 1.0:
        logits = logits / temperature
    return logits, targets, place


def response_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                      response_mask: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, entropy_grad: bool = False, layout: ForwardLayout = ForwardLayout(),
                      images=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, R) of `response_ids` given left-padded prompts; entropy (B, R) if asked.

    Logits are divided by `temperature` so the values match what the sampler drew from. The entropy
    carries a gradient only with `entropy_grad` (an entropy bonus); as a metric it costs no graph.
    `layout` says how the rows go through the model (see `ForwardLayout`). `images`: the rows' prompt images
    (`data.images.ImageRows`, B rows), which only the plain layout takes (packing is skipped for them)."""
    logits, targets, place = _scaled_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature,
                                            layout, images)
    lp = place(chunked_logprobs(logits, targets))
    if not with_entropy:
        return lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return lp, place(entropy_from_logits(logits))


def response_logprobs_and_sum_pi_squared(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                                         response_ids: torch.Tensor, response_mask: torch.Tensor,
                                         temperature: float = 1.0, layout: ForwardLayout = ForwardLayout(),
                                         images=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, R) of `response_ids`, as `response_logprobs`, and each response token's sum over the vocabulary
    of its squared probabilities (B, R) under the same temperature-scaled logits (verl's
    actor.calculate_sum_pi_squared, read by its optimal token baselines); 0 on padding."""
    logits, targets, place = _scaled_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature,
                                            layout, images)
    lp, sum_pi_squared = chunked_logprobs_and_sum_pi_squared(logits, targets)
    return place(lp), place(sum_pi_squared)
