"""Training backends behind one interface (`alignrl.interfaces.TrainEngine`): single, ddp, fsdp2, deepspeed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from alignrl.runtime.env import DistEnv
from alignrl.interfaces import TrainEngine
from alignrl.train.engines.base import OptimSpec

__all__ = ["STRATEGIES", "OptimSpec", "TrainEngine", "build_engine"]

STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed")


def build_engine(strategy: str, model: torch.nn.Module, spec: OptimSpec, env: DistEnv, *, zero_stage: int = 2,
                 offload: bool = False, deepspeed_config: str | None = None, bf16: bool = False,
                 materialize: Callable[[torch.nn.Module], None] | None = None) -> TrainEngine:
    """`strategy` single/ddp run the same code (under ddp the ranks average gradients: torch DDP for an fp32
    model, the fp32 master copy's own all-reduce for a bf16/fp16 one). `materialize`: FSDP2's, for a model on the
    meta device (FSDP2Engine)."""
    if strategy in ("single", "ddp"):
        from alignrl.train.engines.single import LocalEngine

        return LocalEngine(model, spec, env, ddp=strategy == "ddp")
    if strategy == "fsdp2":
        from alignrl.train.engines.fsdp2 import FSDP2Engine

        return FSDP2Engine(model, spec, env, param_dtype=torch.bfloat16 if bf16 else None, materialize=materialize)
    if strategy == "deepspeed":
        from alignrl.train.engines.deepspeed import DeepSpeedEngine, engine_config

        cfg = engine_config(deepspeed_config, zero_stage, offload, spec.grad_clip, bf16, env.world_size)
        return DeepSpeedEngine(model, spec, env, cfg)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
