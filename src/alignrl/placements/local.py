"""The trainer's process, placed once at start from the config: the policy and its training engine, the engine
that generates and evaluates (sharing the policy's module, a full copy beside a sharded policy, or a generation
service), the weight sink that keeps it current, the critics, and the in-process producer, or, when `producers`
in other processes make the batches (ZeroMQ samplers, Ray rollout engines), what they supply instead.

The runner gets a `Placed` and never asks which placement it came from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alignrl.config import ConfigError, RunConfig
from alignrl.interfaces import RemoteProducers, RolloutEngine, WeightSink
from alignrl.models.loader import frozen_copy, resolve_model_path, run_tokenizer, with_template_variables
from alignrl.placements.build import (build_actor, build_critics, build_maker, build_ref, check_ref_folder,
                                      load_policy, service_args, shards_weights)
from alignrl.placements.episodes import with_tools
from alignrl.placements.ref_sync import ReferenceMix, reference_mix
from alignrl.placements.sharded_ref import build_sharded_ref, shards_reference, where_reference_lives
from alignrl.rl.producer import RolloutMaker
from alignrl.rl.reference_pairs import refuse_sharded_base
from alignrl.placements.weight_sync import copy_sink
from alignrl.rl.sinks import Fanout, SharedModule
from alignrl.rl.trainer import PolicyTrainer
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rollout.remote import RemoteRolloutEngine
from alignrl.runtime.env import SINGLE, DistEnv
from alignrl.train.critic import Critic
from alignrl.interfaces import TrainEngine
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
    reference_mix: ReferenceMix | None = None  # the reference moved toward the policy (actor.ref_sync_steps)

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
        average = self.trainer.actor.average
        return ([critic.save for _, critic in self.critics() if not isinstance(critic, Critic)]
                + ([self.reference_mix.save] if self.reference_mix is not None else [])
                + ([average.save] if average is not None else []))

    def collected_for_save(self) -> list[Callable[[], None]]:
        """The collectives every rank runs before rank 0's writers of `saved_elsewhere` (the moving average of a
        sharded policy, a moved reference sharded over the ranks: each put together on rank 0)."""
        average = self.trainer.actor.average
        return (([average.collect] if average is not None else [])
                + ([self.reference_mix.collect] if self.reference_mix is not None else []))

    def critics(self) -> list[tuple[str, object]]:
        c = self.trainer.critics
        if c is None:
            return []
        return [("critic", c.critic)] + ([("cost_critic", c.cost_critic)] if c.cost_critic is not None else [])


def place(cfg: RunConfig, policy_path: str, resume: Path | None = None, env: DistEnv = SINGLE,
          producers: RemoteProducers | None = None) -> Placed:
    """The in-process producer and the trainer, or only the trainer when `producers` make the batches in
    other processes (and receive the weights through their sink). Policy from `policy_path`, the frozen
    reference from the base `cfg.model.path`, or from a model of its own, `cfg.model.ref_path`."""
    if resume is not None and cfg.model.lora_rank > 0:  # the base, and the checkpoint's adapters (build_actor)
        policy_path = cfg.model.path
    if producers is None:  # (a Ray actor rank holds no reference: its driver checked the folder)
        check_ref_folder(cfg)  # a wrong reference folder is one line before the policy loads
        return _with_producer(cfg, policy_path, resume, env)
    return _beside_producers(cfg, policy_path, resume, env, producers)


def _with_producer(cfg: RunConfig, policy_path: str, resume: Path | None, env: DistEnv) -> Placed:
    """The trainer and the in-process producer. Generation runs on the policy's own module (nothing to sync), on a
    full copy beside a policy the engine keeps only a shard of (every rank generates; synced after each update), or
    on the generation service (`services.generation_url`, which rank 0 updates for everyone). Beside a sharded policy
    the frozen reference is sharded over the ranks too (`placements.sharded_ref.shards_reference` says when)."""
    folder = resolve_model_path(policy_path, console.print)
    tokenizer = with_template_variables(run_tokenizer(cfg, folder), cfg.data.chat_template_kwargs)
    model, materialize = load_policy(cfg, folder, env, in_shards=False)
    adapters = cfg.model.lora_rank > 0
    # beside a sharded policy the reference is sharded too, each rank reading its own rows (below)
    sharded_ref = shards_reference(cfg, env)
    # the reference is the base model (or model.ref_path's), not a checkpoint; with LoRA, the policy with its
    # adapters off (below) unless model.ref_path names another model
    ref = None if adapters or sharded_ref else build_ref(cfg, env.device,
                                                         model if policy_path == cfg.model.path else None)
    service = cfg.services.generation_url
    # copied before the engine shards the policy
    copy = frozen_copy(model).to(env.device) if shards_weights(cfg, env) and not service else None
    if adapters and shards_weights(cfg, env):
        refuse_sharded_base(cfg)
    actor = build_actor(cfg, model, resume, env, materialize, tokenizer)
    if sharded_ref:  # its forwards are collectives: every rank scores its share of each step once (the producer)
        ref = build_sharded_ref(cfg, env)
    elif adapters:
        ref = build_ref(cfg, env.device, policy=actor.model)
    where = where_reference_lives(cfg, ref, env) if env.distributed and env.is_main else None
    if where:
        console.print(where, markup=False)
    engine = (RemoteRolloutEngine(service, tokenizer, **service_args(cfg)) if service else
              HFRolloutEngine(copy if copy is not None else actor.model, tokenizer))
    engine = with_tools(cfg, engine, tokenizer)  # evaluation rolls out the same way as training
    sink = (copy_sink(actor, engine, env, main_only=bool(service), whole=bool(service))
            if service or copy is not None else SharedModule())
    mix = reference_mix(actor, ref, cfg.actor.ref_sync_steps, cfg.actor.ref_mixup_alpha, resume)
    sink = sink if mix is None else Fanout(sink, mix)
    critics = build_critics(cfg, resume, env)
    maker = build_maker(cfg, engine, tokenizer, ref, env.device, env.rank)
    trainer = PolicyTrainer(cfg, actor, sink, critics, env)
    return Placed(trainer, tokenizer, engine, maker, sink, push_to=service or "", reference_mix=mix)


def _beside_producers(cfg: RunConfig, policy_path: str, resume: Path | None, env: DistEnv,
                      producers: RemoteProducers) -> Placed:
    """Only the trainer: `producers` in other processes make the batches and get the weights through their sink.
    Held-out evaluation runs on the producers' own engines where they offer one (Ray's rollout engines), else on
    rank 0: on the policy's module, or on a full copy beside a sharded policy, which follows the producers'
    weights."""
    if cfg.actor.ref_sync_steps:  # the reference's log-probs come from the producers' processes
        raise ConfigError(f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} moves a reference held in the trainer's "
                          "processes, and this run's reference log-probs are computed where its rollouts are made "
                          "(Ray rollout engines, ZeroMQ samplers): set actor.ref_sync_steps=0")
    folder = resolve_model_path(policy_path, console.print)
    tokenizer = with_template_variables(run_tokenizer(cfg, folder), cfg.data.chat_template_kwargs)
    evaluator = producers.evaluator(tokenizer.pad_token_id)
    sharded = shards_weights(cfg, env)
    # nothing here needs the whole model when the producers evaluate: a sharded policy is built in its shards
    model, materialize = load_policy(cfg, folder, env, in_shards=evaluator is not None and sharded)
    own_copy = sharded and evaluator is None
    copy = frozen_copy(model).to(env.device) if own_copy and env.is_main else None
    actor = build_actor(cfg, model, resume, env, materialize, tokenizer)
    engine = evaluator if evaluator is not None else HFRolloutEngine(copy if copy is not None else actor.model,
                                                                     tokenizer)
    engine = with_tools(cfg, engine, tokenizer)
    sink = producers.sink(actor, env)
    if own_copy:  # the gather is collective: every rank takes part, rank 0 alone loads
        sink = Fanout(copy_sink(actor, engine, env, main_only=True), sink)
    critics = producers.critics(cfg, resume, env)
    trainer = PolicyTrainer(cfg, actor, sink, critics, env)
    return Placed(trainer, tokenizer, engine, None, sink, remote_eval=evaluator is not None)
