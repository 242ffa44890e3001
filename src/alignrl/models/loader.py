"""Load a causal LM + tokenizer from an HF folder (or the embedded demo model). The folder is checked
first (`alignrl.models.folder`): a broken one is one `ModelError`, not transformers' traceback."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import torch

# ModelError is re-exported: callers catch it from here
from alignrl.models import folder as _folder
from alignrl.models.quantized import FourBit
from alignrl.models.folder import SCORE_INFO, ModelError, auto_class, check_model_folder, loading  # noqa: F401
from alignrl.models.vision import is_vision_folder, load_processor, load_vision_model, processor_of
from alignrl.runtime.heap import settled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# the settings that take a causal LM, for which the demo model is a valid choice
CAUSAL_KEYS = ("model.path", "critic.model_path", "model_path", "ref_model_path")


def resolve_model_path(path: str, log: Callable = print, key: str = "model.path") -> Path:
    """The folder of `path` ("demo": the cached demo model, built if needed), checked to hold a config and
    complete weights; ModelError otherwise, naming the setting (`key`) that gave the path."""
    if path == "demo":
        from alignrl.models.tiny import ensure_demo_model

        return ensure_demo_model(log=log)
    p = Path(path)
    if not (p / "config.json").is_file():
        demo = f", or {key}=demo" if key in CAUSAL_KEYS else ""  # demo: a causal LM
        raise ModelError(f"{key}={path!r} is not a Hugging Face model folder (no config.json there); "
                         f"pass a local folder saved with save_pretrained{demo}")
    check_model_folder(p)
    return p


def load_tokenizer(folder: Path, chat: bool = True, min_pixels: int = 0, max_pixels: int = 0):
    """The folder's tokenizer (`models.folder.load_tokenizer`); a vision-language model's is its processor's, which
    carries the processor for prompts with images (`models.vision.load_processor`; `min_pixels`/`max_pixels` as
    data.min_pixels/max_pixels, 0: the processor's own)."""
    if is_vision_folder(folder):
        return load_processor(folder, min_pixels, max_pixels).tokenizer
    return _folder.load_tokenizer(folder, chat)


def run_tokenizer(cfg, folder: Path):
    """An RL run's policy tokenizer: with a chat template where the run renders through one
    (`config.agent_checks.needs_chat_template`: templated prompts, multi-turn rollouts), a processor's pixel bounds
    as data.min_pixels/max_pixels say."""
    from alignrl.config.agent_checks import needs_chat_template

    return load_tokenizer(folder, needs_chat_template(cfg), cfg.data.min_pixels, cfg.data.max_pixels)


def with_template_variables(tokenizer, variables: dict):
    """`tokenizer` (and the processor a vision-language model's carries), whose chat template renders with
    `variables` set (data.chat_template_kwargs, verl's apply_chat_template_kwargs: Qwen3's enable_thinking...) at
    every call that does not set them itself: the run's prompts, held-out prompts, tool turns and prompts with images
    all go through `apply_chat_template`. An instance attribute shadows the method, so nothing saved changes; called
    again (a sampler serving a restarted trainer) it replaces the variables, and none restores the template's own."""
    for renderer in (tokenizer, processor_of(tokenizer)):
        if renderer is None:
            continue
        renderer.__dict__.pop("apply_chat_template", None)
        if variables:
            renderer.apply_chat_template = functools.partial(type(renderer).apply_chat_template, renderer,
                                                             **variables)
    return tokenizer


def load_model(path: str, dtype: str = "float32", log: Callable = print, chat: bool = True, key: str = "model.path",
               min_pixels: int = 0, max_pixels: int = 0):
    """(model, tokenizer) with a pad token set; the tokenizer pads on the left for generation. `chat=False`
    accepts a tokenizer without a chat template (servers of raw completions and token ids). `key`: the setting
    that gave `path`, for the errors. A vision-language folder (`models.vision`) gives its image-text model and its
    processor's tokenizer, which carries the processor (images resized within `min_pixels`..`max_pixels`, 0: the
    processor's own bounds)."""
    folder = resolve_model_path(path, log, key)
    tokenizer = load_tokenizer(folder, chat, min_pixels, max_pixels)
    return load_causal_lm(folder, dtype, key), tokenizer


def load_causal_lm(folder: Path, dtype: str = "float32", key: str = "model.path", four_bit: FourBit | None = None,
                   device: torch.device | str | None = None):
    """The causal LM of a checked folder (`resolve_model_path`), in `dtype`. A reward or cost model that
    `alignrl train rm` saved is refused: transformers would load its backbone with a new, random LM head.
    `four_bit`: its linear layers quantized to 4 bits on `device` as they load (`models.quantized`, QLoRA's base),
    computing in `dtype`."""
    info = Path(folder) / SCORE_INFO
    if info.is_file():
        import json

        try:
            kind = json.loads(info.read_text()).get("model_type", "scoring")
        except (OSError, ValueError, AttributeError):
            kind = "scoring"
        raise ModelError(f"{key}={folder} is a {kind} model saved by `alignrl train rm` ({SCORE_INFO}): it scores "
                         f"text and cannot write it; give {key} a causal LM, such as the model it was trained from")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tiny model load is noise in run logs
    if is_vision_folder(folder):  # images and text in, text out: generates and scores as a causal LM does
        if four_bit is not None:
            raise ModelError(f"{key}={folder} is a vision-language model, which alignrl loads unquantized; set "
                             "model.load_in_4bit=false")
        model = load_vision_model(folder, DTYPES[dtype])
        settled()  # the heavy imports are done: the process's start-up heap is frozen (runtime.heap)
        return model
    if four_bit is not None:  # a missing bitsandbytes is the install's, not the folder's: checked outside `loading`
        from alignrl.models.quantized import load_4bit, require_bitsandbytes

        require_bitsandbytes()
    with loading(folder, "model"):
        if four_bit is not None:
            model = load_4bit(folder, DTYPES[dtype], four_bit, device)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype])
    model.config.use_cache = False  # training default; the rollout engine asks for the cache explicitly
    settled()  # the heavy imports are done: the process's start-up heap is frozen (runtime.heap)
    return model


def meta_model(folder: str | Path, dtype: str | torch.dtype = "float32"):
    """The model `load_causal_lm` loads from `folder`, built on the meta device (no memory, no weights read): the
    names, shapes and dtypes of the parameters a trainer sends an engine that holds no HF copy (vLLM). A
    vision-language folder's is its image-text model, whose names (vision tower included) the trainer's are."""
    from transformers import AutoConfig

    with loading(folder, "model"):
        config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = auto_class(config).from_config(config, dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype)
    settled()  # a sharded model starts here: the process's start-up heap is frozen (runtime.heap)
    return model


def recompute_activations(model) -> None:
    """Gradient (activation) checkpointing of every transformer layer: in training its activations are
    recomputed in the backward instead of kept. Non-reentrant, so layers keep their keyword arguments (the packed
    forward passes its packing that way) and frozen inputs need no grad; the attention stays routed through the
    packed function, which the recomputation must find as the forward did."""
    from alignrl.models.packing import keep_routed

    # transformers >= 5 renamed gradient_checkpointing_enable (still an alias there, with a warning)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    keep_routed(model)


def disable_dropout(model) -> None:
    """p = 0 in every dropout layer, as TRL and OpenRLHF do for trained policies and value models: a model scored
    against a reference in eval mode, or data-parallel ranks drawing other masks than one process, must not
    differ by dropout noise."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def draws_dropout(model) -> bool:
    """Whether a training-mode forward of `model` draws dropout masks (a dropout layer or an attention dropout above
    0): such forwards draw from one random generator, so an engine does not run them side by side (`runtime.lanes`),
    where the order of the draws would follow the threads' timing."""
    cfg = getattr(model, "config", None)
    return (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
            or float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0)


def frozen_copy(model):
    """A frozen reference copy (eval mode, no grads), e.g. the KL anchor of GRPO."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
