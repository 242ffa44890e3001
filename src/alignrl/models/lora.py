"""LoRA adapters (peft) on a model being trained: adding them, the frozen base behind them, and the weights that
leave the trainer (merged into a plain model's tensors for rollout engines and exports, or the adapter alone).

With adapters, only their small matrices train: the optimizer holds state for them alone, and the reference of a KL
term is the same model with its adapters switched off (`adapters_off`), so no second copy of the base is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from alignrl.models.folder import ModelError

# peft wraps a model as base_model.model.<name> and a wrapped linear's own weight as <name>.base_layer.weight
_WRAP_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def lora_spec(rank: int, alpha: int = 16, dropout: float = 0.0, target_modules=("all-linear")) -> LoraSpec:
    """A spec from the spellings users bring: target modules as a list, a comma-separated string, or all-linear."""
    if isinstance(target_modules, str):
        names = [n.strip() for n in target_modules.split(",") if n.strip()]
        targets = "all-linear" if names in ([], ["all-linear"]) else tuple(names)
    else:
        targets = tuple(str(n) for n in target_modules) or "all-linear"
        targets = "all-linear" if targets == ("all-linear",) else targets
    return LoraSpec(int(rank), int(alpha), float(dropout), targets)


def _peft(key: str):
    try:
        import peft
    except ImportError:
        raise ModelError(f"{key}: LoRA needs the peft package, which is not installed; `pip install peft` "
                         f"(or train all weights: {key}=0)") from None
    return peft


def add_adapters(model: torch.nn.Module, spec: LoraSpec, key: str = "model.lora_rank", task: str | None = "CAUSAL_LM"):
    """`model` with LoRA adapters on `spec.target_modules`; only the adapters require grad afterwards. A target
    that matches no module is one ModelError naming it and some module names the model has."""
    peft = _peft(key)
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             task_type=task)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        if "not found" not in str(e) and "Target modules" not in str(e):
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelError(f"LoRA target_modules={targets} matches no module of this model; its linear layers are "
                         f"named {', '.join(linear[:12])} (or use all-linear)") from None


def has_adapters(model: torch.nn.Module) -> bool:
    return any("lora_" in n for n, _ in model.named_parameters())


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP/FSDP/DeepSpeed wrapper holds (`.module`), or `model` itself."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside, `model` computes as its base without adapters (the reference); a model without adapters is
    unchanged."""
    inner = unwrapped(model)
    if not hasattr(inner, "disable_adapter"):
        yield
        return
    with inner.disable_adapter():
        yield


def plain_name(name: str) -> str:
    """A wrapped parameter's name as the plain model calls it."""
    return name.removeprefix(_WRAP_PREFIX).replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's tensors with every adapter folded in (W + B·A·alpha/r), the model left as it is: what a
    rollout engine loads and a merged export holds. A model without adapters gives its own state dict."""
    inner = unwrapped(model)
    if not has_adapters(inner):
        return dict(inner.state_dict())
    out = {plain_name(n): t for n, t in inner.state_dict().items() if "lora_" not in n}
    for name, module in inner.named_modules():
        delta = getattr(module, "get_delta_weight", None)
        if delta is None or not hasattr(module, "base_layer"):
            continue
        for adapter in getattr(module, "active_adapters", []):
            if adapter in getattr(module, "lora_A", {}):
                key = plain_name(name) + ".weight"
                out[key] = out[key] + delta(adapter).to(out[key].dtype)
    return out


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in unwrapped(model).named_parameters() if p.requires_grad]


def export(model: torch.nn.Module, folder: Path, how: str = "merged") -> None:
    """Writes `model` to `folder`: merged (a plain HF folder, adapters folded in) or adapter (PEFT's adapter folder:
    adapter_config.json and its weights)."""
    inner = unwrapped(model)
    if how == "adapter" and has_adapters(inner):
        inner.save_pretrained(str(folder))
        return
    base = inner.get_base_model() if has_adapters(inner) else inner
    base.save_pretrained(str(folder), state_dict=merged_state_dict(inner))
