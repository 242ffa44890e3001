"""Where, when and how many checkpoints an offline run (`alignrl train sft|rm|dpo|kto`) writes, in the folder layout
of the project its command line is written for, and which one `resume_from=auto` goes on from.

    layout    folder of step N       the model as an HF folder          also written
    alignrl   step_N                 -                                  -
    trl       checkpoint-N           in the checkpoint folder itself    a checkpoint at the last step
    verl      global_step_N          global_step_N/huggingface          the last step; latest_checkpointed_iteration.txt

Checkpoints go to `checkpoint_dir`: by default `<output_dir>.checkpoints` (alignrl), `output_dir` itself (trl, verl:
TRL's `checkpoint-500` beside the final model, verl's `default_local_dir`). A checkpoint folder is written whole into
a hidden temporary folder and renamed into place (`checkpoints.save_checkpoint`), so every folder of the layout's
name is complete; `save_total_limit` deletes the oldest ones once a newer one is in place. `save_strategy`: every
`save_steps` optimizer steps (steps), at each epoch's end (epoch: TRL's `--save_strategy epoch`, verl's
`save_freq=after_each_epoch`), or never (no). What each folder holds: `preference.checkpoints`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from alignrl.config import ConfigError
from alignrl.preference import checkpoints as ckpt

from alignrl.train.checkpoint import TRACKER  # verl's file naming the step of the newest checkpoint


@dataclass(frozen=True)
class Layout:
    prefix: str  # a checkpoint folder is prefix + its step
    hf_folder: str | None  # where in it the model is written as an HF folder too ("" the folder itself); None: not
    save_last: bool  # a checkpoint at the last step too (the final model is written besides)
    tracker: bool  # verl's tracker file in the checkpoint folder's parent
    inside_output: bool  # the default checkpoint_dir is output_dir itself, not <output_dir>.checkpoints


LAYOUTS = {"alignrl": Layout("step_", None, False, False, False),
           "trl": Layout("checkpoint-", "", True, False, True),
           "verl": Layout("global_step_", "huggingface", True, True, True)}

# the trained model as an HF folder: (object whose save_pretrained writes it, the state dict it writes), from the
# engine's full state dict (`adapters.saver`), and its tokenizer
Export = Callable[[dict], tuple[Any, dict]]


@dataclass(frozen=True)
class CheckpointPlan:
    root: Path
    layout: Layout
    strategy: str  # steps | epoch | no
    every: int  # save_steps
    per_epoch: int  # optimizer steps of an epoch
    total: int  # of the run
    keep: int  # save_total_limit (0: all)
    eval_every: int = 0  # eval_steps in steps (common.eval_due)

    def due(self, step: int) -> bool:
        if self.strategy == "no":
            return False
        if step >= self.total:  # the final model is saved anyway; TRL and verl also write the last checkpoint
            return self.layout.save_last
        if self.strategy == "epoch":
            return self.per_epoch > 0 and step % self.per_epoch == 0
        return self.every > 0 and step % self.every == 0

    def folder(self, step: int) -> Path:
        return self.root / f"{self.layout.prefix}{step}"

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint under root, oldest first."""
        if not self.root.is_dir():
            return []
        pattern = re.compile(re.escape(self.layout.prefix) + r"(\d+)$")
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := pattern.match(p.name))]
        return sorted((s, p) for s, p in found if (p / ckpt.WEIGHTS).is_file() and (p / ckpt.STATE).is_file())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def inside(self, out_dir: Path) -> list[Path]:
        """This plan's folders and files within `out_dir`, which the final save keeps in place (TRL's and verl's
        checkpoints live in the output folder, which the saved model replaces)."""
        try:
            inner = self.root.resolve().relative_to(out_dir.resolve())
        except ValueError:
            return []
        if inner != Path("."):
            return [self.root]
        tracker = [self.root / TRACKER] if (self.root / TRACKER).is_file() else []
        return [p for _, p in self.complete()] + tracker


def plan_for(cfg, out_dir: Path, total: int, per_epoch: int) -> CheckpointPlan:
    layout = LAYOUTS[cfg.checkpoint_layout]
    if cfg.checkpoint_dir:
        root = Path(cfg.checkpoint_dir)
    else:
        root = out_dir if layout.inside_output else ckpt.checkpoint_root(out_dir)
    return CheckpointPlan(root, layout, cfg.save_strategy, every_steps(cfg.save_steps, total), per_epoch, total,
                          cfg.save_total_limit, every_steps(cfg.eval_steps, total))


def every_steps(value: float, total: int) -> int:
    """save_steps' or eval_steps' steps: a whole number as it is, one below 1 that share of the run's steps rounded
    up (transformers' ratio form), 0 never."""
    if 0 < value < 1:
        return max(math.ceil(value * total), 1)
    if value != int(value):
        raise ConfigError(f"save_steps/eval_steps={value}: a whole number of steps, or below 1 a share of the run's "
                          "steps (as transformers: no fraction above 1)")
    return int(value)


def resume_folder(cfg, plan: CheckpointPlan, log, env=None) -> str | None:
    """The folder `resume_from` names: `auto` is the newest complete checkpoint of the plan's folder (said), or none
    on a first run (said too: the run starts from the base model, as verl's resume_mode=auto and OpenRLHF's
    --load_checkpoint do); `latest` is that checkpoint, and a run with none stops in one line (as transformers'
    resume_from_checkpoint=True, which TRL's --resume_from_checkpoint true is). Rank 0 chooses for every rank
    (`env`): listings of a shared folder can differ between nodes."""
    if cfg.resume_from not in ("auto", "latest"):
        return cfg.resume_from
    latest = plan.latest() if env is None or env.is_main else None
    if env is not None and env.world_size > 1:
        from alignrl.runtime.env import broadcast_frames

        chosen = broadcast_frames([str(latest or "").encode()] if env.is_main else None, env)[0].decode()
        latest = Path(chosen) if chosen else None
    if latest is None and cfg.resume_from == "latest":
        raise ConfigError(f"resume_from=latest (TRL's --resume_from_checkpoint true): no checkpoint in {plan.root} to "
                          "go on from; drop it to start from the base model, or give a checkpoint folder")
    if latest is None:
        log.print(f"resume_from=auto: no checkpoint in {plan.root} yet; training starts from the base model")
        return None
    log.print(f"resume_from={cfg.resume_from}: going on from {latest}, the latest checkpoint in {plan.root}")
    return str(latest)


def set_aside(plan: CheckpointPlan, start: int, env, log) -> None:
    """Collective, once the run knows the step it starts at: the layout's complete checkpoints it will not go on from
    (all of them on a fresh run, those past `start` on a resumed one: another run's, in a reused output folder) move
    aside, named, never deleted, so that rotation and a later resume_from=auto see this run's alone. A resumed step
    past the run's last is one line."""
    from alignrl.runtime.env import barrier
    from alignrl.train.checkpoint import aside_path

    if start > plan.total:
        raise ConfigError(f"resume_from: the checkpoint is step {start}, past this run's last step {plan.total}; "
                          "resume with the config that wrote it, or start a fresh run in another output folder")
    if env.is_main:
        stale = [p for step, p in plan.complete() if step > start or not start]
        tracker = plan.root / TRACKER
        for path in stale + ([tracker] if stale and tracker.is_file() else []):
            os.replace(path, aside_path(path.parent, f"{path.name}.previous"))
        if stale and start and plan.layout.tracker:  # verl's tracker names the step the run goes on from
            (plan.root / TRACKER).write_text(str(start))
        if stale:
            log.print(f"{len(stale)} checkpoint(s) in {plan.root} this run does not go on from moved aside "
                      f"({', '.join(p.name for p in stale[:3])}{', ...' if len(stale) > 3 else ''})")
    barrier(env)


def resumed_step(cfg, plan: CheckpointPlan, engine, command: str, log, env, setting: dict | None = None,
                 unrecorded: dict | None = None) -> int:
    """The step of the checkpoint `resume_from` names, its weights and optimizer state loaded into `engine` (said
    once); 0 for a fresh run. For the trainers whose checkpoint holds nothing else (rm, sft, kto, prm; `setting`:
    what the checkpoint must have been trained with, `unrecorded`: what one from before settings were recorded was,
    `checkpoints.resume`). Collective."""
    folder = resume_folder(cfg, plan, log, env)
    start = ckpt.resume(folder, engine, None, command, setting=setting, unrecorded=unrecorded) if folder else 0
    if start:
        log.print(f"resumed from {folder} at step {start}")
    set_aside(plan, start, env, log)
    return start


def save_if_due(plan: CheckpointPlan, step: int, engine, env, log, export: Export | None = None, tokenizer=None,
                json_files: dict | None = None, **extra) -> None:
    """Collective (every rank reaches the same steps): the step's checkpoint when the plan says so, with the model
    as an HF folder where the layout holds one (`export`, `tokenizer`); then the oldest beyond save_total_limit go.
    `json_files`: name -> object written into the HF folder too (a scorer's alignrl_score.json); `extra`: what
    `checkpoints.save_checkpoint` also keeps (DPO's λ, synced reference, running reward mean)."""
    if not plan.due(step):
        return
    if plan.layout is LAYOUTS["trl"]:
        json_files = {**(json_files or {}), "trainer_state.json": trainer_state(plan, step, getattr(log, "history", []))}
    write_hf = (_hf_writer(plan.layout.hf_folder, export, tokenizer, json_files or {})
                if plan.layout.hf_folder is not None else None)
    where = ckpt.save_checkpoint(plan.root, step, engine, extra.pop("lam", None), env, also=write_hf,
                                 name=plan.folder(step).name, **extra)
    if env.is_main:
        if plan.layout.tracker:
            tmp = plan.root / f".{TRACKER}.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, plan.root / TRACKER)
        _rotate(plan, where)
    log.print(f"checkpoint {where}")


def trainer_state(plan: CheckpointPlan, step: int, history: list[dict]) -> dict:
    """transformers' TrainerState of a TRL-layout checkpoint (`trainer_state.json`, what tools that plot a run or list
    its checkpoints read): the step, the epoch as a fraction, and the metrics recorded before it under transformers'
    names (loss, grad_norm, learning_rate, eval_loss, ...; the step's own training row and held-out measure too, as
    transformers logs and evaluates before it saves)."""
    def theirs(name: str) -> str:
        name = name.removeprefix("train/")
        return "learning_rate" if name == "lr" else name.replace("eval/", "eval_")

    per_epoch = max(plan.per_epoch, 1)
    rows = [{**{theirs(k): v for k, v in row.items() if k != "step"}, "epoch": row["step"] / per_epoch,
             "step": row["step"]} for row in history if row["step"] <= step]
    return {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
            "epoch": step / per_epoch, "eval_steps": plan.eval_every or None, "global_step": step,
            "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
            "log_history": rows, "logging_steps": None, "max_steps": plan.total,
            "num_train_epochs": math.ceil(plan.total / per_epoch), "save_steps": plan.every, "stateful_callbacks": {},
            "total_flos": 0, "train_batch_size": None, "trial_name": None, "trial_params": None}


def _hf_writer(inner: str, export: Export | None, tokenizer, json_files: dict):
    """What writes the model as an HF folder at `inner` of a checkpoint being written (None without an export)."""
    if export is None:
        return None

    def write(tmp: Path, weights: dict) -> None:
        writer, state = export(weights)
        writer.save_pretrained(tmp / inner, state_dict=state)
        tokenizer.save_pretrained(tmp / inner)
        for name, obj in json_files.items():
            (tmp / inner / name).write_text(json.dumps(obj, indent=2) + "\n")
    return write


def _rotate(plan: CheckpointPlan, newest: Path) -> None:
    if not plan.keep:
        return
    done = [p for _, p in plan.complete() if p != newest]
    for old in done[:max(len(done) - (plan.keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)

