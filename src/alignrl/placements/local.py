"""The trainer's process, placed once at start from the config: the policy and its training engine, the engine
that generates and evaluates (sharing the policy's module, a full copy beside a sharded policy, or a generation
service), the weight sink that keeps it current, the critics, and the in-process producer, or, when `producers`
in other processes make the batches (ZeroMQ samplers, Ray rollout engines), what they supply instead.

The runner gets a `Placed` and never asks which placement it came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alignrl.config import RunConfig
from alignrl.interfaces import RemoteProducers, RolloutEngine, WeightSink
from alignrl.models.loader import frozen_copy, load_tokenizer, resolve_model_path
from alignrl.placements.build import (build_actor, build_critics, build_maker, build_ref, load_policy, service_args,
                                      shards_weights, with_tools)
from alignrl.rl.producer import RolloutMaker
from alignrl.rl.sinks import EngineCopy, Fanout, SharedModule
from alignrl.rl.trainer import PolicyTrainer
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rollout.remote import RemoteRolloutEngine
from alignrl.runtime.env import SINGLE, DistEnv
from alignrl.train.critic import Critic
from alignrl.train.engines import TrainEngine
from alignrl.utils.tracking import console


@dataclass
class Placed:
    """The trainer process's parts: the trainer, and what the runner around it needs."""

    trainer: PolicyTrainer
    tokenizer: object
    eval_engine: RolloutEngine  # greedy held-out evaluation on rank 0 (full weights)
    maker: RolloutMaker | None  # the in-process producer; None when samplers produce elsewhere
    sink: WeightSink
    remote_eval: bool = False  # eval_engine is the producers' (Ray's rollout engines), fed through `sink`
    push_to: str = ""  # the generation service the sink feeds, which may hold other weights than ours

    def before_first_step(self, version: int, resumed_at_end: bool) -> None:
        """The weights engines outside the trainer must hold before the loop starts (collective on every rank)."""
        if self.remote_eval and resumed_at_end:  # no step publishes, and the engines that evaluate hold the base
            self.sink.publish(version)
        if self.push_to:  # a fresh server, a resumed run: send ours
            self.sink.publish(version)
            console.print(f"generation service {self.push_to}: weights pushed")

    def engines(self) -> dict[str, TrainEngine]:
        """Checkpoint folder name -> the engines trained in this process: `model` (the policy), `critic`,
        `cost_critic` (unless they train in workers of their own)."""
        out = {"model": self.trainer.actor.engine}
        for name, critic in self.critics():
            if isinstance(critic, Critic):
                out[name] = critic.engine
        return out

    def saved_elsewhere(self) -> list[Callable[[Path], str | None]]:
        """The writers of the checkpoint parts held by other workers (a Ray critic group): each writes its
        folders into the checkpoint being written and returns None, or the line saying why it could not."""
        return [critic.save for _, critic in self.critics() if not isinstance(critic, Critic)]

    def critics(self) -> list[tuple[str, object]]:
        c = self.trainer.critics
        if c is None:
            return []
        return [("critic", c.critic)] + ([("cost_critic", c.cost_critic)] if c.cost_critic is not None else [])


def place(cfg: RunConfig, policy_path: str, resume: Path | None = None, env: DistEnv = SINGLE,
          producers: RemoteProducers | None = None) -> Placed:
    """The in-process producer and the trainer, or only the trainer when `producers` make the batches in
    other processes (and receive the weights through their sink). Policy from `policy_path`, the frozen
    reference from the base `cfg.model.path`."""
    folder = resolve_model_path(policy_path, console.print)
    tokenizer = load_tokenizer(folder)
    inline = producers is None
    # the held-out evaluation on the producers' own engines where they offer it (Ray's rollout engines)
    evaluator = producers.evaluator(tokenizer.pad_token_id) if producers is not None else None
    # nothing here then needs the whole model: a sharded policy is built in its shards
    sharded = shards_weights(cfg, env)
    model, materialize = load_policy(cfg, folder, env, evaluator is not None and sharded)
    # the reference is the base model, not a checkpoint
    ref = build_ref(cfg, env.device, model if policy_path == cfg.model.path else None) if inline else None
    remote = bool(cfg.services.generation_url) and inline
    # a full copy for generation / evaluation when the engine keeps only a shard (copied before sharding): on
    # every rank that generates (all of them in-process, rank 0 alone for its evaluation beside producers)
    own_copy = sharded and not remote and evaluator is None
    copy = frozen_copy(model).to(env.device) if own_copy and (inline or env.is_main) else None
    actor = build_actor(cfg, model, resume, env, materialize)
    if evaluator is not None:
        engine = evaluator
    elif remote:
        engine = RemoteRolloutEngine(cfg.services.generation_url, tokenizer, **service_args(cfg))
    else:  # colocated: generation shares the policy's weights unless the engine keeps only a shard of them
        engine = HFRolloutEngine(copy if copy is not None else actor.model, tokenizer)
    engine = with_tools(cfg, engine, tokenizer)  # evaluation rolls out the same way as training
    if producers is not None:  # rank 0's evaluation copy (sharded engines) follows the samplers' weights
        sink = producers.sink(actor, env)
        if own_copy:  # the gather is collective: every rank takes part, rank 0 alone loads
            sink = Fanout(EngineCopy(actor, engine, env, main_only=True), sink)
        critics = producers.critics(cfg, resume, env)
    else:
        colocated = not remote and copy is None
        sink = SharedModule() if colocated else EngineCopy(actor, engine, env, main_only=remote)
        critics = build_critics(cfg, resume, env)
    maker = build_maker(cfg, engine, tokenizer, ref, env.device, env.rank) if inline else None
    trainer = PolicyTrainer(cfg, actor, sink, critics, env)
    return Placed(trainer, tokenizer, engine, maker, sink, remote_eval=evaluator is not None,
                  push_to=cfg.services.generation_url if remote else "")
