"""A lean decode step for Llama-family causal LMs (Qwen2, Llama): static KV cache, fused matmuls.

On a CPU with a small model, a decode step of `model(...)` is mostly Python: mask construction, cache
objects, per-module dispatch. `KVDecoder` runs the same arithmetic straight on the model's weights:

- one preallocated K/V buffer per layer, (B, kv_heads, max_len, head_dim), written in place at the step's
  slot (left-padded prompts keep every row at the same slot), attended through a view of the filled part;
- q/k/v and gate/up projections concatenated into one matmul each (built once per `generate`, so they
  always hold the current weights);
- rotary embeddings from the model's own `rotary_emb` (any rope scaling it implements carries over);
- a model with LoRA adapters (peft) decodes on its projections' weights with the active adapters' deltas added
  (`get_delta_weight`, as peft's merge adds them), in new tensors: the model's own parameters are never changed,
  and the steps compute what the merged model would.

The prompt itself goes through the HF model once (prefill), so the first token's logits are exactly those
of `model.generate`. Deliberately out of scope: sliding-window attention, architectures with other block
layouts, LoRA variants other than plain LoRA (DoRA...), 4-bit base weights (QLoRA) (the engine falls back to
`model(...)` for those: see `KVDecoder.supports`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from alignrl.data.collate import position_ids
from alignrl.models.kv_cache import cache_arg
from alignrl.models.lora import base_model
from alignrl.models.packing import PACKED
from alignrl.models.quantized import is_quantized

_FAMILY = ("qwen2", "llama")  # Mistral is left out: its default config slides the attention window


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """RMSNorm as the HF modules compute it (in fp32, cast back, weight applied last)."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _adapters(lin) -> list[str]:
    """The adapters a peft LoRA layer adds to its base weight in its forward (active, not merged in already)."""
    if lin.disable_adapters:
        return []
    return [a for a in lin.active_adapters if a in lin.lora_A and a not in lin.merged_adapters]


def _plain_lora(lin) -> bool:
    """Whether a projection is a plain linear or a peft LoRA layer whose forward is base + B·A·scaling (no DoRA or
    other variant, no merged adapter hidden by disabled adapters), over a weight matrix (not bitsandbytes' packed
    4-bit codes, which only the layer's own forward reads)."""
    if is_quantized(lin.get_base_layer() if hasattr(lin, "get_base_layer") else lin):
        return False
    if not hasattr(lin, "get_delta_weight"):
        return isinstance(lin, torch.nn.Linear)
    if lin.disable_adapters and lin.merged:
        return False
    return not any(a in getattr(lin, "lora_variant", {}) for a in _adapters(lin))


def _weights(lin) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) a projection computes with: a LoRA layer's base weight plus its adapters' deltas (a new
    tensor, as peft's merge would make the base weight; the parameters stay as they are)."""
    if not hasattr(lin, "get_delta_weight"):
        return lin.weight, lin.bias
    base = lin.get_base_layer()
    weight, bias = base.weight, base.bias
    for a in _adapters(lin):
        weight = weight + lin.get_delta_weight(a)
        if lin.lora_bias.get(a):
            bias = bias + lin.lora_B[a].bias * lin.scaling[a]
    return weight, bias


def _fused(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused projection's weight and bias: each one's bias, zeros where one has none; None when none has."""
    parts = [_weights(lin) for lin in linears]
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per row: q (N, H, 1, D) over k, v (N, KV, T, D), bias (N, 1, 1, T) -> (N, KV, H/KV, D).

    The query heads that share a key/value head become that head's query rows, so each key is read once for
    all of them and never copied out per query head: on a CPU a decode step's attention is bound by reading
    the cache, and this ran in half the time of `scaled_dot_product_attention(enable_gqa=True)` at 256 rows."""
    n, heads, _, dim = q.shape
    groups = k.shape[1]
    scores = torch.matmul(q.reshape(n, groups, heads // groups, dim), k.transpose(-1, -2)) * scale + bias
    return torch.matmul(scores.float().softmax(-1).to(v.dtype), v)


class _Layer:
    """One decoder block's weights, q/k/v and gate/up fused, LoRA deltas added."""

    def __init__(self, block):
        att, mlp = block.self_attn, block.mlp
        self.in_norm, self.post_norm = block.input_layernorm, block.post_attention_layernorm
        self.qkv_w, self.qkv_b = _fused([att.q_proj, att.k_proj, att.v_proj])
        self.o_w, self.o_b = _weights(att.o_proj)
        self.gate_up_w, self.gate_up_b = _fused([mlp.gate_proj, mlp.up_proj])  # Llama's mlp_bias=True
        self.down_w, self.down_b = _weights(mlp.down_proj)
        self.act = mlp.act_fn
        self.scaling = att.scaling


class KVDecoder:
    """Prefill with the HF model, then decode one token per row per step on a static KV cache."""

    @staticmethod
    def supports(model) -> bool:
        """A plain HF model of the family, or one with plain LoRA adapters (peft), not a wrapper such as DDP's,
        whose forward must run."""
        model = base_model(model)
        cfg, layers = getattr(model, "config", None), getattr(getattr(model, "model", None), "layers", None)
        return (getattr(cfg, "model_type", None) in _FAMILY and layers is not None
                and not getattr(cfg, "use_sliding_window", False)
                and getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "eager", PACKED)
                and all(getattr(layer.mlp, "gate_proj", None) is not None for layer in layers)
                and all(_plain_lora(lin) for layer in layers for lin in (
                    layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)))

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        """Runs the prompts (B, P) through `model` once and holds `logits` (B, V) for the first token. The steps'
        weights (adapters added) are taken here: a decoder made at the start of a `generate` decodes on the weights
        of that moment."""
        base = base_model(model)
        cfg, dev = base.config, prompt_ids.device
        self.model, self.layers = base, [_Layer(b) for b in base.model.layers]
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        b, p = prompt_ids.shape
        self.slot = p  # the cache column the next token's K/V go into (the same for every row)
        cache = DynamicCache()
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask.long(), position_ids=position_ids(prompt_mask),
                    use_cache=True, logits_to_keep=1, **cache_arg(base, cache))  # the adapters' forward
        self.logits = out.logits[:, -1]
        total = p + max_new_tokens
        self.k, self.v = [], []
        for layer in cache.layers:
            k = layer.keys.new_zeros((b, self.kv_heads, total, self.head_dim))
            v = torch.zeros_like(k)
            k[:, :, :p] = layer.keys
            v[:, :, :p] = layer.values
            self.k.append(k)
            self.v.append(v)
        # added to the attention scores: -inf on the prompts' left padding, 0 on every real or generated key
        self.bias = torch.zeros((b, total), dtype=self.logits.dtype, device=dev)
        self.bias[:, :p].masked_fill_(~prompt_mask.bool(), float("-inf"))
        self.next_pos = prompt_mask.long().sum(-1)  # each row's next position id

    def keep(self, idx: torch.Tensor) -> None:
        """Rows `idx` of the current ones: the others dropped, a repeated index copied (a row that splits in two)."""
        for i in range(len(self.k)):
            self.k[i] = self.k[i].index_select(0, idx)
            self.v[i] = self.v[i].index_select(0, idx)
        self.bias, self.next_pos = self.bias.index_select(0, idx), self.next_pos.index_select(0, idx)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N,) for the current rows -> next-token logits (N, V)."""
        m, s = self.model.model, self.slot
        n = tokens.shape[0]
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, self.next_pos[:, None])  # (N, 1, hd)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads: (N, 1, 1, hd)
        bias = self.bias[:, None, None, :s + 1]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = _rms(h, layer.in_norm)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            qk = qkv[:, :q_size + kv_size].view(n, self.heads + self.kv_heads, 1, self.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin  # queries and keys rotated together: half the small ops
            q = qk[:, :self.heads]
            self.k[i][:, :, s:s + 1] = qk[:, self.heads:]
            self.v[i][:, :, s:s + 1] = qkv[:, q_size + kv_size:].view(n, self.kv_heads, 1, self.head_dim)
            att = _decode_attention(q, self.k[i][:, :, :s + 1], self.v[i][:, :, :s + 1], bias, layer.scaling)
            h = h + F.linear(att.reshape(n, q_size), layer.o_w, layer.o_b)
            gate, up = F.linear(_rms(h, layer.post_norm), layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            h = h + F.linear(layer.act(gate) * up, layer.down_w, layer.down_b)
        self.slot += 1
        self.next_pos = self.next_pos + 1
        return self.model.lm_head(_rms(h, m.norm))
