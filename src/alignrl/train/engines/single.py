"""One process, and DDP: every rank holds the whole model and the ranks average their gradients once a step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from alignrl.models.loader import draws_dropout
from alignrl.runtime.env import DistEnv
from alignrl.train.engines.base import LocalOptimizerEngine, OptimSpec, host_state_dict
from alignrl.train.engines.master import needs_master


class LocalEngine(LocalOptimizerEngine):
    """`single` (world size 1) or `ddp` (every rank holds the full model, gradients are averaged over ranks once
    per optimizer step). Optimizer state is identical on every rank, so rank 0's copy is the full state any
    backend can resume from. A bf16/fp16 model is stepped through fp32 master weights, whose fp32 gradient sums
    the ranks average themselves (master.py); an fp32 model's through torch DistributedDataParallel."""

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, env: DistEnv, ddp: bool):
        self.name = "ddp" if ddp else "single"
        self.whole_weights = True
        self.model, self.env = model.to(env.device), env
        self.module = model
        self.reduce_master = ddp and env.distributed and needs_master(model)
        if self.reduce_master:  # every rank starts from rank 0's weights, as DDP's constructor makes them
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t, 0)
        elif ddp and env.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda"
                                                  else None)
        self._build_optimizer(spec, master=True)
        # one process stepping the model's own parameters: gradients taken elsewhere may be added as they are; not
        # for a model that draws dropout masks, whose order of draws from one generator would follow the threads'
        self.parallel_micro_batches = not env.distributed and self.master is None and not draws_dropout(model)

    def micro_batch(self, last_micro: bool) -> AbstractContextManager:
        # accumulate locally; the last micro-batch's backward all-reduces the sum once
        return nullcontext() if last_micro or self.module is self.model else self.module.no_sync()

    def backward(self, loss: torch.Tensor, last_micro: bool = True) -> None:
        self.zero.before_backward()
        (loss * self.env.world_size).backward()  # the ranks' mean below (or DDP's); the loss is already global
        if last_micro and self.reduce_master:  # the master copy's hooks have summed this rank's in fp32
            self.master.average_over_ranks(self.env.world_size)

    def full_state_dict(self, main_only: bool = False) -> dict[str, torch.Tensor]:
        if main_only and not self.env.is_main:
            return {}
        return host_state_dict(self.model, self.model.state_dict())
