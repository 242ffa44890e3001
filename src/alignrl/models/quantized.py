"""4-bit base weights for LoRA training (QLoRA, Dettmers et al. 2023): the frozen base model is loaded with
bitsandbytes' 4-bit quantization (NF4 codes, double quantization by default, matmuls in the run's dtype) and only the
LoRA adapters on top of it train, as OpenRLHF's `--load_in_4bit` and TRL's `load_in_4bit` with PEFT do.

`model.load_in_4bit` (RL runs) and `load_in_4bit` (the offline trainers: `preference.common.load_policy`) read
through here. A 4-bit linear layer's `weight` is packed bytes (two 4-bit codes a byte) with its scales in a
quantization state beside it: code that reads weights directly (the rollout decoder's fused matmuls) asks
`is_quantized` first and goes through the module's own forward instead; what would need the merged weights (a merged
export, weight pushes to other processes) is refused by `config.quantized_checks` (`preference.qlora_checks` for the
offline trainers).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from alignrl.errors import ConfigError

INSTALL = "pip install 'alignrl[qlora]'"

# bitsandbytes' CPU backend logs at import that the optional `kernels` package is missing, then computes with its
# own kernels; a start that prints a failure nobody can act on reads as a broken install
_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"


def quiet_bitsandbytes() -> None:
    """Silences bitsandbytes' import-time notice about optional CPU kernels (before anything imports it: peft does)."""
    logging.getLogger(_KERNEL_LOGGER).setLevel(logging.ERROR)


def keep_bitsandbytes_out() -> None:
    """Before peft is imported in a process that has not asked for 4-bit weights: peft imports bitsandbytes whenever it
    is installed (peft.helpers, and its dispatch of every LoRA layer), and that import loads torch's compiler stack
    (some 1,400 modules, a second of CPU) into every process that trains adapters, Ray actors and ranks included,
    for nothing. A None entry in sys.modules makes `import bitsandbytes` fail and find_spec report it missing, which
    peft takes as not installed; `require_bitsandbytes` lifts it when 4-bit weights are asked for."""
    quiet_bitsandbytes()
    if "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None


def _let_bitsandbytes_in() -> None:
    """Lifts `keep_bitsandbytes_out`, and makes an already imported peft (and transformers) look for bitsandbytes
    again: both cache whether it is installed."""
    if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
        del sys.modules["bitsandbytes"]
        probes = [(sys.modules.get("peft.import_utils"), ("is_bnb_available", "is_bnb_4bit_available")),
                  (sys.modules.get("transformers.utils.import_utils"), ("is_bitsandbytes_available",))]
        for module, names in probes:
            for name in names:
                cached = getattr(module, name, None)
                if hasattr(cached, "cache_clear"):
                    cached.cache_clear()


def require_bitsandbytes(key: str = "model.load_in_4bit"):
    """The bitsandbytes module, or one ConfigError saying how to install it (`key`: the setting that asked)."""
    quiet_bitsandbytes()
    _let_bitsandbytes_in()
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"{key}: 4-bit loading needs the bitsandbytes package, which is not installed; "
                          f"`{INSTALL}` (or load the model unquantized: {key}=false)") from None
    return bitsandbytes


@dataclass(frozen=True)
class FourBit:
    """How a 4-bit base is quantized: bitsandbytes' codes (nf4: NormalFloat, QLoRA's; fp4), whether each block's
    scale is quantized again (double quantization, about 0.4 bits a weight saved), and the dtype the packed codes are
    stored in (a storage view: the codes, and so every result, are the same in each)."""

    quant_type: str = "nf4"
    double_quant: bool = True
    storage: str = "uint8"

    @classmethod
    def of(cls, cfg) -> FourBit:
        """The settings of a config with transformers' names for them (RunConfig.model, an offline trainer's)."""
        return cls(cfg.bnb_4bit_quant_type, cfg.bnb_4bit_use_double_quant, cfg.bnb_4bit_quant_storage)


def bnb_config(compute_dtype: torch.dtype, four_bit: FourBit, keep: tuple[str, ...] = ()):
    """transformers' BitsAndBytesConfig of `four_bit`, dequantized to `compute_dtype` for each matmul, the modules
    named `keep` left unquantized (besides the output head transformers keeps). OpenRLHF's settings are the default
    (nf4, double quantization); TRL's leave double quantization off."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=four_bit.quant_type,
                              bnb_4bit_use_double_quant=four_bit.double_quant, bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_quant_storage=getattr(torch, four_bit.storage),
                              llm_int8_skip_modules=list(keep) or None)


def load_4bit(folder: Path, compute_dtype: torch.dtype, four_bit: FourBit, device: torch.device | str | None = None,
              model_class=None, keep: tuple[str, ...] = (), **load_kwargs):
    """The model of `folder` (a causal LM, or `model_class`'s: a critic's token classifier) with its linear layers
    quantized to 4 bits as they load, on `device` (default: the first CUDA device, else the CPU): bitsandbytes
    quantizes a layer where it is placed, so each rank loads onto its own device. The output head, the embeddings and
    the modules named `keep` (a critic's value head, new or a reward model's, which trains whole) stay in
    `compute_dtype`."""
    from transformers import AutoModelForCausalLM

    config = bnb_config(compute_dtype, four_bit, keep)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (model_class or AutoModelForCausalLM).from_pretrained(
        str(folder), quantization_config=config, dtype=compute_dtype, device_map={"": torch.device(device)},
        **load_kwargs)
    for module in model.modules():
        # bitsandbytes' CPU inference path (eval mode, no grad) repacks a layer's codes in place into a layout of
        # its own fused kernel, which the training forwards then meet, and which needs in_features a multiple of
        # the quantization block: rollouts and training must compute the same function on the same weights
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return model


def prepare_for_adapters(model):
    """peft's preparation of a 4-bit model for adapter training: every base weight frozen, the norms and the output
    head cast up to float32 (half-precision norms lose the small updates adapters make). Activation recomputation is
    left to the caller, as for every alignrl model (`loader.recompute_activations`: non-reentrant, packed attention
    kept), not peft's reentrant default."""
    from peft import prepare_model_for_kbit_training

    quiet_bitsandbytes()
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether `module` holds 4-bit (or 8-bit) bitsandbytes weights: its parameters are packed bytes, not a matrix."""
    return any(type(p).__name__ in ("Params4bit", "Int8Params") for p in module.parameters(recurse=False))


def weights_in(p: torch.Tensor) -> int:
    """The weights a parameter holds: a 4-bit one packs two codes in each byte of its storage dtype (as PEFT counts)."""
    return p.numel() * 2 * p.element_size() if type(p).__name__ == "Params4bit" else p.numel()


def load_quant_state_as_saved(model: torch.nn.Module) -> None:
    """Lets `model.load_state_dict` take back a state dict `model.state_dict()` gave (an offline run's checkpoint
    weights): bitsandbytes writes each 4-bit layer's quantization state (scales, code book, shape) beside its packed
    weight, and reads none of it back, so torch would call those entries unexpected. Each layer takes its entries
    out where they equal its own (the same base quantized the same way: the packed weight itself loads as any
    parameter does); entries that differ stay, named as unexpected, as a checkpoint of another base should be."""
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.register_load_state_dict_pre_hook(_take_own_quant_state)


def _take_own_quant_state(module, state_dict, prefix, *_) -> None:
    state = getattr(module.weight, "quant_state", None)
    if state is None:
        return
    for name, own in state.as_dict(packed=True).items():
        key = f"{prefix}weight.{name}"
        saved = state_dict.get(key)
        if isinstance(own, torch.Tensor) and isinstance(saved, torch.Tensor) and torch.equal(
                saved.to(own.device), own):
            del state_dict[key]
