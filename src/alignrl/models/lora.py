"""LoRA adapters (peft) on a model being trained: adding them, the frozen base behind them, and the weights that
leave the trainer (merged into a plain model's tensors for rollout engines and exports, or the adapter alone).

With adapters, only their small matrices train: the optimizer holds state for them alone, and the reference of a KL
term is the same model with its adapters switched off (`adapters_off`), so no second copy of the base is kept.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from alignrl.models.adapter_base import RL_NAMES, base_problem, base_record
from alignrl.models.folder import ModelError

# peft wraps a model as base_model.model.<name> and a wrapped linear's own weight as <name>.base_layer.weight
_WRAP_PREFIX = "base_model.model."
PEFT_DEFAULT = "peft-default"  # model.target_modules: PEFT's own targets for the architecture
# a module peft trains in full (modules_to_save: a scorer's new head) is a trained copy beside the frozen original;
# the plain model's module is the trained copy
_TRAINED_COPY, _FROZEN_ORIGINAL = ".modules_to_save.default.", ".original_module."


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
    """A spec from the spellings users bring: target modules as a list, a comma-separated string, all-linear, or
    peft-default (PEFT's own choice for the model's architecture, what TRL's --use_peft takes without
    --lora_target_modules)."""
    if isinstance(target_modules, str):
        names = [n.strip() for n in target_modules.split(",") if n.strip()]
        targets = names[0] if names in ([PEFT_DEFAULT], ["all-linear"]) else "all-linear" if not names \
            else tuple(names)
    else:
        targets = tuple(str(n) for n in target_modules) or "all-linear"
        targets = targets[0] if targets in (("all-linear",), (PEFT_DEFAULT,)) else targets
    return LoraSpec(int(rank), int(alpha), float(dropout), targets)


def _peft(key: str):
    from alignrl.models.quantized import keep_bitsandbytes_out

    keep_bitsandbytes_out()  # peft imports bitsandbytes when it is installed, 4-bit or not
    try:
        import peft
    except ImportError:
        raise ModelError(f"{key}: LoRA needs the peft package, which is not installed; `pip install peft` "
                         f"(or train all weights: {key}=0)") from None
    return peft


def add_adapters(model: torch.nn.Module, spec: LoraSpec, key: str = "model.lora_rank", task: str | None = "CAUSAL_LM",
                 exclude: tuple[str, ...] = ()):
    """`model` with LoRA adapters on `spec.target_modules` (none on the modules named in `exclude`, e.g. a value
    model's new head, which trains whole); only the adapters require grad afterwards. A target that matches no
    module is one ModelError naming it and some module names the model has."""
    peft = _peft(key)
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    if targets == PEFT_DEFAULT:
        targets = _peft_default_targets(model)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             task_type=task, exclude_modules=list(exclude) or None)
    try:
        with warnings.catch_warnings():  # peft asks transformers for the old name of activation checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:
        if not any(s in str(e) for s in ("not found", "Target modules", "No modules were targeted")):
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelError(f"LoRA target_modules={targets} matches no module of this model; its linear layers are "
                         f"named {', '.join(linear[:12])} (or use all-linear)") from None


def _peft_default_targets(model: torch.nn.Module) -> list[str]:
    """PEFT's LoRA targets for the model's architecture (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, what
    LoraConfig(target_modules=None) picks); a model type it has none for is one ModelError."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as MAPPING

    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in MAPPING:
        raise ModelError(f"LoRA target_modules={PEFT_DEFAULT}: PEFT has no default targets for model type {kind!r}; "
                         "name them (model.target_modules=[q_proj,v_proj], TRL's --lora_target_modules) or use "
                         "all-linear")
    return list(MAPPING[kind])


def has_adapters(model: torch.nn.Module) -> bool:
    return any("lora_" in n for n, _ in model.named_parameters())


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP/FSDP/DeepSpeed wrapper holds (`.module`), or `model` itself."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def base_model(model):
    """The HF model under a peft wrapper (`get_base_model`), or `model` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


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
def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The plain model's tensors with every adapter folded in (W + B·A·alpha/r), the model left as it is: what a
    rollout engine loads and a merged export holds. `state`: the model's state dict as an engine gathered it, keyed
    as `model.state_dict()` or, for peft's wrapper, as the model it wraps (an engine that trained that one); default:
    the model's own. A model without adapters gives the state as it is."""
    inner = unwrapped(model)
    state = inner.state_dict() if state is None else state
    if not has_adapters(inner):
        return dict(state)
    if hasattr(inner, "get_base_model") and not any(k.startswith(_WRAP_PREFIX) for k in state):
        inner = inner.get_base_model()  # the same LoRA layers, named without the wrapper's prefix
    return merge_state(state, _lora_layers(inner))


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in unwrapped(model).named_parameters() if p.requires_grad]


def export(model: torch.nn.Module, folder: Path, how: str = "merged") -> None:
    """Writes `model` to `folder`: merged (a plain HF folder, adapters folded in) or adapter (PEFT's adapter folder:
    adapter_config.json and its weights)."""
    save_model_folder(model, unwrapped(model).state_dict(), folder, how)


# ---------------------------------------------------------------- what trains, what leaves the trainer


def _matches(name: str, prefix: str) -> bool:
    # transformers 5 keeps a vision-language model's image tower under model. (model.visual.*): OpenRLHF's and
    # LMM-R1's `--freeze_prefix visual` was written for the older top-level name, and still means it
    return name.startswith(prefix) or name.startswith("model." + prefix)


def freeze_prefixes(model: torch.nn.Module, prefixes, key: str = "actor.freeze_prefix") -> int:
    """Parameters whose (plain) names start with one of `prefixes` stop requiring grad; returns how many. A prefix
    that matches no parameter is one ModelError naming it and some prefixes the model has."""
    prefixes = [str(p) for p in ([prefixes] if isinstance(prefixes, str) else prefixes or [])]
    named = [(plain_name(n), p) for n, p in unwrapped(model).named_parameters()]
    for prefix in prefixes:
        if not any(_matches(n, prefix) for n, _ in named):
            real = sorted({".".join(n.split(".")[:k]) for n, _ in named for k in (1, 2, 3)
                           if len(n.split(".")) > k})
            raise ModelError(f"{key}: {prefix!r} matches no parameter of the model; its names start with e.g. "
                             f"{', '.join(real[:10])}")
    frozen = 0
    for name, p in named:
        if any(_matches(name, prefix) for prefix in prefixes) and p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def _lora_layers(model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
    """Wrapped module name (as in the state dict) -> (scaling, fan_in_fan_out) of each LoRA layer's active
    adapter."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in unwrapped(model).named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    out[f"{name}.lora_A.{adapter}"] = (float(module.scaling[adapter]),
                                                       bool(getattr(module, "fan_in_fan_out", False)))
    return out


def merge_state(state: dict[str, torch.Tensor], layers: dict[str, tuple[float, bool]],
                names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A wrapped model's state dict (`state`, as `model.state_dict()` or an engine's gathered full one) as the
    plain model's tensors, every adapter folded in (W + scaling·B·A, computed in fp32 and cast to W's dtype), a
    module trained in full (peft's modules_to_save, a scorer's head) in its own place and peft's frozen original
    of it dropped: what rollout engines load and a merged export holds. `layers`: `_lora_layers` of the model.
    `names`: only these plain names (the rest is not copied or computed)."""
    keep = None if names is None else set(names)
    out = {}
    for k, v in state.items():
        if "lora_" in k or _FROZEN_ORIGINAL in k:
            continue
        plain = plain_name(k).replace(_TRAINED_COPY, ".")
        if keep is None or plain in keep:
            out[plain] = v
    for a_key, (scaling, transposed) in layers.items():
        module, adapter = a_key.rsplit(".lora_A.", 1)
        target = plain_name(module) + ".weight"
        if target not in out:
            continue
        a, b = state[f"{a_key}.weight"].float(), state[f"{module}.lora_B.{adapter}.weight"].float()
        delta = (b @ a) * scaling
        w = out[target]
        out[target] = w + (delta.T if transposed else delta).to(w.dtype)
    return out


def plain_names(model: torch.nn.Module) -> list[str]:
    """The plain model's parameter names (each tensor once, tied ones by their first name), in order."""
    return [plain_name(n) for n, _ in unwrapped(model).named_parameters() if "lora_" not in n]


def changing_names(model: torch.nn.Module) -> list[str]:
    """The plain names of the parameters a training step can change: those that require grad, and, with
    adapters, the layers they are merged into. The rest (a frozen prefix, the base under LoRA) stays as loaded,
    so a rollout engine that holds it needs it once, not after every step."""
    inner = unwrapped(model)
    merged = {plain_name(k.rsplit(".lora_A.", 1)[0]) + ".weight" for k in _lora_layers(inner)} \
        if has_adapters(inner) else set()
    return [plain_name(n) for n, p in inner.named_parameters()
            if "lora_" not in n and (p.requires_grad or plain_name(n) in merged)]


def outgoing(model: torch.nn.Module, state: dict[str, torch.Tensor], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """(plain name, tensor) for `names`, in their order, out of `model`'s `state` (its own state dict or an
    engine's full one): merged tensors where the model has adapters, the state's own otherwise."""
    if has_adapters(model):
        plain = merge_state(state, _lora_layers(model), names)
    else:
        plain = state
    return [(n, plain[n]) for n in names]


# ---------------------------------------------------------------- resumable state, exports


TRAINED_FILE = "trained.safetensors"  # every parameter that trains, by its wrapped name: exact resume
ADAPTER_DIR = "adapter"
BASE_FILE = "adapter_base.json"  # the base and adapter settings the trained tensors go with (`adapter_base`)


def trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of `state` (keyed as `model.state_dict()`) that train: adapters, an unfrozen head."""
    names = set(trainable_names(model))
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k in names}


def save_trained(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """`folder/trained.safetensors` (what trains, for resume) and, with adapters, `folder/adapter/` (PEFT's
    adapter folder)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(trained_state(model, state), str(folder / TRAINED_FILE))
    if has_adapters(model):
        write_adapter(model, state, folder / ADAPTER_DIR)
        (folder / BASE_FILE).write_text(json.dumps(base_record(model), indent=1) + "\n")


def adapted_modules(names) -> list[str]:
    """The module names LoRA adapters sit on, from parameter or state-dict names (`...q_proj.lora_A...` -> q_proj):
    what a resume names when a LoRA default changed between the run that saved and this one."""
    return sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in names if ".lora_A" in n})


def their_target_flags(modules: list[str]) -> str:
    """TRL's and OpenRLHF's flags that put adapters on `modules`, for a line that must name them."""
    return f"TRL's --lora_target_modules {' '.join(modules)}, OpenRLHF's --target_modules {' '.join(modules)}"


def load_trained(model: torch.nn.Module, folder: Path) -> bool:
    """What `save_trained` wrote, into `model` (the same wrapping, before an engine takes it); False when the
    folder has no such file. Every trained parameter must be in the file: a checkpoint of another LoRA setting
    is one ModelError."""
    from safetensors.torch import load_file

    path = folder / TRAINED_FILE
    if not path.is_file():
        return False
    record = folder / BASE_FILE  # what the adapters trained over (checkpoints before it was written: not checked)
    problem = base_problem(json.loads(record.read_text()), base_record(model), f"checkpoint {folder}",
                           RL_NAMES) if record.is_file() else None
    if problem:
        raise ModelError(problem)
    saved = load_file(str(path))
    want = set(trainable_names(model))
    if set(saved) != want:
        missing = sorted(want - set(saved)) or sorted(set(saved) - want)
        theirs, ours = adapted_modules(saved), adapted_modules(want)
        fix = ("the model.lora_* and actor.freeze_prefix settings that wrote it" if theirs == ours else
               f"its adapters' modules: model.target_modules=[{','.join(theirs)}] ({their_target_flags(theirs)}); "
               f"this run puts them on {','.join(ours) or 'no module'}")
        raise ModelError(f"{path} holds other trained parameters than this run trains (e.g. {missing[0]!r}): resume "
                         f"with {fix}")
    inner = unwrapped(model)
    with torch.no_grad():
        params = dict(inner.named_parameters())
        for k, v in saved.items():
            params[k].copy_(v)
    return True


def write_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) from `state` (the model's own or
    a gathered full state dict): loads with `PeftModel.from_pretrained(base, folder)`."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    inner = unwrapped(model)
    folder.mkdir(parents=True, exist_ok=True)
    weights = get_peft_model_state_dict(inner, state_dict={k: v.detach().cpu() for k, v in state.items()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "adapter_model.safetensors"))
    inner.peft_config["default"].save_pretrained(str(folder))


def save_model_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path, how: str = "merged") -> None:
    """`folder` from `state` (keyed as `model.state_dict()`): a plain HF folder with the adapters merged in, or
    (how=adapter) PEFT's adapter folder. A model without adapters is written as it is."""
    inner = unwrapped(model)
    if not has_adapters(inner):
        inner.save_pretrained(str(folder), state_dict=state)
    elif how == "adapter":
        write_adapter(inner, state, folder)
    else:
        inner.get_base_model().save_pretrained(str(folder), state_dict=merge_state(state, _lora_layers(inner)))


def set_export(model: torch.nn.Module, how: str) -> None:
    """How the checkpoints' model folder holds this model with adapters (model.lora_export): merged or adapter."""
    unwrapped(model).alignrl_export = how


def export_of(model: torch.nn.Module) -> str:
    return getattr(unwrapped(model), "alignrl_export", "merged")


class AdaptersOffScorer:
    """A RefScorer that runs `scorer` (built on the trained model itself) with the adapters switched off: the
    reference of the KL term is the base, and no second copy of it is held. The trainer's forwards never overlap
    with it (one thread), so switching the adapters off for the call changes nothing else."""

    def __init__(self, scorer, model: torch.nn.Module):
        self.scorer, self.model = scorer, model

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask, images=None) -> torch.Tensor:
        with adapters_off(self.model):
            if images is None:  # a scorer of text prompts may take no images at all
                return self.scorer.logprobs(prompt_ids, prompt_mask, response_ids, response_mask)
            return self.scorer.logprobs(prompt_ids, prompt_mask, response_ids, response_mask, images=images)
