"""Load a causal LM + tokenizer from an HF folder (or the embedded demo model)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """The model path cannot be loaded; the message says what to pass instead."""


def resolve_model_path(path: str, log=print) -> Path:
    if path == "demo":
        from alignrl.models.tiny import ensure_demo_model

        return ensure_demo_model(log=log)
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelError(f"model.path={path!r} is not a Hugging Face model folder (no config.json there); "
                         "pass a local folder saved with save_pretrained, or model.path=demo")
    return p


def load_model(path: str, dtype: str = "float32", log=print):
    """(model, tokenizer) with a pad token set; the tokenizer pads on the left for generation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tiny model load is noise in run logs
    folder = resolve_model_path(path, log)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype])
    model.config.use_cache = False  # training default; the rollout engine asks for the cache explicitly
    return model, tokenizer


def frozen_copy(model):
    """A frozen reference copy (eval mode, no grads), e.g. the KL anchor of GRPO."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
