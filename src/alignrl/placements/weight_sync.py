"""What a weight sink sends of the trained policy, and the in-process copy's sink for a policy with LoRA adapters or
frozen parameters.

Rollout engines hold a plain model: they receive the plain model's names, LoRA adapters merged into the layers they
wrap (`models.lora.merge_state`). The first publish of a sink sends every parameter (engines start from the base,
and a resumed run's weights come from its checkpoint); later ones send only what a step can change: with LoRA the
merged layers, with actor.freeze_prefix the parameters not frozen. Without either, every publish sends everything,
as before.
"""

from __future__ import annotations

import torch

from alignrl.interfaces import RolloutEngine, WeightSink
from alignrl.models import lora
from alignrl.rl.sinks import EngineCopy
from alignrl.runtime.env import DistEnv, barrier
from alignrl.train.actor import Actor


class Outgoing:
    """The names and merged tensors a sink sends of `model` (the actor's, wrapped or not), publish by publish."""

    def __init__(self, model: torch.nn.Module, partial_ok: bool = True):
        """`partial_ok`: the receiver takes updates of some parameters (False: a generation service, which
        wants every parameter in each update)."""
        self.model = model
        self.all = lora.plain_names(model)
        self.changing = lora.changing_names(model) if partial_ok else self.all
        self.sent = False

    def names(self) -> list[str]:
        """This publish's names: all of them the first time, then those that can change."""
        names = self.changing if self.sent else self.all
        self.sent = True
        return names

    def partial(self, names: list[str]) -> bool:
        return len(names) != len(self.all)

    def tensors(self, state: dict[str, torch.Tensor], names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """(plain name, tensor) for `names`, out of the wrapped model's `state` (its own or a gathered full one)."""
        return lora.outgoing(self.model, state, names)


class MergedCopy:
    """EngineCopy for a policy with adapters or frozen parameters: collective; the full weights gathered, the
    adapters merged, and only the changing parameters loaded after the first publish (a generation service gets
    them all: it refuses partial updates)."""

    def __init__(self, actor: Actor, engine: RolloutEngine, env: DistEnv, main_only: bool = False,
                 whole: bool = False):
        self.actor, self.engine, self.env, self.main_only = actor, engine, env, main_only
        self.out = Outgoing(actor.model, partial_ok=not whole)

    def publish(self, version: int) -> None:
        full = self.actor.engine.full_state_dict(main_only=self.main_only)
        names = self.out.names()
        if self.env.is_main or not self.main_only:
            self.engine.load_weights(self.out.tensors(full, names))
        barrier(self.env)


def copy_sink(actor: Actor, engine: RolloutEngine, env: DistEnv, main_only: bool = False,
              whole: bool = False) -> WeightSink:
    """The sink that keeps an engine's own copy (a full copy beside a sharded policy, a generation service) current.
    `whole`: the engine takes only updates of every parameter (a generation service)."""
    if lora.has_adapters(actor.model) or any(not p.requires_grad for p in actor.model.parameters()):
        return MergedCopy(actor, engine, env, main_only, whole)
    return EngineCopy(actor, engine, env, main_only)
