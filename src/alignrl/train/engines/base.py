"""What the training engines share (the TrainEngine Protocol itself is in `alignrl.interfaces`): the optimizer
spec, the full optimizer state every local-optimizer engine reads and writes, and the clipped, skip-safe step.

Losses handed to `backward` are already normalised for the *global* batch (token-mean over the global
token count, see `train.minibatch`). Data-parallel backends average gradients over ranks, so each
engine multiplies by the world size first: the summed gradient then equals the one-process gradient
of the same global batch, which is what the cross-backend equivalence tests check.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from alignrl.runtime.env import DistEnv
from alignrl.errors import UserError
from alignrl.train.engines.master import MasterWeights, needs_master
from alignrl.core.optim import build_optimizer

OPTIM_FILE = "optim.pt"  # the full (unsharded) optimizer + scheduler state: resumable by every backend


def state_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """Each state-dict entry's dtype: what an engine that holds the model's own weights saves."""
    return {k: v.dtype for k, v in model.state_dict().items()}


def host_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor],
                    clone: bool = False) -> dict[str, torch.Tensor]:
    """`state` (keyed as `model.state_dict()`) in host memory, where keys that name one tensor of `model` (tied
    input and output embeddings) still share one copy: save_pretrained then writes the tied matrix once, as
    from the model itself, instead of the vocabulary matrix twice. `clone` copies tensors already on the host
    too (weights a gather lends only for the moment)."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        alias[k] = first.setdefault(id(v), k)
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        same = alias.get(k, k)
        if same != k and same in out:
            out[k] = out[same]
            continue
        host = v.detach().cpu()
        out[k] = host.clone() if clone and host.data_ptr() == v.data_ptr() else host
    return out


class TrainingDiverged(UserError):
    """Optimizer steps were skipped as non-finite (see TrainEngine.step) too many times in a row: the run stops
    rather than spin without learning, and saves nothing."""


@dataclass(frozen=True)
class OptimSpec:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 1
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # <= 0 disables clipping
    eps: float = 1e-8

    def build(self, params):
        return build_optimizer(params, self.lr, self.weight_decay, self.betas, self.warmup_steps, self.total_steps,
                               self.schedule, self.min_lr_ratio, self.eps)


def save_full_state(env: DistEnv, folder: Path, model, optimizer, scheduler,
                    master: dict[str, torch.Tensor] | None = None) -> None:
    """Collective. The optimizer state in the full, FQN-keyed form of `torch.distributed.checkpoint`
    (gathered on rank 0 under FSDP2, as is under DDP or one process), so every local-optimizer engine
    reads what any of them wrote; `master`: the fp32 weights of a bf16/fp16 model (the saved model holds
    them rounded), so that a resumed run continues from them."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
    if env.is_main:
        extra = {"master": master} if master is not None else {}
        torch.save({"optimizer": state, "scheduler": scheduler.state_dict(), **extra}, folder / OPTIM_FILE)


def load_full_state(folder: Path, model, optimizer, scheduler) -> dict | None:
    """What save_full_state wrote, restored into `optimizer` and `scheduler`; the file's contents (its fp32
    `master` weights, if any), or None without a file."""
    path = folder / OPTIM_FILE
    if not path.is_file():
        return None
    # our own file written by save_full_state (optimizer tensors); never bytes from a socket
    # mapped, not read: every rank loads the file, and with fp32 master weights it holds a model's worth more
    state = torch.load(path, weights_only=False, map_location="cpu", mmap=True)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    return state


def clip_and_step(params, optimizer, scheduler, grad_clip: float, skip: bool = False) -> tuple[float, bool]:
    """(pre-clip global grad norm, whether the step was taken). A non-finite norm or `skip` drops the
    gradients and leaves the weights, the optimizer state and the lr schedule as they were: one bad batch
    costs one update, where stepping would make every weight NaN. The norm is global (all-reduced
    gradients under DDP, the full tensor under FSDP2), so every rank decides the same."""
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    norm = float(norm)
    if skip or not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    scheduler.step()
    return norm, True


class LazyZeroGrad:
    """Gradients are cleared at the first backward after a step, not in the step, so the last
    mini-batch's (clipped) gradient stays inspectable until the next update."""

    def __init__(self, optimizer):
        self.optimizer, self.pending = optimizer, True

    def before_backward(self) -> None:
        if self.pending:
            self.optimizer.zero_grad(set_to_none=True)
            self.pending = False

    def after_step(self) -> None:
        self.pending = True


class LocalOptimizerEngine:
    """What single, DDP and FSDP2 share: the optimizer runs in this process, over this rank's parameters
    (whole, or FSDP2's shards), and saves the full optimizer state every such engine reads. A subclass wraps
    `model` first, then calls `_build_optimizer`, and adds its own `backward` and `full_state_dict`."""

    env: DistEnv
    model: torch.nn.Module
    parallel_micro_batches = False  # FSDP2 reduces gradients in its backward hooks; LocalEngine decides its own

    def _build_optimizer(self, spec: OptimSpec, master: bool = False) -> None:
        """`master`: the optimizer steps fp32 copies of a bf16/fp16 model's weights (master.py)."""
        self.spec = spec
        self.master = MasterWeights(self.model) if master and needs_master(self.model) else None
        stepped = self.master.shadow if self.master else self.model
        self.params = [p for p in stepped.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = spec.build(self.params)
        self.zero = LazyZeroGrad(self.optimizer)
        self.skipped_steps = 0
        self.applied_lr: float | None = None

    def step(self, skip: bool = False) -> float:
        self.applied_lr = self.scheduler.get_last_lr()[0]  # the scheduler moves on to the next step's in this one
        if self.zero.pending:  # no backward since the last step: no gradient (the kept ones are that step's)
            self.optimizer.zero_grad(set_to_none=True)
        norm, stepped = clip_and_step(self.params, self.optimizer, self.scheduler, self.spec.grad_clip, skip)
        if stepped and self.master:
            self.master.weights_out()
        self.skipped_steps += not stepped
        self.zero.after_step()
        return norm

    def add_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """Adds gradients computed outside `backward` (micro-batches side by side: `runtime.lanes`), one per
        stepped parameter in order, as a backward would have accumulated them."""
        self.zero.before_backward()
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)

    def lr(self) -> float:
        """The learning rate of the latest step (warm-up shows), the first step's before any."""
        return self.scheduler.get_last_lr()[0] if self.applied_lr is None else self.applied_lr

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return state_dtypes(self.model)

    def micro_batch(self, last_micro: bool) -> AbstractContextManager:
        return nullcontext()

    def save_state(self, folder: Path) -> None:
        if self.master:
            save_full_state(self.env, folder, self.master.shadow, self.optimizer, self.scheduler,
                            self.master.state_dict() if self.env.is_main else None)
        else:
            save_full_state(self.env, folder, self.model, self.optimizer, self.scheduler)

    def load_state(self, folder: Path) -> bool:
        state = load_full_state(folder, self.master.shadow if self.master else self.model, self.optimizer,
                                self.scheduler)
        if state is not None and self.master and "master" in state:
            self.master.load_state_dict(state["master"])  # else the copy of the weights loaded as the model
        return state is not None
