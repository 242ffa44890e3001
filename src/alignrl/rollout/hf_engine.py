"""Embedded rollout engine: batched sampling with a KV cache on a Hugging Face causal LM.

It skips `model.generate`'s generic machinery (logits-processor lists, stopping-criteria objects,
per-step validation): each prompt is prefilled once for its `n` samples, and samples that drew the same tokens so
far are one decoder row until their draws differ (their caches and next-token logits are the same), so a step
pays for the distinct sequences still running, not for every sample; Llama-family models decode on a static KV
cache (`rollout.decoder`), sampling is one inverse-CDF draw per sample. Log-probs are those of the sampled
token under the temperature-scaled distribution before top-k/top-p filtering: the quantity the trainer
recomputes, so the two can be compared token by token. Deliberately out of scope: beam search, speculative
decoding, paging.
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache

from alignrl.data.collate import left_pad, position_ids
from alignrl.data.images import prompt_images
from alignrl.data.records import Rollout
from alignrl.interfaces import SamplingParams
from alignrl.models.kv_cache import cache_arg
from alignrl.models.vision import vision_inputs, vision_token_ids
from alignrl.rollout.decoder import KVDecoder


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """(N, V) log-probabilities with everything outside top-k / the top-p nucleus / below min_p times the likeliest
    token's probability set to -inf."""
    if min_p > 0.0:  # p < min_p x p_max is logp < logp_max + log(min_p)
        logits = logits.masked_fill(logits < logits.amax(-1, keepdim=True) + math.log(min_p), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _inverse_cdf(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One draw per row of (N, V) `probs`: the first token whose cumulative probability exceeds a uniform
    draw. The same distribution as `torch.multinomial`, about 20x cheaper on a CPU at (256, 512): a cumsum
    and a binary search instead of its general sampler. `right=True` never lands on a zero-probability
    token (its cumulative value equals its predecessor's); scaling by the row total absorbs rounding."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=gen, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


# Temperatures below this are greedy (as vLLM takes them): logits / T overflows fp32 near 1e-37, and long before
# that one token holds all the probability.
GREEDY_BELOW = 1e-5


def sample_next(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None,
                banned: torch.Tensor | None = None, seen: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) -> sampled token (N,), its log-prob (N,) under the temperature-scaled distribution. `banned`
    tokens (a vision model's image placeholders) are never drawn; the log-prob stays the model's own, which the
    trainer recomputes (their mass is a trained model's rounding error). `seen` (N, V) bool: the tokens already in
    each row's prompt and response, which `p.repetition_penalty` makes less likely to be drawn; the log-prob is the
    model's own there too, as vLLM's raw log-probs are (as it is under top-k, top-p and min-p)."""
    logits = logits.float()
    pick = logits if seen is None else repetition_penalized(logits, seen, p.repetition_penalty)
    pick = pick if banned is None else pick.index_fill(-1, banned, float("-inf"))
    if p.temperature < GREEDY_BELOW:
        logp = torch.log_softmax(logits, -1)
        tok = pick.argmax(-1)
    else:
        logp = torch.log_softmax(logits / p.temperature, -1)
        draw = logp if pick is logits else torch.log_softmax(pick / p.temperature, -1)
        probs = (_filter_logits(draw, p.top_k, p.top_p, p.min_p).softmax(-1)
                 if (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) else draw.exp())
        tok = _inverse_cdf(probs, gen)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The logits of the `seen` tokens divided by `penalty` where positive and multiplied by it where negative
    (HF's and vLLM's repetition penalty, before the temperature): > 1 makes a repeat less likely."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def seen_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, vocab: int, dev: torch.device) -> torch.Tensor:
    """(B, V) bool: the tokens of each row's prompt (padding left out)."""
    seen = torch.zeros((prompt_ids.shape[0], vocab), dtype=torch.bool, device=dev)
    mask = prompt_mask.to(dev).bool()
    rows = torch.arange(prompt_ids.shape[0], device=dev)[:, None].expand_as(mask)
    seen[rows[mask], prompt_ids.to(dev)[mask]] = True  # the padding writes nothing (a scatter of it raced a real 0)
    return seen


def default_eos(model, tokenizer) -> list[int]:
    """The tokens that end a response: the tokenizer's EOS and the model's generation config's (Qwen2.5's
    instruct models also end at <|endoftext|>, Llama 3's at <|eot_id|>), as HF's generate and vLLM stop."""
    model = getattr(model, "module", model)  # DDP's wrapper
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *([gen] if isinstance(gen, int) else gen or [])} - {None}
    if not ids:
        raise ValueError("the model has no EOS token (neither its tokenizer nor its generation_config names one)")
    return sorted(ids)


class HFRolloutEngine:
    """RolloutEngine over an in-process HF model (shared with the trainer when colocated)."""

    def __init__(self, model, tokenizer, eos_token_ids: Sequence[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        eos = eos_token_ids if eos_token_ids is not None else default_eos(model, tokenizer)
        self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos[0])
        banned = vision_token_ids(model)  # a response holding an image placeholder breaks the next forward
        self.banned = torch.tensor(banned, dtype=torch.long) if banned else None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place (used when the engine holds its own copy of the policy). Names are
        those of `model.state_dict()`; tied aliases (lm_head of tied embeddings) resolve to one tensor."""
        targets = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise KeyError(f"weight {name!r} is not in the rollout model")
                targets[name].copy_(tensor)

    def _hit_stop(self, rows: torch.Tensor, out_ids: torch.Tensor, t: int, stop: tuple[str, ...]) -> torch.Tensor:
        """Which of `rows` now end with one of the stop strings (checked on the decoded tail)."""
        hit = torch.zeros(len(rows), dtype=torch.bool)
        tail = max(len(s.encode()) for s in stop) + 2  # a byte-level token is at least one byte, plus merge slack
        for j, r in enumerate(rows.tolist()):
            text = self.tokenizer.decode(out_ids[r, max(0, t + 1 - tail): t + 1])
            hit[j] = any(s in text for s in stop)
        return hit

    def _stepper(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, dev: torch.device):
        """The fast decoder for Llama-family models, `model(...)` with a DynamicCache for anything else, holding one
        row per distinct prompt: each prompt is prefilled once for its `n` samples (the prefill is the largest
        forward of a rollout, and its `n` copies would be identical)."""
        ids, mask = left_pad([list(p) for p in prompts], self.pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        images = prompt_images(prompts)
        if images is None and KVDecoder.supports(self.model):
            return KVDecoder(self.model, ids, mask, max_new_tokens)
        return _HFStepper(self.model, ids, mask, images=images)

    @torch.no_grad()  # not inference_mode: the records feed autograd later (as indices, masks)
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        """Sample `params.n` responses per prompt; rows of one prompt are contiguous (`group`)."""
        if params.max_new_tokens < 1 or not prompts or not all(len(p) for p in prompts):
            # an empty prompt was sampled from the pad token; zero new tokens gave records of mismatched widths
            what = ("max_new_tokens must be at least 1" if params.max_new_tokens < 1 else "no prompts to generate for"
                    if not prompts else f"prompt {next(i for i, p in enumerate(prompts) if not len(p))} is empty")
            raise ValueError(f"generate: {what}")
        expanded = [list(p) for p in prompts for _ in range(params.n)]
        group = torch.arange(len(prompts)).repeat_interleave(params.n)
        prompt_ids, prompt_mask = left_pad(expanded, self.pad_id)
        b, steps = prompt_ids.shape[0], params.max_new_tokens
        out_ids = torch.full((b, steps), self.pad_id, dtype=torch.long)
        out_lp = torch.zeros((b, steps))
        length = torch.zeros(b, dtype=torch.long)  # generated tokens so far per row
        done = torch.zeros(b, dtype=torch.bool)

        was_training = self.model.training
        self.model.eval()
        dev = next(self.model.parameters()).device  # records stay on the CPU; the forward runs on `dev`
        gen = torch.Generator(device=dev).manual_seed(params.seed) if params.seed is not None else None
        stepper = self._stepper(prompts, steps, dev)
        logits = stepper.logits  # one row per decoder state: at first, one per prompt
        alive = torch.arange(b)  # the rows still generating
        state = group.clone()  # each alive row's decoder state
        banned = None if self.banned is None else self.banned.to(dev)
        seen = (seen_tokens(prompt_ids, prompt_mask, logits.shape[-1], dev) if params.repetition_penalty != 1.0
                else None)
        for t in range(steps):
            rows_seen = None if seen is None else seen.index_select(0, alive.to(dev))
            tok, lp = sample_next(logits.index_select(0, state.to(dev)), params, gen, banned, rows_seen)
            if seen is not None:
                seen[alive.to(dev), tok] = True
            tok, lp = tok.cpu(), lp.cpu()
            out_ids[alive, t], out_lp[alive, t] = tok, lp
            length[alive] += 1
            finished = torch.isin(tok, self.eos)
            if params.stop:
                finished |= self._hit_stop(alive, out_ids, t, params.stop)
            done[alive[finished]] = True
            if t == steps - 1 or bool(finished.all()):
                break
            going = ~finished
            alive = alive[going]
            state, step_tokens = _next_states(stepper, logits.shape, state[going], tok[going], dev)
            logits = stepper.step(step_tokens.to(dev))
        self.model.train(was_training)

        width = max(1, int(length.max()))
        response_mask = torch.arange(width)[None, :] < length[:, None]
        images = prompt_images([p for p in prompts for _ in range(params.n)])  # each row's prompt's images
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out_ids[:, :width].clone(),
                       response_mask=response_mask, logprobs=out_lp[:, :width] * response_mask,
                       truncated=~done, group=group, images=images)


def _next_states(stepper, shape: torch.Size, state: torch.Tensor, tok: torch.Tensor,
                 dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The going rows' decoder states after this step's tokens, and the token each decoder row takes next.

    Rows (samples of one prompt) in one state drew the same tokens so far, so they share a KV cache and the same
    next-token logits: the decoder computes those once. A state whose rows drew different tokens splits; a state
    all of whose rows finished is dead. A split, or dead states once they are an eighth of the decoder's `shape[0]`
    rows, reorganises the rows (`stepper.keep`, a copy of the cache, dead states dropped); otherwise every row keeps
    its state and a dead one decodes a token nobody reads (every reorganisation copies the whole cache, so a few dead
    rows cost less to decode than to drop one at a time). `state`, `tok` (L,): the going rows' states and tokens."""
    rows, vocab = shape
    key, inverse = torch.unique(state * vocab + tok, return_inverse=True)  # sorted: by parent state, then token
    parent, token = key // vocab, key % vocab
    if bool((parent[1:] == parent[:-1]).any()) or (rows - len(key)) * 8 >= rows:
        stepper.keep(parent.to(dev))
        return inverse, token
    step_tokens = torch.zeros(rows, dtype=torch.long)
    step_tokens[parent] = token
    return state, step_tokens


class _HFStepper:
    """Decoding through `model(...)` with a DynamicCache: any HF causal LM, and vision-language models (the prompts'
    `images`, `data.images.ImageRows`): their prefill takes the images and M-RoPE positions (`models.vision`), and
    each generated token's position is its row's text position plus the row's M-RoPE delta, as in the one-pass
    forward the trainer recomputes."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images=None):
        self.model, self.cache = model, DynamicCache()
        self.cache_kw = cache_arg(model, self.cache)  # the same cache object every step: name it once
        vision = vision_inputs(model, prompt_ids, prompt_mask, images)
        positions = vision.pop("position_ids", None)
        delta = torch.zeros(prompt_ids.shape[0], dtype=torch.long, device=prompt_ids.device)
        if positions is not None:  # the next text position is one past the row's largest M-RoPE position
            delta = positions.amax(dim=(0, 2)) + 1 - prompt_mask.long().sum(-1)
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask.long(),
                    position_ids=position_ids(prompt_mask) if positions is None else positions,
                    **vision, **self.cache_kw, use_cache=True, logits_to_keep=1)
        self.logits = out.logits[:, -1]
        self.attn = prompt_mask.long()
        self.next_pos = self.attn.sum(-1) + delta  # position of the next token

    def keep(self, idx: torch.Tensor) -> None:
        """Rows `idx` of the current ones (an index may repeat: a row that splits in two)."""
        self.cache.batch_select_indices(idx)
        self.attn, self.next_pos = self.attn[idx], self.next_pos[idx]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], 1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
                         **self.cache_kw, use_cache=True)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]
