"""DeepSpeed ZeRO-1/2/3 (optional CPU offload of the optimizer), from a JSON config file such as
`config/deepspeed/zero3.json` / `deepspeed.json`, or generated from our config and saved with the run.

Our own AdamW and schedule are handed to DeepSpeed as the client optimizer and scheduler, so the
update rule is the same as every other backend's. Micro-batch accumulation is driven by us (the number
of micro-batches varies with lengths), through `set_gradient_accumulation_boundary`; the loss is
already normalised for the global batch, so DeepSpeed's own 1/gas scaling is switched off.
DeepSpeed's checkpoint format is its own: it resumes under DeepSpeed; other backends take the weights.
Below ZeRO-3 its model states file would hold the whole module again beside the checkpoint's own copy of the
weights: it holds their fingerprints instead (`save_state`, `load_state`).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from alignrl.runtime.env import DistEnv, cuda_bf16, join_group
from alignrl.errors import ConfigError, UserError
from alignrl.train.engines.base import OptimSpec, host_state_dict, state_dtypes

TAG = "deepspeed"  # the sub-folder DeepSpeed's save_checkpoint writes inside a checkpoint
# the one key of the "module" entry of a model states file whose weights the checkpoint holds elsewhere (its HF folder)
WEIGHTS_ELSEWHERE = "alignrl_weights_elsewhere"


class DeepSpeedConfigError(UserError):
    """A DeepSpeed JSON config that cannot be used; the message names the file and the key."""


def ds_config(stage: int, offload: bool, grad_clip: float, bf16: bool, world: int) -> dict:
    """The DeepSpeed config our settings imply (batch sizes are nominal: we drive accumulation)."""
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
            "zero_optimization": zero, "gradient_clipping": grad_clip if grad_clip > 0 else 0.0,
            "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
            # our torch AdamW also runs on offloaded CPU partitions (no compiled DeepSpeedCPUAdam needed)
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def load_ds_config(path: str, world: int) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DeepSpeedConfigError(f"trainer.deepspeed_config={path!r} does not exist; pass a JSON file "
                                   "(e.g. config/deepspeed/zero3.json) or leave it empty to generate one") from None
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg.get("zero_optimization", {}), dict):
        raise DeepSpeedConfigError(f"{path}: zero_optimization must be an object like {{\"stage\": 2}}")
    # users' files carry their own batch numbers (the ZeroMQ deepspeed.json: 16 = 4 × 1 × 4); ours drive accumulation
    cfg.update({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world})
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    cfg.setdefault("steps_per_print", 10**9)
    if cfg.get("bf16", {}).get("enabled") == "auto":
        cfg["bf16"]["enabled"] = cuda_bf16()
    return cfg


def engine_config(deepspeed_config: str | None, stage: int, offload: bool, grad_clip: float, bf16: bool,
                  world: int) -> dict:
    """The DeepSpeed config a run trains with: its JSON file's (batch numbers ours), else generated."""
    return (load_ds_config(deepspeed_config, world) if deepspeed_config
            else ds_config(stage, offload, grad_clip, bf16, world))


@contextmanager
def partitioned_init(config: dict, env: DistEnv) -> Iterator[None]:
    """A ZeRO-3 `config`'s models built inside come partitioned over the ranks (deepspeed.zero.Init, through
    transformers' HfDeepSpeedConfig), as OpenRLHF builds its ZeRO-3 actor: no rank holds the whole model, on the host
    or its GPU. Without it DeepSpeed moves the whole model to each rank's GPU and only then partitions it."""
    from transformers.integrations import HfDeepSpeedConfig

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if env.device.type == "cuda" else "cpu")
    _ensure_comm(env)
    live = HfDeepSpeedConfig(config)  # transformers builds under zero.Init while this object lives (a weak reference)
    try:
        yield
    finally:
        del live


def zero_stage(deepspeed_config: str | None, default: int) -> int:
    """The ZeRO stage a run will train with: its JSON file's, when it gives one, else `default`."""
    if not deepspeed_config:
        return default
    return int(load_ds_config(deepspeed_config, 1).get("zero_optimization", {}).get("stage", 0))


def _ensure_comm(env: DistEnv) -> None:
    """DeepSpeed needs a process group even in one process; give it a one-rank group there."""
    import deepspeed

    if env.device.type == "cpu":
        # On its first CPU init DeepSpeed compiles a shared-memory all-reduce (40-60 s on 2 cores, once per
        # torch_extensions cache) that only its inference all-reduce uses; training's collectives go through the
        # gloo group. DeepSpeed keeps its op table in one dict so that edits to it hold (deepspeed/ops/__init__.py).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not torch.distributed.is_initialized():
        if env.distributed:
            join_group(env.device)  # the launcher's env:// group (NCCL told its GPU)
        else:
            _join_alone(env.device)
    deepspeed.init_distributed(dist_backend="nccl" if env.device.type == "cuda" else "gloo", verbose=False)


def _join_alone(dev: torch.device) -> None:
    """A one-rank group on an in-memory store: no port, and no MASTER_PORT/RANK/WORLD_SIZE left in `os.environ`,
    where they would outlive the run in a longer-lived process (a torchrun it starts later would inherit them: a
    port still held, or WORLD_SIZE=1 telling it it already runs as one rank). DeepSpeed reads only LOCAL_RANK
    (ZeRO-3's partitioning, before its engine sets it itself)."""
    os.environ.setdefault("LOCAL_RANK", "0")
    nccl = dev.type == "cuda"
    torch.distributed.init_process_group("nccl" if nccl else "gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1, **({"device_id": dev} if nccl else {}))


class DeepSpeedEngine:
    name = "deepspeed"
    parallel_micro_batches = False  # DeepSpeed partitions and reduces gradients inside its own backward

    def add_gradients(self, grads: list[torch.Tensor | None]) -> None:
        raise RuntimeError("a DeepSpeed engine takes gradients through its own backward only "
                           "(parallel_micro_batches is False)")

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, env: DistEnv, config: dict):
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if env.device.type == "cuda" else "cpu")
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        _ensure_comm(env)
        self.env, self.spec, self.config = env, spec, config
        self.stage = int(config.get("zero_optimization", {}).get("stage", 0))
        self.whole_weights = self.stage < 3
        self.born_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # built in partitioned_init
        model.to(env.device)
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        optimizer, scheduler = spec.build(params)
        self.module, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        self.model = self.module.module
        self.applied_lr: float | None = None

    def micro_batch(self, last_micro: bool) -> AbstractContextManager:
        return nullcontext()  # the boundary is set in backward

    def backward(self, loss: torch.Tensor, last_micro: bool = True) -> None:
        self.module.set_gradient_accumulation_boundary(last_micro)
        self.module.backward(loss * self.env.world_size, scale_wrt_gas=False)

    @property
    def skipped_steps(self) -> int:
        return self.module.skipped_steps  # DeepSpeed's own count, which `step` adds its skips to

    def step(self, skip: bool = False) -> float:
        """DeepSpeed skips a step (optimizer and lr) only when its optimizer sets `overflow`: the ZeRO
        optimizers do for a non-finite gradient norm. A plain torch optimizer (stage 0, fp32) has no such
        check, so there the gradients, whole in `.grad` after the boundary backward, are checked here.
        Under ZeRO a non-finite loss whose gradients are finite (`skip`) is not skipped: the reduced
        gradients sit in DeepSpeed's partitions, out of reach; a NaN loss almost always has NaN gradients."""
        self.applied_lr = self.scheduler.get_last_lr()[0]  # the scheduler moves on to the next step's in this one
        self.module.set_gradient_accumulation_boundary(True)
        if not hasattr(self.module.optimizer, "overflow"):
            norms = [torch.linalg.vector_norm(p.grad) for p in self.model.parameters() if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
            if skip or not math.isfinite(norm):
                self.module.zero_grad()
                self.module.skipped_steps += 1
                return norm
            self.module.step()
            return norm
        self.module.step()
        norm = self.module.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        """The learning rate of the latest step (warm-up shows), the first step's before any."""
        return self.scheduler.get_last_lr()[0] if self.applied_lr is None else self.applied_lr

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return state_dtypes(self.model)

    def full_state_dict(self, main_only: bool = False) -> dict[str, torch.Tensor]:
        skip = main_only and not self.env.is_main
        if self.stage < 3:
            return {} if skip else host_state_dict(self.model, self.model.state_dict())
        import deepspeed

        # every rank takes part in the gather; with main_only only rank 0 copies the model to host memory
        # (a 7B model's 15 GB on each of a node's 8 ranks otherwise, at every publish)
        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            return {} if skip else host_state_dict(self.model, self.model.state_dict(), clone=True)

    def save_state(self, folder: Path) -> None:
        """DeepSpeed's checkpoint into `folder/deepspeed`. Below ZeRO-3 its model states file would hold the whole
        module (from ZeRO-2 on, its frozen weights once more) beside the HF folder that already holds them, which
        is what a resume builds the model from: it holds their fingerprints instead, which `load_state` checks the
        model against. ZeRO-3's holds only empty placeholders of the partitioned weights already: kept as it is."""
        if not self.whole_weights:
            self.module.save_checkpoint(str(folder), tag=TAG)
            return
        writes = self.module.save_non_zero_checkpoint  # the one rank that writes that file
        # an instance attribute over the engine's own method, which its _save_checkpoint calls for the "module" entry
        self.module.module_state_dict = lambda **_: (
            {WEIGHTS_ELSEWHERE: fingerprints(self.model.state_dict())} if writes else {})
        try:
            self.module.save_checkpoint(str(folder), tag=TAG, exclude_frozen_parameters=True)
        finally:
            del self.module.module_state_dict

    def load_state(self, folder: Path) -> bool:
        """The optimizer, scheduler and step counts of `folder`; the model already holds the checkpoint's weights
        (loaded from its HF folder, or the base and the trained LoRA tensors) where `save_state` kept only their
        fingerprints. A checkpoint that holds the module itself (written before) loads it as DeepSpeed does."""
        if not (folder / TAG).is_dir():
            return False
        try:
            with globless(folder) as path:
                self.module.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True,
                                            load_lr_scheduler_states=True,
                                            custom_load_fn=lambda src, dst: load_module(src, dst, folder))
        except WeightsNotTheCheckpoints:  # raised on every rank alike: its own line, nothing to look for
            raise
        except Exception as e:  # DeepSpeed's ZeRORuntimeException is a bare Exception
            if "world size" in str(e):
                raise DeepSpeedConfigError(f"{folder}: {str(e).strip().splitlines()[0]} (its ZeRO optimizer state "
                                           "is split per rank): resume with as many processes as wrote it") from None
            from alignrl.train.checkpoint import CheckpointError, DamagedShard

            # the manifest's sizes match (a same-size overwrite, a bad disk block): name the file DeepSpeed choked on
            found = unreadable(folder / TAG, self.env.rank)
            if found is None:  # every file opens: not damage
                raise
            path, cause = found
            line = (f"cannot read {path} ({cause.splitlines()[0]}); move {folder.parent} out of "
                    f"{folder.parent.parent} to resume from the checkpoint before it, or start fresh with "
                    "trainer.resume_mode=disable")
            if path.name.startswith("mp_rank_"):  # a file every rank reads: rank 0 says it for all
                raise CheckpointError(line) from None
            raise DamagedShard(f"rank {self.env.rank}: {line}") from None
        return True


@contextmanager
def globless(folder: Path) -> Iterator[Path]:
    """`folder`, or where its path has glob characters ([, ], *, ?: a run named "exp[1]"), a link to it under a plain
    temporary name: DeepSpeed finds a checkpoint's model states with glob, which reads them as a pattern and finds
    nothing."""
    if not glob.has_magic(str(folder)):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="alignrl-ds-") as tmp:
        link = Path(tmp) / "checkpoint"
        link.symlink_to(folder.resolve(), target_is_directory=True)
        yield link


def unreadable(folder: Path, rank: int) -> tuple[Path, str] | None:
    """The first of `rank`'s DeepSpeed checkpoint files (its own shards, and the model states every rank reads) that
    torch cannot open, with why; None when all open. Opened mapped: nothing is read but their headers and pickles."""
    mine = sorted(p for p in folder.glob("*.pt") if f"zero_pp_rank_{rank}_" in p.name or p.name.startswith("mp_rank_"))
    for path in mine:
        try:
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as e:  # any damage: a bad pickle, a torn zip
            return path, str(e).strip() or type(e).__name__
    return None


def fingerprints(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Each tensor's dtype, shape and the sum of its bytes read as 16-bit integers (bytes one at a time for 1-byte
    dtypes), which torch sums in int64 without a copy: exact below 2^48 elements, and an integer sum is the same in
    any order, so equal tensors give equal sums on any device and thread count; a tensor a training step moved gives
    another sum unless its changes cancel exactly."""
    out = {}
    for name, tensor in state.items():
        flat = tensor.detach().reshape(-1)
        total = int(flat.view(torch.int16 if flat.element_size() % 2 == 0 else torch.uint8).sum())
        out[name] = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), total)
    return out


class WeightsNotTheCheckpoints(ConfigError):
    """The model a checkpoint's optimizer state is loaded into does not hold the weights it was saved with."""


def load_module(src: dict, dst: torch.nn.Module, folder: Path) -> None:
    """DeepSpeed's `custom_load_fn`: the "module" entry `src` of `folder`'s model states into the model `dst`. An
    entry of fingerprints (`save_state`) loads nothing: `dst` must already hold those weights, else the optimizer
    state would go on from other weights than it was saved with; raised in one line."""
    if set(src) != {WEIGHTS_ELSEWHERE}:
        dst.load_state_dict(src, strict=True)  # the module itself: as DeepSpeed's own load
        return
    saved, held = src[WEIGHTS_ELSEWHERE], fingerprints(dst.state_dict())
    names = sorted(set(saved) | set(held))
    differ = [n for n in names if saved.get(n) != held.get(n)]
    if not differ:
        return
    name = differ[0]
    if name not in held or name not in saved:
        what = f"{name} is {'missing from the model' if name not in held else 'not in the saved model'}"
    elif saved[name][:2] != held[name][:2]:
        what = f"{name} was saved as {saved[name][0]} {list(saved[name][1])}, the model has {held[name][0]} " \
               f"{list(held[name][1])}"
    else:
        what = f"{name} holds other values"
    raise WeightsNotTheCheckpoints(
        f"{folder}: the model does not hold the weights this optimizer state was saved with ({what}; "
        f"{len(differ)} of {len(names)} tensors differ): resume with the model settings that wrote it "
        "(model.path and model.dtype; with LoRA the same base model)")
