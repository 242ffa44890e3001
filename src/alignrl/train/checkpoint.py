"""Checkpoints that are complete or ignored: `checkpoints/global_step_N/{model/, model_state/,
trainer_state.pt, manifest.json}` (plus `critic/`, `critic_state/`... with a critic) and a tracker file.

A checkpoint is written into `.global_step_N.tmp`, every file is flushed to disk, `manifest.json` (each
file's path and size) is written last, and the folder is renamed into place. A folder counts as a
checkpoint only when its manifest matches its files, so neither a run killed mid-write, nor a copy cut
short, nor a truncated file can become the resume point: resume takes the newest complete checkpoint and
says why newer folders were skipped. The tracker (`latest_checkpointed_iteration.txt`, verl's name) is
still written for tools that read it, but resume does not trust it.

Nothing a run did not write is deleted. Rotation removes only complete checkpoints older than the newest
`keep`, after the new one is complete. The folders resume skipped (all of them when the run starts fresh,
`trainer.resume_mode=disable` included) are moved to `checkpoints/<why>-<time>/`: the run writes those
steps again, and a fresh run's pool must not mix with an older run's. Weights are checked finite first.
The trainer state holds everything a resumed run needs to continue bit-for-bit: optimizer, scheduler,
RNG states, data position, step and counters.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from alignrl.models.vision import processor_of, save_processor
from alignrl.data.loaders import DataError
from alignrl.models import lora
from alignrl.runtime.env import SINGLE, DistEnv, all_reduce_sum, barrier
from alignrl.utils.atomic import atomic_write_text
from alignrl.utils.progress import Phase

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"


class CheckpointError(DataError):
    """A checkpoint cannot be written or read; the message names it and says what to do."""


class DamagedShard(CheckpointError):
    """A checkpoint file that one rank alone reads (its ZeRO optimizer shard) cannot be read: that rank says so,
    where a user error every rank meets is said by rank 0 alone."""

    this_rank_only = True


def hold_run_dir(run_dir: Path, other: str = "another trainer.experiment_name or trainer.output_dir"):
    """The run folder, claimed for this process while the returned file stays open (a POSIX lock, which the kernel
    drops when the process dies, kill -9 included): two runs writing one folder's checkpoints and logs would
    corrupt each other's. ConfigError in one line when another process holds it; None where the file system has
    no locks (the run then goes on unguarded). A second claim by the same process succeeds. `other`: the settings
    that give a run a folder of its own, for the message."""
    import errno
    import fcntl
    import socket

    from alignrl.config import ConfigError

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(f"another run ({holder or 'another process'}) is writing {run_dir}: stop it first, or "
                              f"give this run {other}") from None
        return None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


# ---------------------------------------------------------------- completeness


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    """Flushes every file under `folder` to disk, then records each one's size in `manifest.json`. It is
    written last, so a manifest whose sizes match means the folder is whole, even after a power loss."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)
    for path in files + sorted({p.parent for p in files} | {folder}):  # the directory entries too
        _fsync(path)
    sizes = {p.relative_to(folder).as_posix(): p.stat().st_size for p in files}
    atomic_write_text(folder / MANIFEST, json.dumps({"files": sizes}, indent=1))


def manifest_problem(folder: Path) -> str | None:
    """Why `folder` is not complete (a few words), or None when its manifest matches its files."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        listed = [(rel, int(size)) for rel, size in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST}: its writing was interrupted, or an older alignrl wrote it"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"unreadable {MANIFEST}"
    for rel, size in listed:
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {size}"
    return None


def step_folders(root: Path) -> list[Path]:
    """The `global_step_N` folders under `root`, newest first."""
    found = [(int(p.name[len("global_step_"):]), p) for p in root.glob("global_step_*")
             if p.is_dir() and p.name[len("global_step_"):].isdigit()]
    return [p for _, p in sorted(found, reverse=True)]


def nonfinite(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an inf. A 4-bit weight packed in a float dtype
    (bnb_4bit_quant_storage) holds codes, not numbers, whose bytes read as floats are often NaN: bitsandbytes names its
    quantization state beside it (`<weight>.quant_state.bitsandbytes__nf4`), which tells it apart."""
    packed = {k.split(".quant_state.", 1)[0] for k in state_dict if ".quant_state." in k}
    return [k for k, v in state_dict.items()
            if k not in packed and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def aside_path(parent: Path, name: str) -> Path:
    """A new path `parent/name-<time>` for folders moved out of the way instead of deleted."""
    base = parent / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


# ---------------------------------------------------------------- save


def _last_complete(root: Path) -> str:
    done = [f for f in step_folders(root) if manifest_problem(f) is None]
    return f"the last complete checkpoint is {done[0]}" if done else "no complete checkpoint was written before"


class NonFiniteWeights(CheckpointError):
    """A model to be saved holds NaN/inf weights; raised on every rank of its group."""

    def __init__(self, name: str, tensor: str):
        self.what, self.tensor = ("model" if name == "model" else f"{name} model"), tensor
        super().__init__(f"the {self.what} has NaN/inf weights ({tensor})")


def save_engine(engine, folder: Path, name: str, env: DistEnv = SINGLE) -> None:
    """Collective: `folder/name` (full HF weights, written by rank 0) and `folder/name_state` (the engine's
    resumable optimizer state). Raises NonFiniteWeights on every rank, or none does (a rank left alone in
    the next collective would hang), before writing anything of it. A model with LoRA adapters is written as
    its model.lora_export says (a plain HF folder with the adapters merged in, or PEFT's adapter folder), and its
    trained tensors, by their own names, go into `name_state` for an exact resume."""
    full = engine.full_state_dict(main_only=True)  # collective; rank 0 writes
    bad = nonfinite(full)
    if all_reduce_sum(env, [float(len(bad))])[0]:
        raise NonFiniteWeights(name, bad[0] if bad else "some tensor")
    adapters = lora.has_adapters(engine.model)
    if env.is_main:
        how = lora.export_of(engine.model)
        lora.save_model_folder(engine.model, full, folder / name, how)
        saved = {v.dtype for v in full.values() if v.is_floating_point()}
        if how != "adapter" and len(saved) == 1 and (dtype := saved.pop()) != engine.model.dtype:
            # FSDP2 keeps a bf16 model's shards in fp32 and saves bf16: config.json names the saved dtype
            engine.model.config.dtype = str(dtype).removeprefix("torch.")
            engine.model.config.save_pretrained(folder / name)
        if adapters:
            lora.save_trained(engine.model, full, folder / f"{name}_state")
    del full  # the host copy goes before the optimizer state is gathered
    (folder / f"{name}_state").mkdir(exist_ok=True)
    engine.save_state(folder / f"{name}_state")  # collective


def _rotate(root: Path, newest: Path, keep: int) -> None:
    """Keeps the checkpoint just written and the `keep - 1` newest other complete ones (all with `keep` 0);
    incomplete folders are never touched (they are not ours to judge)."""
    if keep == 0:
        return
    others = [f for f in step_folders(root) if f != newest and manifest_problem(f) is None]
    for old in others[keep - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(ckpt_root: Path, step: int, engines: dict[str, Any], tokenizer, trainer_state: dict[str, Any],
                    keep: int, env: DistEnv = SINGLE, elsewhere: list[Callable[[Path], str | None]] = (),
                    collect: list[Callable[[], None]] = ()) -> Path:
    """Collective: every rank calls it. `engines` maps a folder name to a TrainEngine ("model" for the
    policy, "critic", "cost_critic"): each is saved as a full HF folder plus `<name>_state/` (its resumable
    optimizer state). Rank 0 writes everything except DeepSpeed's per-rank optimizer shards. `elsewhere`:
    writers of the parts other workers hold (a Ray critic group), called on rank 0 with the folder being
    written; each returns None or the line saying why it failed. `collect`: collectives every rank runs before
    those writers, putting together on rank 0 what they write (a moving average each rank keeps a shard of). Raises
    CheckpointError, completing nothing, when a weight is not finite or a part could not be written."""
    final = ckpt_root / f"global_step_{step}"
    tmp = ckpt_root / f".global_step_{step}.tmp"  # one name on every rank: DeepSpeed ranks write into it
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover: never complete, never resumed
        tmp.mkdir(parents=True)
    barrier(env)
    # every rank writes into rank 0's folder (DeepSpeed's optimizer shards): a node that does not see it would
    # fail with FileNotFoundError while the others wait in the save's collectives
    if all_reduce_sum(env, [float(not tmp.is_dir())])[0]:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{ckpt_root} is not shared by all ranks (some do not see the folder rank 0 made "
                              "there): put trainer.output_dir on a file system every node mounts")
    try:
        with Phase(f"checkpoint global_step_{step}", len(engines) + 1, "parts") as progress:
            _write_parts(ckpt_root, step, engines, tokenizer, trainer_state, tmp, env, elsewhere, collect, progress)
        if env.is_main:
            if final.exists():  # resume moved later folders aside, so only another writer can have made it
                raise CheckpointError(f"{final} appeared while this run was writing it; not overwriting it "
                                      "(is another run writing into the same trainer.output_dir?)")
            os.replace(tmp, final)
            _fsync(ckpt_root)
            atomic_write_text(ckpt_root / TRACKER, str(step))
            _rotate(ckpt_root, final, keep)
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(env)
    return final


def _write_parts(ckpt_root: Path, step: int, engines: dict[str, Any], tokenizer, trainer_state: dict[str, Any],
                 tmp: Path, env: DistEnv, elsewhere, collect, progress: Phase) -> None:
    """Collective: each engine's weights and state into `tmp`, then the parts other workers hold, the tokenizer,
    the trainer state and the manifest (rank 0); `progress` counts the engines and the rest as one part."""
    for name, engine in engines.items():
        try:
            save_engine(engine, tmp, name, env)
        except NonFiniteWeights as e:
            raise CheckpointError(f"the {e.what} has NaN/inf weights after step {step} ({e.tensor}); not saving; "
                                  f"{_last_complete(ckpt_root)} (fix the cause, e.g. a lower learning rate, "
                                  "and resume from it with trainer.resume_mode=auto)") from None
        progress.advance()
    for gather in collect:  # on every rank: what rank 0's writers below write
        gather()
    lines = [save(tmp) for save in elsewhere] if env.is_main else []
    failed = [line for line in lines if line]
    if all_reduce_sum(env, [float(len(failed))])[0]:  # every rank stops, not only the one that knows why
        raise CheckpointError(f"step {step} not saved: {failed[0] if failed else 'see rank 0'}; "
                              f"{_last_complete(ckpt_root)}")
    barrier(env)
    if env.is_main:
        tokenizer.save_pretrained(tmp / "model")
        processor = processor_of(tokenizer)
        if processor is not None:  # a vision-language model's folder loads with its image processor
            save_processor(processor, tmp / "model")
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
        write_manifest(tmp)
    progress.advance()


# ---------------------------------------------------------------- resume


def load_trainer_state(ckpt: Path, mmap: bool = False) -> dict[str, Any]:
    """`mmap`: the tensors stay on disk until read (a look at the small entries before the models load)."""
    path = ckpt / "trainer_state.pt"
    try:  # our own file, written by save_checkpoint; it holds optimizer tensors and RNG states
        return torch.load(path, weights_only=False, mmap=mmap)
    except Exception as e:  # any way the file is damaged: truncated zip, bad pickle, unreadable
        cause = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot read {path} ({cause}); move {ckpt} out of {ckpt.parent} to resume from "
                              "the checkpoint before it, or start fresh with trainer.resume_mode=disable") from None


def latest_checkpoint(root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under `root` (None if there is none), and the newer folders skipped,
    each as `global_step_N (why)`."""
    skipped = []
    for folder in step_folders(root):
        why = manifest_problem(folder)
        if why is None:
            try:
                load_trainer_state(folder)
            except CheckpointError:
                why = "unreadable trainer_state.pt"
        if why is None:
            return folder, skipped
        skipped.append(f"{folder.name} ({why})")
    return None, skipped


def _tracker_note(root: Path, chosen: Path) -> str:
    try:
        said = (root / TRACKER).read_bytes().decode(errors="replace").strip()
    except OSError:  # no tracker (a copied run folder, say): nothing to disagree with
        return ""
    return "" if said == chosen.name[len("global_step_"):] else f"; {TRACKER} says {said[:40]!r}, ignored"


def _move_aside(root: Path, why: str, folders: list[Path]) -> Path | None:
    if not folders:
        return None
    dest = aside_path(root, why)
    dest.mkdir()
    for folder in folders:
        os.replace(folder, dest / folder.name)
    return dest


def resume_point(root: Path, mode: str, env: DistEnv = SINGLE, log: Callable[[str], None] = print,
                 config: Path | None = None) -> Path | None:
    """Collective. The checkpoint to resume from under `resume_mode` ('auto' or 'disable'), or None to start
    fresh. The folders this run may write again (all of them when it starts fresh, the skipped newer ones
    when it resumes) are moved aside, never deleted, and rank 0 says so in one line. Starting fresh, the
    earlier run's `config` file goes with its checkpoints (the new run writes its own in its place)."""
    folders = step_folders(root)
    resume, skipped = latest_checkpoint(root) if mode == "auto" else (None, [])
    barrier(env)  # every rank decided from the same folders before rank 0 moves any
    if env.is_main and folders:
        moved = folders[:len(skipped)] if resume else folders
        dest = _move_aside(root, "incomplete" if mode == "auto" else "previous_run", moved)
        if dest is not None and resume is None and config is not None and config.is_file():
            shutil.copy2(config, dest / config.name)
        if mode != "auto":
            log(f"trainer.resume_mode={mode}: starting fresh; the existing checkpoints "
                f"({', '.join(f.name for f in moved)}) were moved to {dest}, not deleted")
        elif resume is None:
            log(f"no complete checkpoint in {root}: {'; '.join(skipped)}; starting fresh; those folders were "
                f"moved to {dest}, not deleted")
        elif skipped or _tracker_note(root, resume):
            log((f"skipped {'; '.join(skipped)}: moved to {dest}, not deleted; " if skipped else "")
                + f"resuming from {resume.name}, the newest complete checkpoint" + _tracker_note(root, resume))
    barrier(env)
    return resume


def check_not_past(resume: Path | None, total: int) -> None:
    """A checkpoint past the run's last step would train nothing and write over the summary: one line."""
    done = int(resume.name[len("global_step_"):]) if resume else 0
    if done > total:
        from alignrl.config import ConfigError

        raise ConfigError(f"the newest checkpoint, {resume}, is past trainer.total_training_steps={total}: set it "
                          f"above {done} to train on, or trainer.resume_mode=disable to start afresh")


def check_newest_not_past(cfg) -> None:
    """check_not_past for the checkpoint a run of `cfg` (a RunConfig) would resume from: before anything starts."""
    if cfg.trainer.resume_mode == "auto":
        check_not_past(latest_checkpoint(cfg.checkpoint_root)[0], cfg.trainer.total_training_steps)
