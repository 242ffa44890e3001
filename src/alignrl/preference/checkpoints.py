"""What a checkpoint of an offline run (`alignrl train sft|rm|dpo|kto`) holds, and resuming from one (`resume_from`);
where, when and in which layout they are written: `checkpoint_plan`.

A checkpoint is a folder (`<output_dir>.checkpoints/step_<N>/` in alignrl's layout): the engine's full weights
(`weights.safetensors`; under LoRA only the tensors that train, the frozen base being the model folder's), its
optimizer and scheduler state (the engines' own `optim.pt`), and `state.json` with the step and, for Safe-MM-DPO,
the multiplier λ with its cost average; with `sync_ref_model`, once the reference has moved, its weights
(`reference.safetensors`) and the step of its latest sync; with bco_pair, its running reward mean δ. It is written
into a hidden temporary folder and renamed into place, so a folder of the layout's name is complete. A resumed run
loads all of it, skips the micro-batches the first N steps consumed (the data order is the seeded one of the first
run), and goes on; with the same config it ends where the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.models.adapter_base import base_problem, base_record

WEIGHTS, STATE, REFERENCE = "weights.safetensors", "state.json", "reference.safetensors"


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir.parent / f"{out_dir.name}.checkpoints"


def save_checkpoint(root: Path, step: int, engine, lam, env, reference=None, running=None, also=None,
                    name: str | None = None, setting: dict | None = None) -> Path:
    """Collective (the engine gathers its weights and optimizer state on every rank; rank 0 writes). `reference`: the
    run's `ref_sync.ReferenceSync` (its copy is the same on every rank), or None; `running`: bco_pair's
    `dpo_mix.BcoDelta` (the same on every rank), or None. `also(folder, weights)`: what rank 0 writes into the
    folder besides, before it is renamed into place (the model as an HF folder); `name`: the folder's (step_<N>);
    `setting`: what a resume must give the same (`resume`'s check), e.g. the loss a PRM trains."""
    from safetensors.torch import save_file

    from alignrl.runtime.env import barrier

    name = name or f"step_{step}"
    final, tmp = root / name, root / f".{name}.tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    weights = engine.full_state_dict()
    engine.save_state(tmp)
    if env.is_main:
        kept = trained_only(engine.model, weights)
        # tied tensors (input and output embeddings) are written as two copies: safetensors keeps no aliases
        save_file({k: v.detach().contiguous().clone() for k, v in (kept or weights).items()}, str(tmp / WEIGHTS))
        state = {"step": step, "weights": "trained" if kept else "all",
                 **({"base": base_record(engine.model)} if kept else {}),
                 **({"lambda_state": lam.state.state_dict()} if lam is not None else {}),
                 **({"bco_pair": running.state_dict()} if running is not None else {}),
                 **({"setting": setting} if setting is not None else {})}
        ref_weights = reference.weights() if reference is not None else None
        if ref_weights is not None:
            save_file(ref_weights, str(tmp / REFERENCE))
            state["reference"] = reference.record()  # the step it moved at and the mix that moved it
        (tmp / STATE).write_text(json.dumps(state, indent=2) + "\n")
        if also is not None:
            also(tmp, weights)
        old = root / f".{name}.old"  # a folder of this name is never half-deleted: renamed away whole first
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def resume(folder: str, engine, lam, command: str = "dpo", reference=None, running=None,
           setting: dict | None = None, unrecorded: dict | None = None) -> int:
    """Loads a checkpoint's weights, optimizer state, λ, synced reference (into `reference`, the run's
    `ref_sync.ReferenceSync`) and bco_pair's running mean (into `running`) into this run (of `alignrl train
    <command>`); returns its step."""
    from safetensors.torch import load_file

    path = Path(folder)
    if not (path / WEIGHTS).is_file() or not (path / STATE).is_file():
        raise ConfigError(f"resume_from={folder} is not a checkpoint of `alignrl train {command}` (no {WEIGHTS} and "
                          f"{STATE}); give a checkpoint folder (step_<N>, checkpoint-<N> or global_step_<N>)")
    state = json.loads((path / STATE).read_text())
    # a checkpoint from before its command recorded settings: what the command trained then (`unrecorded`), the
    # rest unknown, taken as this run's
    saved = state.get("setting", {**(setting or {}), **(unrecorded or {})})
    if setting is not None and saved != setting:  # the same weights would go on under another objective otherwise
        differ = [k for k in setting if saved.get(k) != setting[k]]
        raise ConfigError(f"resume_from={folder} was trained with " + ", ".join(f"{k}={saved.get(k)}" for k in differ)
                          + " and this line gives " + ", ".join(f"{k}={setting[k]}" for k in differ)
                          + "; resume with the settings that wrote it")
    if running is not None and "bco_pair" not in state:  # δ would start again from 0: not the run that was saved
        raise ConfigError(f"resume_from={folder} holds no running reward mean of bco_pair: it was written with a "
                          "loss_type without bco_pair; resume with that loss_type")
    if state.get("weights") == "trained" and "base" in state:  # the adapters alone: over the base that trained them
        problem = base_problem(state["base"], base_record(engine.model), f"resume_from={folder}")
        if problem:
            raise ConfigError(problem)
    weights = load_file(str(path / WEIGHTS))
    try:
        missing, unexpected = _load_weights(engine.model, weights)
    except RuntimeError as e:  # a tensor of another shape (another lora_rank, another model of the same names)
        first = next((x.strip() for x in str(e).splitlines() if "size mismatch" in x), str(e).splitlines()[0])
        raise ConfigError(f"resume_from={folder} does not fit this model ({first.rstrip('.')}); resume with the "
                          "model and LoRA settings that wrote it") from None
    if state.get("weights") == "trained":  # the frozen base came from the model folder, as when the run started
        from alignrl.models.lora import trainable_names

        training = set(trainable_names(engine.model))
        missing = [k for k in missing if k in training]
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ConfigError(f"resume_from={folder} was saved from another model or LoRA setting ({name} does not "
                          f"match){_adapter_fix(weights, engine.model.state_dict())}")
    if not engine.load_state(path):  # its weights alone would go on with a fresh optimizer and schedule
        raise ConfigError(f"resume_from={folder} holds no optimizer state this engine can read (written by another "
                          "strategy, or incomplete); resume with the strategy that wrote it")
    if lam is not None and "lambda_state" in state:
        lam.state.load_state_dict(state["lambda_state"])
    _resume_reference(path, state, reference)
    if running is not None:
        running.load_state_dict(state["bco_pair"])
    return int(state["step"])


def trained_only(model, weights: dict) -> dict | None:
    """The tensors of `weights` that train (LoRA's adapters, a new head), for a model with adapters: its frozen base
    is the model folder's, loaded again when a run resumes (for a 7B base, some 14 GB a checkpoint not written
    again, 4 GB at 4 bits). None for a model that trains every weight."""
    from alignrl.models.lora import has_adapters, trained_state

    return trained_state(model, weights) if has_adapters(model) else None


def _adapter_fix(saved: dict, own: dict) -> str:
    """Where the checkpoint's adapters and this run's sit on different modules (a LoRA default that changed
    between the run that saved and this one, e.g. all-linear against PEFT's per-architecture choice), the modules
    to name: the fix is a flag, not another config file."""
    from alignrl.models.lora import adapted_modules, their_target_flags

    theirs, ours = adapted_modules(saved), adapted_modules(own)
    if not theirs or theirs == ours:
        return "; resume with the config that wrote it"
    if not ours:
        return f": it holds LoRA adapters (on {','.join(theirs)}) and this run has none; resume with use_lora=true"
    return (f": its LoRA adapters are on {','.join(theirs)} and this run's on {','.join(ours) or 'no module'}; "
            f"resume naming them: lora_target_modules={','.join(theirs)} ({their_target_flags(theirs)})")


def _load_weights(model, weights: dict) -> tuple[list[str], list[str]]:
    """(missing, unexpected) names of the full `weights` loaded into `model`. Under FSDP2 its state dict holds sharded
    DTensors, which a plain load_state_dict cannot copy full tensors into: each rank copies in its own shard. Under
    DeepSpeed ZeRO-3 the partitioned weights come back with the engine's own checkpoint (`engine.load_state`)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict()
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3's partitions: the engine's own state has them
        return [k for k in own if k not in weights], [k for k in weights if k not in own]
    if not any(isinstance(t, DTensor) for t in own.values()):
        return model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        for name, mine in own.items():
            if name in weights and isinstance(mine, DTensor):
                full = weights[name].to(device=mine.device, dtype=mine.dtype)
                mine.to_local().copy_(distribute_tensor(full, mine.device_mesh, mine.placements).to_local())
            elif name in weights:
                mine.copy_(weights[name])
    return [k for k in own if k not in weights], [k for k in weights if k not in own]


def _resume_reference(path: Path, state: dict, reference) -> None:
    """The synced reference of a `sync_ref_model` run; a checkpoint and a config that disagree on syncing are one
    line, as the run would otherwise go on against another reference than the one it trained with. Another mix of a
    reference that has moved is said, and kept: the reference goes on from the weights the old one moved."""
    from safetensors.torch import load_file

    held = (path / REFERENCE).is_file()
    if held and reference is None:
        raise ConfigError(f"resume_from={path} holds a reference moved by sync_ref_model; resume with "
                          "sync_ref_model=true (and the same ref_model_mixup_alpha, ref_model_sync_steps)")
    if reference is None:
        return
    if held:
        record = state.get("reference") or {"moved_at": str(state.get("reference_synced_at", 0))}
        reference.load(load_file(str(path / REFERENCE)), record, str(path))
    elif int(state["step"]) >= reference.every:
        raise ConfigError(f"resume_from={path} (step {state['step']}) holds no synced reference, though "
                          f"ref_model_sync_steps={reference.every} would have synced it: it was written with "
                          "sync_ref_model=false or a larger ref_model_sync_steps; resume with that config")
