"""FSDP2: torch `fully_shard` on each transformer block and the root. Parameters, gradients and
optimizer state are sharded over ranks; forward all-gathers a block at a time.

The optimizer state is saved and loaded in the full, FQN-keyed form of
`torch.distributed.checkpoint.state_dict`, the same form the local engines write, so checkpoints move
between single / ddp / fsdp2 in both directions. Left out: HSDP, CPU offload of parameters, TP.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from alignrl.errors import UserError
from alignrl.runtime.env import DistEnv
from alignrl.train.engines.base import (LocalOptimizerEngine, OptimSpec, host_state_dict, load_full_state,
                                        save_full_state, state_dtypes)
from alignrl.train.engines.master import LOW


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (HF names their classes in `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_blocks(model: torch.nn.Module, env: DistEnv, **options) -> None:
    """`fully_shard` on each transformer block, then the root, over all of `env`'s ranks. It moves the weights
    to the ranks' device block by block and keeps only this rank's shard: the whole model never sits on one GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    # torch warns, on every rank, when a sharded module's output is a view (a token-classification head's logits are
    # one) that an in-place op on it would skip the backward's all-gather; alignrl's log-prob and value code reads
    # outputs out of place only, so the warning is noise in every critic run
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


class FSDP2Engine(LocalOptimizerEngine):
    name = "fsdp2"
    whole_weights = False

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, env: DistEnv, param_dtype: torch.dtype | None = None,
                 materialize: Callable[[torch.nn.Module], None] | None = None):
        """`materialize`: for a model built on the meta device, gives its shards memory and weights once it is sharded
        (`models.sharded_load.fill_shards`): no rank then holds the whole model, in fp32 or at all."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not env.distributed:
            raise UserError("the fsdp2 strategy shards the model over several processes: launch with torchrun "
                            "--nproc_per_node=N or `alignrl ... --nproc N`, or use the single strategy "
                            "(trainer.strategy=single; strategy=single for alignrl train rm|dpo|sft)")
        self.env = env
        # a bf16/fp16 model keeps fp32 sharded weights for the optimizer and computes in its own dtype
        # (master.py says why); each weight leaves the engine (published, saved) in its own dtype again
        self.dtypes = state_dtypes(model)
        low = next((p.dtype for p in model.parameters() if p.requires_grad and p.dtype in LOW), None)
        self.upcast = low is not None
        if self.upcast:
            model.float()
            param_dtype = param_dtype or low
        # bf16 compute with fp32 gradient reduction where asked; fp32 everywhere by default (CPU)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        shard_blocks(model, env, mp_policy=mp)
        self.born_partitioned = materialize is not None
        if materialize is not None:
            materialize(model)
        self.model = self.module = model
        self._build_optimizer(spec)

    def backward(self, loss: torch.Tensor, last_micro: bool = True) -> None:
        self.zero.before_backward()
        (loss * self.env.world_size).backward()  # reduce-scatter averages over ranks

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        return dict(self.dtypes)

    def full_state_dict(self, main_only: bool = False) -> dict[str, torch.Tensor]:
        if not self.upcast:
            # cpu_offload with full_state_dict: rank 0 alone gathers into host memory, the others get {}
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                            cpu_offload=main_only))
            return host_state_dict(self.model, sd)
        # one fp32 weight gathered at a time (a collective on every rank) and cast to its own dtype, never the
        # whole model in fp32
        keep = self.env.is_main or not main_only
        out = {}
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if keep:
                out[k] = full.detach().to(self.dtypes[k]).cpu()
        return host_state_dict(self.model, out) if keep else {}

    def save_state(self, folder: Path) -> None:
        if not self.upcast:
            return super().save_state(folder)
        master = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        save_full_state(self.env, folder, self.model, self.optimizer, self.scheduler, master if self.env.is_main
                        else None)

    def load_state(self, folder: Path) -> bool:
        state = load_full_state(folder, self.model, self.optimizer, self.scheduler)
        if state is not None and self.upcast and "master" in state:
            set_model_state_dict(self.model, state["master"], options=StateDictOptions(full_state_dict=True))
        return state is not None
