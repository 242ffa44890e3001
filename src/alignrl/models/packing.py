"""Padding-free forwards (verl's `use_remove_padding`, OpenRLHF's `--packing_samples`).

A micro-batch's real tokens are laid end to end in one row of N tokens, so the linear layers, the LM head and
the log-softmax see no padding: with responses of mixed lengths, padding is often a third or more of a padded
batch. Each token must still attend only to its own sequence. For the one model call, the model's attention
layers are routed (through transformers' AttentionInterface) to `_packed_attention`, which gathers each
sequence's queries and keys into a small padded batch, runs SDPA under a mask and scatters the outputs back.
The sequences are sorted by length into a few buckets, each padded to its own longest, so that padding stays
small too.

With shared prompts (GRPO's rollout.n samples of one prompt) each distinct prompt is one sequence and each
response is a sequence whose keys start with its prompt's: the prompt is computed once, gets the gradients
of all its responses, and the whole micro-batch is still one model call (the same call on every rank, as
FSDP2 / ZeRO-3 need).

Works for models whose attention dispatches through `ALL_ATTENTION_FUNCTIONS` (Llama, Qwen2/3, Mistral and
most current transformers decoders); a model that does not is a one-line `ModelError`, never a silent
padded-layout result. Soft-capped attention, and sequences longer than a sliding window, are refused the same way.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from alignrl.data.collate import position_ids
from alignrl.models.folder import ModelError

PACKED = "alignrl_packed"
BUCKETS = 4  # attention batches per layer: sequences sorted by length, each batch padded to its longest
FIX = "set actor.use_remove_padding=false (critic.use_remove_padding=false for the value model)"


@dataclass(frozen=True)
class Bucket:
    """S sequences of similar length, padded to Lq queries and Lk keys."""

    q_index: torch.Tensor  # (S, Lq) the packed token in each query slot (padding slots repeat token 0)
    k_index: torch.Tensor  # (S, Lk) the packed token in each key slot: the prefix's, then the sequence's own
    mask: torch.Tensor  # (S, 1, Lq, Lk) bool: query slot may attend key slot


@dataclass
class Packing:
    """The packed row of a micro-batch and where everything goes: S sequences, N tokens, T attended response
    tokens (row-major over the (B, R) response grid)."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N): each token's position in its own (prompt + response) sequence
    buckets: list[Bucket]  # the sequences, by length
    out_index: torch.Tensor  # (N,) each packed token's query slot, counted over the buckets' slots in order
    keep: torch.Tensor  # (T,) the packed token whose logits predict each attended response token
    targets: torch.Tensor  # (T,) those response tokens
    where: torch.Tensor  # (B, R) bool: the attended response positions, in the order of `keep`
    calls: list[int] = field(default_factory=lambda: [0])  # attention layers that took the packed path
    # every bucket's slots in one index, so that a layer gathers queries (and keys, values) with one
    # index_select each, and its backward zero-fills and accumulates one gradient instead of one per bucket
    q_all: torch.Tensor = field(init=False)
    k_all: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.q_all = torch.cat([b.q_index.reshape(-1) for b in self.buckets])
        self.k_all = torch.cat([b.k_index.reshape(-1) for b in self.buckets])


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, attended: torch.Tensor,
         groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> Packing:
    """Left-padded prompts (B, P) and right-padded responses (B, R) with their masks -> one packed row. With
    `groups` = (a row of each distinct prompt, each row's prompt) from `prompt_groups`, each distinct prompt is
    packed once and its responses attend to it; without, each row is prompt + response."""
    plen, rlen = prompt_mask.sum(1), attended.sum(1)
    rank = attended.long().cumsum(1) - 1  # a response token's index among its row's attended tokens
    if groups is None:
        full = torch.cat([prompt_mask, attended], 1)
        ids, pos = torch.cat([prompt_ids, response_ids], 1)[full], position_ids(full)[full]
        lens = plen + rlen
        offs = _starts(lens)
        pre_len = pre_off = torch.zeros_like(lens)
        resp_start, last_prompt = offs + plen, offs + plen - 1
    else:
        first, inverse = groups
        gm = prompt_mask[first]
        gp = plen[first]
        ids = torch.cat([prompt_ids[first][gm], response_ids[attended]])
        pos = torch.cat([position_ids(gm)[gm], (plen[:, None] + rank)[attended]])
        p_offs = _starts(gp)
        resp_start = gp.sum() + _starts(rlen)
        lens, offs = torch.cat([gp, rlen]), torch.cat([p_offs, resp_start])
        zeros = torch.zeros_like(gp)
        pre_len, pre_off = torch.cat([zeros, gp[inverse]]), torch.cat([zeros, p_offs[inverse]])
        last_prompt = p_offs[inverse] + gp[inverse] - 1
    own = resp_start[:, None] + rank  # packed index of each response token
    keep = torch.where(rank == 0, last_prompt[:, None], own - 1)[attended]

    buckets, slot = [], torch.empty_like(lens)  # slot: where each sequence's first query slot lands
    order = torch.argsort(pre_len + lens, stable=True)
    used = 0
    for part in order.tensor_split(min(BUCKETS, len(order))):
        bucket = _bucket(lens[part], offs[part], pre_len[part], pre_off[part])
        slot[part] = used + torch.arange(len(part), device=lens.device) * bucket.q_index.shape[1]
        used += bucket.q_index.numel()
        buckets.append(bucket)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    out_index = slot[seq] + torch.arange(len(seq), device=lens.device) - offs[seq]
    return Packing(ids[None], pos[None], buckets, out_index, keep, response_ids[attended], attended)


def _bucket(lens, offs, pre_len, pre_off) -> Bucket:
    """Sequences of `lens` tokens from packed index `offs`, each after a prefix of `pre_len` from `pre_off`."""
    dev = lens.device
    n_q, n_k = max(1, int(lens.max())), max(1, int((pre_len + lens).max()))
    j, jk = torch.arange(n_q, device=dev), torch.arange(n_k, device=dev)
    q_valid = j < lens[:, None]
    in_pre = jk < pre_len[:, None]
    self_k = jk - pre_len[:, None]  # a key slot's index within the sequence's own tokens
    k_valid = jk < (pre_len + lens)[:, None]
    k_index = torch.where(in_pre, pre_off[:, None] + jk, torch.where(k_valid, offs[:, None] + self_k, 0))
    mask = k_valid[:, None, :] & (in_pre[:, None, :] | (self_k[:, None, :] <= j[None, :, None]))
    # a padding query slot attends key slot 0 (ignored) so SDPA never sees a row with no key
    mask |= ~q_valid[:, :, None] & (jk == 0)
    return Bucket(torch.where(q_valid, offs[:, None] + j, 0), k_index, mask[:, None])


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      packing: Packing | None = None, **kwargs):
    """Attention over a packed row (query (1, H, N, D), key/value (1, Hkv, N, D)) -> (1, N, H, D). Any call
    without a `packing` (generation, a padded forward) is transformers' SDPA attention unchanged."""
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ModelError(f"remove-padding forwards do not support attention with {unsupported}: {FIX}")
    window = kwargs.get("sliding_window")
    if window is not None and max(b.k_index.shape[1] for b in packing.buckets) >= window:
        # shorter sequences see the same keys under a sliding window as under full causal attention
        raise ModelError(f"remove-padding forwards do not support sequences longer than the sliding_window "
                         f"({window}): {FIX}")
    # index_select, not advanced indexing: its backward is index_add_, several times faster on CPU than the
    # accumulating index_put_ that advanced indexing's backward is
    qs = _gather(query, packing.q_all, [b.q_index.shape for b in packing.buckets])
    ks, vs = (_gather(t, packing.k_all, [b.k_index.shape for b in packing.buckets]) for t in (key, value))
    outs = []
    for b, q, k, v in zip(packing.buckets, qs, ks, vs):
        # grouped-query attention: SDPA pairs each key/value head with its query heads, no repeated copies
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=k.shape[1] != q.shape[1])
        outs.append(out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[3]))  # (S * Lq, H, D)
    packing.calls[0] += 1
    return torch.cat(outs).index_select(0, packing.out_index)[None], None


def _gather(x: torch.Tensor, index: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """(1, H, N, D) and the concatenated slots of buckets of (S, L) -> each bucket's (S, H, L, D)."""
    h, d = x.shape[1], x.shape[3]
    parts = x[0].index_select(1, index).split([s * n for s, n in shapes], 1)
    return [part.view(h, s, n, d).transpose(0, 1) for part, (s, n) in zip(parts, shapes)]


AttentionInterface.register(PACKED, _packed_attention)
# a padded forward under the packed name (keep_routed) gets the attention mask SDPA gets; without an entry here
# transformers would build none
AttentionMaskInterface.register(PACKED, sdpa_mask)
# The packed call itself: the same attention under a name with no mask entry, so transformers builds no mask for it
# (its buckets carry their own; from the packed row's position ids transformers would otherwise build an N x N
# packed-sequence mask per call, a few milliseconds of CPU each, never read)
PACKED_CALL = "alignrl_packed_call"
AttentionInterface.register(PACKED_CALL, _packed_attention)


def _config(model):
    while not hasattr(getattr(model, "config", None), "_attn_implementation") and hasattr(model, "module"):
        model = model.module  # DDP / DeepSpeed wrappers (a DeepSpeed engine has a config of its own)
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        raise ModelError(f"remove-padding forwards need a transformers model (got {type(model).__name__}): {FIX}")
    return cfg


_ROUTING = threading.Lock()
_ROUTED: dict[int, list] = {}  # id(config) -> [its own attention implementation, packed calls running on it]


@contextmanager
def _routed(model):
    """The model's attention routed to the packed function for the call. Calls may overlap (micro-batches side
    by side: `runtime.lanes`); the first to start routes, the last to end restores."""
    cfg = _config(model)
    with _ROUTING:
        entry = _ROUTED.setdefault(id(cfg), [cfg._attn_implementation, 0])
        entry[1] += 1
        cfg._attn_implementation = PACKED_CALL
    try:
        yield
    finally:
        with _ROUTING:
            entry[1] -= 1
            if entry[1] == 0:
                cfg._attn_implementation = entry[0]
                del _ROUTED[id(cfg)]


def keep_routed(model) -> None:
    """Routes an SDPA model's attention through the packed function for good (SDPA itself for any call without a
    `packing`): under gradient checkpointing a layer's forward runs again in the backward, after
    packed_forward's routing has ended, and must take the path the forward took."""
    cfg = _config(model)
    if cfg._attn_implementation == "sdpa":
        cfg._attn_implementation = PACKED


def packed_forward(model, packing: Packing, **kwargs):
    """One model call on the packed row (`kwargs` go to the model: `logits_to_keep=packing.keep` for a causal LM)."""
    with _routed(model):
        out = model(input_ids=packing.input_ids, position_ids=packing.position_ids, attention_mask=None,
                    use_cache=False, packing=packing, **kwargs)
    if packing.calls[0] == 0:
        raise ModelError(f"{type(_config(model)).__name__}'s attention does not dispatch through transformers' "
                         f"AttentionInterface, so it cannot run packed: {FIX}")
    return out


def unpack(values: torch.Tensor, packing: Packing) -> torch.Tensor:
    """(T,) values of the attended response tokens -> (B, R), zero elsewhere (differentiable)."""
    return values.new_zeros(packing.where.shape).masked_scatter(packing.where, values)
