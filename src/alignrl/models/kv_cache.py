"""The KV cache's name at a model call. transformers 5.2x renamed the forward argument and the output field
`past_key_values` to `cache` (the old name still works there, with a deprecation warning on every run, until
its removal); the older releases we support know only `past_key_values`. Calls go through these two helpers
so that each release gets its own spelling."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch

from alignrl.models.lora import base_model, unwrapped

__all__ = ["cache_arg", "returned_cache"]


@functools.cache
def _name(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model: torch.nn.Module, cache) -> dict:
    """{name: cache} for `model(...)`; DDP, DeepSpeed and peft (LoRA) wrappers, whose forwards take any keyword and
    hand it on, are looked through to the model's own forward."""
    return {_name(type(base_model(unwrapped(model)))): cache}


def returned_cache(out):
    """The cache a model call returned (None when it returned none)."""
    if isinstance(out, Mapping):
        return out.get("cache", None) or out.get("past_key_values", None)
    return getattr(out, "past_key_values", None)
