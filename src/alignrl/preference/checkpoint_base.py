"""What an offline LoRA checkpoint's trained tensors were trained over, so that a resume cannot put them over another
base without a word: a checkpoint that holds the adapters alone (`checkpoints.trained_only`) records the frozen base's
weights (a digest of its folder's files), its 4-bit quantization and the adapters' shape and scale; a resume compares
the run's own record with it before loading anything."""

from __future__ import annotations

from pathlib import Path

# the quantization settings that change what the frozen base computes (transformers' BitsAndBytesConfig names)
_QUANT_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
_LORA_KEYS = ("r", "lora_alpha", "use_rslora")


def base_record(model) -> dict:
    """The frozen base and the adapters of `model` (a peft model, maybe inside an engine's wrapper): its folder's
    weights digest (`folder.weights_fingerprint`; the path itself for weights that are no safetensors), its
    quantization, and r, alpha and rsLoRA of every adapter config."""
    from alignrl.models.folder import weights_fingerprint
    from alignrl.models.lora import unwrapped

    inner = unwrapped(model)
    config = getattr(inner, "config", None)
    folder = str(getattr(config, "_name_or_path", "") or "")
    digest = weights_fingerprint(Path(folder)) if folder and Path(folder).is_dir() else None
    quant = getattr(config, "quantization_config", None)
    quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(quant or {})
    adapters = {name: {k: getattr(c, k, None) for k in _LORA_KEYS}
                for name, c in (getattr(inner, "peft_config", None) or {}).items()}
    return {"weights": digest or folder, "quantization": {k: quant[k] for k in _QUANT_KEYS if k in quant},
            "adapters": adapters}


def base_problem(saved: dict, own: dict, folder: str) -> str | None:
    """One line naming what differs between the checkpoint's record (`saved`) and this run's (`own`), or None."""
    if saved.get("adapters") and not own.get("adapters"):
        return f"resume_from={folder} holds LoRA adapters and this run trains none: resume with use_lora=true"
    if saved.get("weights") != own.get("weights"):
        return (f"resume_from={folder} holds adapters trained over other base weights than model_path's: resume "
                "with the model_path that wrote it")
    if saved.get("quantization") != own.get("quantization"):
        return (f"resume_from={folder} was trained over a base quantized as {_said(saved.get('quantization'))} and "
                f"this run's is {_said(own.get('quantization'))}: resume with the load_in_4bit, bnb_4bit_quant_type "
                "and bnb_4bit_use_double_quant that wrote it")
    if saved.get("adapters") != own.get("adapters"):
        return (f"resume_from={folder} holds adapters of {_said(saved.get('adapters'))} and this run's are "
                f"{_said(own.get('adapters'))}: resume with the lora_rank and lora_alpha that wrote it")
    return None


def _said(record) -> str:
    """A record as key=value words (one adapter config's, where there is one); `none` for an empty one."""
    if record and len(record) == 1 and isinstance(next(iter(record.values())), dict):
        record = next(iter(record.values()))
    return ", ".join(f"{k}={v}" for k, v in record.items()) if record else "none"
