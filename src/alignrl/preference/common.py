"""What reward-model and DPO training share at run time (their flat config and command line are
`alignrl.preference.cli`'s): process group and engine, DistributedSampler sharding, evaluation
sharding, the optimizer loop, rank-0 logging and atomic HF-folder saves. The two trainers differ only in
their model, their per-micro-batch loss and their held-out metrics.

`train_pairs` can start at a later step of the same seeded order (a DPO run resumed from one of its checkpoints,
`preference.checkpoints`); reward-model runs are minutes and restart from the base model. Left out: packing.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from alignrl.preference.configs import CommonConfig
from alignrl.config import ConfigError
from alignrl.data.loaders import DataError
from alignrl.data.preference import PreferenceBatch, collate_pairs
from alignrl.runtime.env import cuda_bf16
from alignrl.models.loader import disable_dropout, recompute_activations, with_template_variables
from alignrl.preference.run_log import RankZeroLog, StepMetrics
from alignrl.train.checkpoint import CheckpointError, aside_path, nonfinite, write_manifest
from alignrl.train.engines.base import TrainingDiverged


def string_rows_templated(cfg, tokenizer) -> bool:
    """Whether string prompt-completion rows go through the chat template (`apply_chat_template`; rows of chat
    messages always do): said in one line when the tokenizer has none."""
    if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"apply_chat_template=true, but the tokenizer of model_path={cfg.model_path} has no chat "
                          "template; set apply_chat_template=false to train on the texts as they are")
    return bool(cfg.apply_chat_template)


def use_bf16(cfg: CommonConfig) -> bool:
    if cfg.bf16 == "auto":
        return cuda_bf16()
    return cfg.bf16 == "true"


def autocast(cfg: CommonConfig, device: torch.device):
    """bf16 autocast over fp32 weights for single/ddp; fsdp2 and deepspeed cast themselves."""
    if use_bf16(cfg) and cfg.strategy in ("single", "ddp"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def prepare_trainable(model, cfg: CommonConfig) -> None:
    model.config.use_cache = False  # no KV cache in training: it only costs memory
    disable_dropout(model)  # as TRL's: the policy is scored against a reference in eval mode
    if cfg.gradient_checkpointing:
        recompute_activations(model)


def load_policy(cfg: CommonConfig, folder, device: torch.device | None, log):
    """The causal LM an offline trainer trains, in float32; with load_in_4bit (QLoRA) its linear layers quantized to
    NF4 as they load onto `device` (bitsandbytes quantizes where a layer is placed: each rank onto its own; None: the
    current CUDA device, else the CPU), computing in float32, every base weight frozen for the adapters."""
    from alignrl.models.loader import load_causal_lm

    if not getattr(cfg, "load_in_4bit", False):
        return load_causal_lm(folder, "float32", "model_path")
    from alignrl.models import quantized
    from alignrl.models.loader import ModelError, is_vision_folder

    if is_vision_folder(folder):
        raise ModelError(f"model_path={folder} is a vision-language model, which alignrl loads unquantized; set "
                         "load_in_4bit=false")
    quantized.require_bitsandbytes("load_in_4bit")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    policy = quantized.prepare_for_adapters(load_causal_lm(folder, "float32", "model_path",
                                                           four_bit=quantized.FourBit.of(cfg), device=device))
    quantized.load_quant_state_as_saved(policy)  # a resumed run loads its checkpoint's state dict back
    log.print(f"base quantized to 4-bit {cfg.bnb_4bit_quant_type.upper()} on {device} (QLoRA): only the LoRA adapters "
              "train")
    return policy


def policy_and_tokenizer(cfg: CommonConfig, device: torch.device | None, log):
    """(`load_policy`'s model of model_path, its tokenizer: chat template required, as `loader.load_model`'s)."""
    from alignrl.models.loader import load_tokenizer, resolve_model_path

    folder = resolve_model_path(cfg.model_path, log.print, "model_path")
    tokenizer = load_tokenizer(folder)
    return load_policy(cfg, folder, device, log), tokenizer


def trainable_causal_lm(cfg: CommonConfig, folder, log, device: torch.device | None = None):
    """(the loaded causal LM, the model that trains: it or its LoRA wrapper, the LoRA spec or None), prepared as
    every offline trainer prepares its model (`prepare_trainable`); `device`: where a 4-bit base loads
    (`load_policy`)."""
    from alignrl.preference import adapters

    policy = load_policy(cfg, folder, device, log)
    prepare_trainable(policy, cfg)
    spec = adapters.spec_of(cfg)
    model = adapters.attach(policy, spec, "CAUSAL_LM", cfg.seed) if spec is not None else policy
    if spec is not None:
        log.print(f"LoRA r={spec.rank} alpha={spec.alpha} on {spec.target_modules}: {adapters.count(model)}")
    return policy, model, spec


def bind_template_variables(tokenizer, cfg: CommonConfig, log) -> None:
    """`chat_template_kwargs` set on `tokenizer` before any pair is templated: the training and held-out rows (and
    the scorers' tables, which read the same ids) render with them; the saved tokenizer stays the model's own."""
    if cfg.chat_template_kwargs:
        log.print(f"chat template variables (chat_template_kwargs): {dict(cfg.chat_template_kwargs)}")
    with_template_variables(tokenizer, dict(cfg.chat_template_kwargs))


def build_engine_for(cfg: CommonConfig, model, env, total_steps: int):
    from alignrl.train.engines import OptimSpec, build_engine

    # OpenRLHF's math.ceil(max_steps * lr_warmup_ratio) and transformers' get_warmup_steps both round up
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    spec = OptimSpec(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas),
                     warmup_steps=min(warmup, total_steps),
                     total_steps=total_steps, schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio,
                     grad_clip=cfg.grad_clip)
    return build_engine(cfg.strategy, model, spec, env, zero_stage=cfg.zero_stage, bf16=use_bf16(cfg))


def describe_batch(cfg: CommonConfig, world: int) -> str:
    n = cfg.batch_size * world * cfg.gradient_accumulation_steps
    return (f"effective batch = per-device batch × world size × gradient accumulation = "
            f"{cfg.batch_size} × {world} × {cfg.gradient_accumulation_steps} = {n} pairs")


def global_batch(cfg: CommonConfig, world: int) -> int:
    return cfg.batch_size * world * cfg.gradient_accumulation_steps


def steps_per_epoch(n_pairs: int, cfg: CommonConfig, world: int) -> int:
    return n_pairs // global_batch(cfg, world)


def total_steps(n_pairs: int, cfg: CommonConfig, world: int) -> int:
    """Optimizer steps of the whole run: every epoch's whole global batches, capped at max_steps."""
    per_epoch = steps_per_epoch(n_pairs, cfg, world)
    return min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)


def check_enough(n_pairs: int, cfg: CommonConfig, world: int, what: str) -> None:
    if steps_per_epoch(n_pairs, cfg, world) < 1:
        raise DataError(f"{what}: {n_pairs} training pairs are fewer than one global batch "
                        f"({describe_batch(cfg, world)}); lower batch_size or gradient_accumulation_steps")


def micro_batches(n: int, cfg: CommonConfig, world: int, rank: int, epoch: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches (data set positions) of one epoch: torch's DistributedSampler (the same seeded
    shuffle on every rank, disjoint equal shares, remainder dropped) cut into micro-batches; only whole optimizer
    steps are kept, so every rank runs the same number of steps. Any rank can work out every other rank's."""
    from torch.utils.data import BatchSampler, DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    sampler.set_epoch(epoch)
    batches = list(BatchSampler(sampler, cfg.batch_size, drop_last=True))
    return batches[:len(batches) - len(batches) % cfg.gradient_accumulation_steps]


def train_loader(encoded: list, pairs: list, pad_id: int, cfg: CommonConfig, env, epoch: int):
    """This rank's micro-batches of one epoch (`micro_batches`), collated."""
    from torch.utils.data import DataLoader

    batches = micro_batches(len(encoded), cfg, env.world_size, env.rank, epoch)
    return DataLoader(encoded, batch_sampler=batches, num_workers=cfg.num_workers,
                      collate_fn=lambda items: collate_pairs(items, pairs, pad_id),
                      pin_memory=env.device.type == "cuda")


def eval_batches(encoded: list, pairs: list, pad_id: int, batch_size: int, env) -> list[PreferenceBatch]:
    """This rank's share of the held-out pairs (rank::world), padded with weight-0 copies so that
    every rank runs the same number of forwards (sharded engines need all ranks in each one)."""
    mine = encoded[env.rank::env.world_size]
    per_rank = -(-len(encoded) // env.world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine = mine + [encoded[0]] * (per_rank - len(mine))
    return [collate_pairs(mine[i:i + batch_size], pairs, pad_id, weights[i:i + batch_size])
            for i in range(0, len(mine), batch_size)]


# ---------------------------------------------------------------- rank-0 outputs


def run_folders(cfg: CommonConfig, default_out: str, default_log: str) -> tuple[Path, Path]:
    """The trained model's folder and the logging folder: --logging_dir, else logs/training/<the model folder's name>
    when --output_dir is given (runs of one task into other folders log apart), else the seed's `default_log`."""
    out = Path(cfg.output_dir or default_out)
    log = Path(cfg.logging_dir) if cfg.logging_dir else (Path("logs/training") / out.name if cfg.output_dir else
                                                         Path(default_log))
    if out.resolve() == log.resolve():
        raise ConfigError(f"the logging folder is the output folder ({out}): the saved model replaces that folder; "
                          f"give the logs one of their own, e.g. --logging_dir {out / 'logs'}")
    return out, log


def eval_due(cfg: CommonConfig, step: int, plan) -> bool:
    """Whether the held-out pairs are measured after `step` (not the last: the run's end measures them anyway), as
    `eval_strategy` says; `plan`: the run's `checkpoint_plan.CheckpointPlan`, which knows the epochs and steps."""
    if step >= plan.total or cfg.eval_strategy == "no":
        return False
    if cfg.eval_strategy == "epoch":
        return plan.per_epoch > 0 and step % plan.per_epoch == 0
    return bool(plan.eval_every) and step % plan.eval_every == 0


def train_pairs(engine, loss_fn, encoded: list, pairs: list, pad_id: int, cfg: CommonConfig, env,
                log: RankZeroLog, total: int, console_keys: dict[str, str], after_step=None, start_step: int = 0,
                loader=None) -> int:
    """Train `engine` on the preference pairs for `total` optimizer steps at most, over `cfg.epochs`
    epochs of this rank's micro-batches, `gradient_accumulation_steps` micro-batches per step;
    returns the steps run. `loss_fn(module, batch, global_pairs) -> (loss, metrics)` runs one
    micro-batch, already on the device, and returns the `core.preference` losses' form: the sum over
    its pairs divided by `global_pairs` (all ranks' pairs of one optimizer step), which the engines
    accumulate into the global batch's mean. `console_keys` (metric -> short name) picks what the
    step lines print besides the loss. `after_step(step) -> metrics` runs on every rank after each optimizer step
    (it may be a collective: every rank reaches the same steps); what it returns joins that step's metrics.
    `start_step` (a resumed run): the micro-batches of the first steps, in the same seeded order, are skipped.
    `loader(epoch)`: this rank's micro-batches of an epoch in `micro_batches`' order when they are not pairs
    (supervised fine-tuning's rows); its `loss_fn` then gives the micro-batch's mean loss as metrics["loss"]."""
    gpairs, accum, streak = global_batch(cfg, env.world_size), cfg.gradient_accumulation_steps, 0
    per_epoch, step = steps_per_epoch(len(encoded), cfg, env.world_size), start_step
    tracker = StepMetrics(cfg, env, log, total, {"loss": "loss", **console_keys})
    tracker.logged_step = start_step
    engine.module.train()
    for epoch in range(cfg.epochs):
        done = max(0, min(start_step - epoch * per_epoch, per_epoch))  # steps of this epoch run before a resume
        batches = loader(epoch) if loader is not None else train_loader(encoded, pairs, pad_id, cfg, env, epoch)
        for i, batch in enumerate(itertools.islice(batches, done * accum, None), start=done * accum):
            if step >= total:
                break
            batch = batch.to(env.device, non_blocking=True)
            last = (i + 1) % accum == 0
            # dropout's draws (LoRA's) keyed by the micro-batch, not by the random state so far: a resumed run, which
            # skipped the micro-batches before its checkpoint, draws what the whole run drew
            torch.manual_seed((cfg.seed * 1_000_003 + (epoch * per_epoch * accum + i) * 1_009 + env.rank) % 2**63)
            with engine.micro_batch(last):
                loss, metrics = loss_fn(engine.module, batch, gpairs)
                engine.backward(loss, last_micro=last)
            # recorded as this micro-batch's mean, comparable whatever the batch and world size
            mean = metrics["loss"] if "loss" in metrics else loss.item() * gpairs / batch.n_pairs
            tracker.add({**metrics, "loss": mean})
            if last:
                skipped = engine.skipped_steps
                grad_norm = engine.step()
                step += 1
                streak = streak + 1 if engine.skipped_steps > skipped else 0
                tracker.close_step(step, grad_norm, engine.lr())
                if after_step is not None:
                    tracker.extra.update(after_step(step))
                tracker.end_step(step, epoch)
                check_finite(step, streak, cfg.max_nonfinite_updates, log)
    return step


def check_finite(step: int, streak: int, limit: int, log: RankZeroLog) -> None:
    """Says a skipped optimizer step (a non-finite loss or gradient norm: the engine left the weights as they were),
    and stops the run after `limit` in a row: the weights no longer change, and the cause does not go away. The
    engines skip on the global norm, so every rank stops at the same step."""
    if streak >= limit:
        raise TrainingDiverged(f"training stopped at step {step}: the last {streak} optimizer step(s) had a "
                               "non-finite loss or gradient norm and were skipped; nothing is saved. Lower "
                               "learning_rate, keep grad_clip on, check the pairs, or raise max_nonfinite_updates")
    if streak:
        log.print(f"step {step}: optimizer step skipped: a non-finite loss or gradient norm ({streak} in a row; "
                  f"training stops at max_nonfinite_updates={limit})")


def check_eval_finite(value: float, what: str) -> None:
    """A trained model whose held-out `what` are not finite (a sum over all ranks: every rank stops) is not saved:
    its weights can be finite and still useless (a huge learning rate, no clipping, a last step that was skipped)."""
    if not math.isfinite(value):
        raise TrainingDiverged(f"the trained model gives non-finite {what} on the held-out pairs; nothing is saved. "
                               "Lower learning_rate, keep grad_clip on, or check the pairs")


def save_hf_folder(out_dir: Path, hf_model, state_dict: dict[str, torch.Tensor], tokenizer,
                   json_files: dict[str, Any], env, log=print, log_dir: Path | None = None,
                   keep: list[Path] = ()) -> None:
    """Rank 0 writes the model (from the engine's full state dict), tokenizer and JSON files into a
    temporary folder beside `out_dir`, then a manifest (the checkpoint rule of `alignrl.train.checkpoint`),
    and renames it into place: readers never see a partial model. Weights that are not finite are never
    written; a folder already at `out_dir` is moved aside and named, not deleted. This run's `log_dir`, when it lies
    inside `out_dir` (made there at the start), and its checkpoints there (`keep`: TRL's and verl's layouts) move into
    the new folder first: they stay where they were asked for."""
    bad = nonfinite(state_dict)  # every rank holds the full weights: all of them stop, not only rank 0
    if bad:
        raise CheckpointError(f"the trained model has NaN/inf weights ({bad[0]}); not saving it to {out_dir} "
                              "(lower learning_rate or check the training pairs)")
    if not env.is_main:
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    carried: list[Path] = []
    try:
        hf_model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name, obj in json_files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        write_manifest(tmp)
        _carry([log_dir, *keep], out_dir, tmp, carried)
        if _only_folders(out_dir):  # what held this run's logs and nothing else
            shutil.rmtree(out_dir)
        elif out_dir.exists() or out_dir.is_symlink():
            old = aside_path(out_dir.parent, f"{out_dir.name}.previous")
            os.replace(out_dir, old)
            log(f"{out_dir} already existed: moved it to {old}, not deleted")
        os.replace(tmp, out_dir)
    except BaseException:
        for inner in carried:  # the logs and checkpoints go back before the unfinished folder does
            (out_dir / inner).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / inner, out_dir / inner)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _only_folders(path: Path) -> bool:
    """A real folder holding folders only (no file, link or other entry at any depth): nothing of the user's."""
    return (path.is_dir() and not path.is_symlink()
            and all(p.is_dir() and not p.is_symlink() for p in path.rglob("*")))


def _carry(paths: list[Path | None], out_dir: Path, tmp: Path, carried: list[Path]) -> None:
    """Moves each of `paths` that lies inside `out_dir` to the same place in `tmp`, outermost first (a path inside one
    already moved went with it), adding each one's path inside to `carried` as soon as it is moved: a failure
    midway leaves the caller the list of what to put back."""
    if not out_dir.is_dir():
        return
    inner = []
    for path in paths:
        try:
            inner.append(path.resolve().relative_to(out_dir.resolve()) if path is not None else None)
        except ValueError:
            continue
    for rel in sorted({r for r in inner if r is not None and r != Path(".")}, key=lambda r: len(r.parts)):
        if any(rel.is_relative_to(done) for done in carried) or not (out_dir / rel).exists():
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(out_dir / rel, tmp / rel)
        carried.append(rel)
