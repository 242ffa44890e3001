"""What a LoRA checkpoint's trained tensors were trained over, so that a resume cannot put them over another base
without a word: a checkpoint that holds the adapters alone (an offline run's `preference.checkpoints.trained_only`, an
RL run's `lora.save_trained`) records the frozen base's weights (a digest of its folder's files), its 4-bit
quantization and the adapters' rank and scale; a resume compares the run's own record with it before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from alignrl.models.folder import weights_fingerprint

# the quantization settings that change what the frozen base computes (transformers' BitsAndBytesConfig names;
# bnb_4bit_quant_storage is no such setting: it is the dtype the same packed codes are viewed as)
_QUANT_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
_LORA_KEYS = ("r", "lora_alpha", "use_rslora")


def base_record(model) -> dict:
    """The frozen base and the adapters of `model` (a peft model, maybe inside an engine's wrapper): its folder's
    weights digest (`folder.weights_fingerprint`; None for weights that are no safetensors, which are not compared:
    they would have to be read whole), its quantization, and r, alpha and rsLoRA of every adapter config."""
    inner = model
    # lora.unwrapped's loop, not a call: lora imports this module, and the layers test forbids the cycle
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # an engine's wrapper
        inner = inner.module
    config = getattr(inner, "config", None)
    folder = str(getattr(config, "_name_or_path", "") or "")
    digest = weights_fingerprint(Path(folder)) if folder and Path(folder).is_dir() else None
    quant = getattr(config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(quant or {})
    adapters = {name: {k: getattr(c, k, None) for k in _LORA_KEYS}
                for name, c in (getattr(inner, "peft_config", None) or {}).items()}
    return {"weights": digest, "quantization": {k: quant[k] for k in _QUANT_KEYS if k in quant},
            "adapters": adapters}


@dataclass(frozen=True)
class SettingNames:
    """How the settings a mismatch names are spelled: the offline commands' keys, or an RL run's (`RL_NAMES`)."""

    model: str = "model_path"
    quantization: str = "load_in_4bit, bnb_4bit_quant_type and bnb_4bit_use_double_quant"
    adapters: str = "lora_rank and lora_alpha"
    adapters_on: str = "use_lora=true"


RL_NAMES = SettingNames("model.path (or critic.model_path)",
                        "model.load_in_4bit, model.bnb_4bit_quant_type and model.bnb_4bit_use_double_quant",
                        "model.lora_rank and model.lora_alpha", "model.lora_rank > 0")


def base_problem(saved: dict, own: dict, what: str, names: SettingNames = SettingNames()) -> str | None:
    """One line naming what differs between the checkpoint's record (`saved`) and this run's (`own`), or None;
    `what` names the checkpoint (e.g. resume_from=<folder>)."""
    if saved.get("adapters") and not own.get("adapters"):
        return f"{what} holds LoRA adapters and this run trains none: resume with {names.adapters_on}"
    if None not in (saved.get("weights"), own.get("weights")) and saved["weights"] != own["weights"]:
        return (f"{what} holds adapters trained over other base weights than this run's: resume with the "
                f"{names.model} that wrote it")
    if saved.get("quantization") != own.get("quantization"):
        return (f"{what} was trained over a base quantized as {_said(saved.get('quantization'))} and this run's is "
                f"{_said(own.get('quantization'))}: resume with the {names.quantization} that wrote it")
    if saved.get("adapters") != own.get("adapters"):
        return (f"{what} holds adapters of {_said(saved.get('adapters'))} and this run's are "
                f"{_said(own.get('adapters'))}: resume with the {names.adapters} that wrote it")
    return None


def _said(record) -> str:
    """A record as key=value words (one adapter config's, where there is one); `none` for an empty one."""
    if record and len(record) == 1 and isinstance(next(iter(record.values())), dict):
        record = next(iter(record.values()))
    return ", ".join(f"{k}={v}" for k, v in record.items()) if record else "none"
