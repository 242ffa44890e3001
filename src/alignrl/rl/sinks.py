"""WeightSinks of the placements that live inside the trainer's processes (the ZeroMQ one is
`alignrl.placements.zmq.coordinator`): where the actor's new weights go after each update."""

from __future__ import annotations

from alignrl.runtime.env import DistEnv, barrier
from alignrl.interfaces import RolloutEngine, WeightSink
from alignrl.train.actor import Actor


class SharedModule:
    """Generation runs on the actor's own module: the weights are already there."""

    def publish(self, version: int) -> None:
        pass


class EngineCopy:
    """Collective. The actor's full weights loaded into a rollout engine that holds its own copy: every
    rank's local full copy (FSDP2 / ZeRO-3 shard the policy), or, with `main_only`, a generation server
    that rank 0 updates for everyone. Parameters only, by their unique names (no tied aliases)."""

    def __init__(self, actor: Actor, engine: RolloutEngine, env: DistEnv, main_only: bool = False):
        self.actor, self.engine, self.env, self.main_only = actor, engine, env, main_only

    def publish(self, version: int) -> None:
        full = self.actor.engine.full_state_dict(main_only=self.main_only)
        names = {n for n, _ in self.actor.model.named_parameters()}
        if self.env.is_main or not self.main_only:
            self.engine.load_weights([(k, v) for k, v in full.items() if k in names])
        barrier(self.env)


class Fanout:
    """Several sinks, in order (e.g. a local evaluation copy and the ZeroMQ samplers)."""

    def __init__(self, *sinks: WeightSink):
        self.sinks = sinks

    def publish(self, version: int) -> None:
        for sink in self.sinks:
            sink.publish(version)
