"""LoRA in the preference trainers: adapters on the reward/cost model or the DPO policy (`use_lora`), and the folder
that leaves the trainer.

The adapters come from `alignrl.models.lora` (peft). A reward or cost model trains its scoring head in full beside
the adapters (peft's modules_to_save: a new head has nothing to adapt). The optimizer sees only what requires
grad, so it holds state for the adapters (and head) alone; the DPO reference is the policy with its adapters off.

The saved folder is by default a plain HF model with the adapters folded in (W + B·A·alpha/r), what the RL loop,
`load_model` and safety-aware DPO load; `lora_export=adapter` writes peft's adapter folder instead. The fold
(`models.lora.merged_state_dict`) works on the engine's full state dict, so it reads the same under every engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignrl.models.folder import ModelError
from alignrl.models.lora import LoraSpec, add_adapters, lora_spec, merged_state_dict, write_adapter
from alignrl.models.quantized import weights_in


def spec_of(cfg) -> LoraSpec | None:
    """The LoRA spec of a preference config, or None without use_lora."""
    if not cfg.use_lora:
        return None
    return lora_spec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)


def attach(model: torch.nn.Module, spec: LoraSpec, task: str, seed: int):
    """`model` with adapters (task CAUSAL_LM: the policy; SEQ_CLS: a scorer, head trained in full); one line when
    peft is missing or a target matches no module. The new adapter weights are drawn from `seed`: every rank draws
    the same ones whatever its random state, which differs between engines (a sharded engine assembles each weight
    from its ranks' own draws), so a run trains the same on every strategy."""
    _check_targets(model, spec)
    torch.manual_seed(seed)
    return add_adapters(model, spec, key="use_lora", task=task)


def _check_targets(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Every named target matches a module (peft matches a name or a dotted suffix of one); peft itself refuses only
    when none does, so a misspelt name among others would leave its layers unadapted without a word."""
    if isinstance(spec.target_modules, str):
        return
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in spec.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelError(f"LoRA target_modules: {', '.join(missing)} matches no module of this model; its linear "
                         f"layers are named {', '.join(linear[:12])} (or use all-linear)")


def count(model: torch.nn.Module) -> str:
    """'N trainable of M parameters (p%)': what a LoRA run trains."""
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(weights_in(p) for p in model.parameters())
    return f"{train:,} trainable of {total:,} parameters ({100 * train / max(total, 1):.2f}%)"


class AdapterFolder:
    """What `common.save_hf_folder` writes when the export is the adapter alone: peft's own folder
    (adapter_config.json and the adapter's weights, a scorer's head included), from the full state dict the engine
    gathered: the live model's tensors are shards under FSDP2 and ZeRO-3, which peft's own save would write as such."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def save_pretrained(self, folder: Path, state_dict=None) -> None:
        if state_dict is None:
            self.peft_model.save_pretrained(str(folder))
        else:  # a scorer's engine trains the model peft wraps: its names lack the wrapper's prefix
            prefix = "base_model.model."
            if not any(k.startswith(prefix) for k in state_dict):
                state_dict = {prefix + k: v for k, v in state_dict.items()}
            write_adapter(self.peft_model, state_dict, Path(folder))


def saver(model, peft_model, spec: LoraSpec | None, export: str, state: dict[str, torch.Tensor]):
    """(object whose save_pretrained writes the model folder, the state dict it writes) for the config's export."""
    if spec is None:
        return model, state
    if export == "adapter":
        return AdapterFolder(peft_model), state
    return peft_model.get_base_model(), merged_state_dict(peft_model, state)


def exporter(model, peft_model, spec: LoraSpec | None, export: str, prefix: str = ""):
    """`saver` as a function of the engine's full state dict (its names' `prefix` dropped): what writes the model as
    an HF folder, at the end of a run and in the checkpoints that hold one (`checkpoint_plan`)."""
    def folder(state: dict[str, torch.Tensor]):
        return saver(model, peft_model, spec, export, {k.removeprefix(prefix): v for k, v in state.items()})
    return folder
