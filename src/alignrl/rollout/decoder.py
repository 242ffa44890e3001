"""A lean decode step for Llama-family causal LMs (Qwen2, Llama): static KV cache, fused matmuls.

On a CPU with a small model, a decode step of `model(...)` is mostly Python: mask construction, cache
objects, per-module dispatch. `KVDecoder` runs the same arithmetic straight on the model's weights:

- one preallocated K/V buffer per layer, (B, kv_heads, max_len, head_dim), written in place at the step's
  slot (left-padded prompts keep every row at the same slot), attended through a view of the filled part;
- q/k/v and gate/up projections concatenated into one matmul each (built once per `generate`, so they
  always hold the current weights);
- rotary embeddings from the model's own `rotary_emb` (any rope scaling it implements carries over).

The prompt itself goes through the HF model once (prefill), so the first token's logits are exactly those
of `model.generate`. Deliberately out of scope: sliding-window attention, architectures with other block
layouts (the engine falls back to `model(...)` for those: see `KVDecoder.supports`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from alignrl.data.collate import position_ids
from alignrl.models.kv_cache import cache_arg
from alignrl.models.packing import PACKED

_FAMILY = ("qwen2", "llama")  # Mistral is left out: its default config slides the attention window


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """RMSNorm as the HF modules compute it (in fp32, cast back, weight applied last)."""
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fused_bias(linears: list) -> torch.Tensor | None:
    """The bias of the fused projection: each one's bias, zeros where one has none; None when none has."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears])


class _Layer:
    """One decoder block's weights, q/k/v and gate/up fused."""

    def __init__(self, block):
        att, mlp = block.self_attn, block.mlp
        self.in_norm, self.post_norm = block.input_layernorm, block.post_attention_layernorm
        self.qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        self.qkv_b = _fused_bias([att.q_proj, att.k_proj, att.v_proj])
        self.o_proj = att.o_proj
        self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.gate_up_b = _fused_bias([mlp.gate_proj, mlp.up_proj])  # Llama's mlp_bias=True
        self.down = mlp.down_proj
        self.act = mlp.act_fn
        self.scaling = att.scaling


class KVDecoder:
    """Prefill with the HF model, then decode one token per row per step on a static KV cache."""

    @staticmethod
    def supports(model) -> bool:
        """A plain HF model of the family (not a wrapper such as DDP's, whose forward must run)."""
        cfg, layers = getattr(model, "config", None), getattr(getattr(model, "model", None), "layers", None)
        return (getattr(cfg, "model_type", None) in _FAMILY and layers is not None
                and not getattr(cfg, "use_sliding_window", False)
                and getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "eager", PACKED)
                and all(getattr(layer.mlp, "gate_proj", None) is not None for layer in layers))

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                 repeats: int = 1):
        """Runs the prompts (B, P) through `model` once and holds `logits` (B * repeats, V) for the first
        token, each prompt's row repeated `repeats` times (consecutively)."""
        cfg, dev = model.config, prompt_ids.device
        self.model, self.layers = model, [_Layer(b) for b in model.model.layers]
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = prompt_ids.shape[1]
        b = prompt_ids.shape[0] * repeats
        self.slot = p  # the cache column the next token's K/V go into (the same for every row)
        cache = DynamicCache()
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask.long(), position_ids=position_ids(prompt_mask),
                    use_cache=True, logits_to_keep=1, **cache_arg(model, cache))
        self.logits = out.logits[:, -1].repeat_interleave(repeats, 0)
        total = p + max_new_tokens
        self.k, self.v = [], []
        for layer in cache.layers:
            k = layer.keys.new_zeros((b, self.kv_heads, total, self.head_dim))
            v = torch.zeros_like(k)
            k[:, :, :p] = layer.keys.repeat_interleave(repeats, 0)
            v[:, :, :p] = layer.values.repeat_interleave(repeats, 0)
            self.k.append(k)
            self.v.append(v)
        self.mask = torch.zeros((b, 1, 1, total), dtype=torch.bool, device=dev)
        self.mask[:, 0, 0, :p] = prompt_mask.bool().repeat_interleave(repeats, 0)
        self.next_pos = prompt_mask.long().sum(-1).repeat_interleave(repeats, 0)  # each row's next position id

    def keep(self, idx: torch.Tensor) -> None:
        """Drop every row not in `idx` (indices into the current rows)."""
        for i in range(len(self.k)):
            self.k[i] = self.k[i].index_select(0, idx)
            self.v[i] = self.v[i].index_select(0, idx)
        self.mask, self.next_pos = self.mask.index_select(0, idx), self.next_pos.index_select(0, idx)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (N,) for the current rows -> next-token logits (N, V)."""
        m, s = self.model.model, self.slot
        n = tokens.shape[0]
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, self.next_pos[:, None])  # (N, 1, hd)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads: (N, 1, 1, hd)
        self.mask[:, 0, 0, s] = True
        mask = self.mask[..., :s + 1]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            x = _rms(h, layer.in_norm)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            q = qkv[:, :q_size].view(n, self.heads, 1, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(n, self.kv_heads, 1, self.head_dim)
            v = qkv[:, q_size + kv_size:].view(n, self.kv_heads, 1, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            self.k[i][:, :, s:s + 1] = k * cos + _rotate_half(k) * sin
            self.v[i][:, :, s:s + 1] = v
            att = F.scaled_dot_product_attention(q, self.k[i][:, :, :s + 1], self.v[i][:, :, :s + 1], attn_mask=mask,
                                                 scale=layer.scaling, enable_gqa=self.heads != self.kv_heads)
            h = h + layer.o_proj(att.reshape(n, q_size))
            gate, up = F.linear(_rms(h, layer.post_norm), layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            h = h + layer.down(layer.act(gate) * up)
        self.slot += 1
        self.next_pos = self.next_pos + 1
        return self.model.lm_head(_rms(h, m.norm))
