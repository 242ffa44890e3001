"""The parts every placement builds from a config: the training engines of actor and critics, the frozen
reference (a local copy or the reference service), the reward stage (rules, a reward model or the reward
service), the multi-turn tools, and the producer (`build_maker`). The in-process trainer (`placements.local`),
a ZeroMQ sampler and a Ray rollout engine all build their producer with `build_maker`, so each makes exactly the
batches the in-process loop would.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from alignrl.rl.producer import LocalRefScorer, RolloutMaker
from alignrl.rl.reference_pairs import reference_answers
from alignrl.placements.episodes import run_tool_schemas
from alignrl.preference.rm import check_rl_scorers
from alignrl.rl.scoring import RewardComponents, RewardStage
from alignrl.rl.trainer import CriticParts
from alignrl.config import RunConfig
from alignrl.config.checks import needs_reference, response_cap
from alignrl.core.lagrangian import LagrangeMultiplier
from alignrl.runtime.env import SINGLE, DistEnv
from alignrl.interfaces import RefScorer, RolloutEngine, SequenceScorer, TrainEngine
from alignrl.models import lora
from alignrl.data.pretrain_text import load_pretrain_texts
from alignrl.data.prompts import PromptData, load_task_data
from alignrl.models.loader import (DTYPES, frozen_copy, load_causal_lm, load_model, recompute_activations,
                                   with_template_variables)
from alignrl.models.logprobs import ForwardLayout
from alignrl.models.sharded_load import fill_shards, meta_model
from alignrl.models.rm_template import RetemplatingScorer, reward_input
from alignrl.models.quantized import FourBit, prepare_for_adapters
from alignrl.models.value import ModelScorer, load_value_model, score_normalization
from alignrl.rewards.registry import run_rule, with_format_bonus
from alignrl.rewards.timed_rules import timed
from alignrl.train.ema import PolicyAverage
from alignrl.rollout.remote import RemoteRefScorer
from alignrl.rollout.remote_reward import RemoteReward
from alignrl.train.actor import Actor
from alignrl.train.critic import Critic
from alignrl.train.engines import OptimSpec, build_engine
from alignrl.train.engines.deepspeed import engine_config, partitioned_init
from alignrl.train.ptx import PretrainMix
from alignrl.utils.tracking import console


def resolve_strategy(cfg: RunConfig, env: DistEnv) -> str:
    s = cfg.trainer.strategy
    if s in ("auto", "fsdp"):  # fsdp: as verl's FSDP over one rank, which shards nothing
        return ("fsdp2" if s == "fsdp" else "ddp") if env.distributed else "single"
    return s


def make_engine(cfg: RunConfig, model, spec: OptimSpec, env: DistEnv, materialize: Callable | None = None
                ) -> TrainEngine:
    t = cfg.trainer
    return build_engine(resolve_strategy(cfg, env), model, spec, env, zero_stage=t.zero_stage, offload=t.offload,
                        deepspeed_config=t.deepspeed_config or None, bf16=cfg.model.dtype == "bfloat16",
                        materialize=materialize)


def ds_settings(cfg: RunConfig, env: DistEnv) -> dict:
    """The DeepSpeed config `make_engine` gives the policy's engine."""
    t = cfg.trainer
    return engine_config(t.deepspeed_config or None, t.zero_stage, t.offload, cfg.actor.grad_clip,
                         cfg.model.dtype == "bfloat16", env.world_size)


def shards_weights(cfg: RunConfig, env: DistEnv) -> bool:
    """Whether the training engine keeps only a shard of the weights on each rank (then generation and
    evaluation run on a full copy, synced after every step)."""
    strategy = resolve_strategy(cfg, env)
    if strategy != "deepspeed":
        return strategy == "fsdp2"
    from alignrl.train.engines.deepspeed import zero_stage

    return zero_stage(cfg.trainer.deepspeed_config, cfg.trainer.zero_stage) == 3  # a JSON file's stage decides


def total_optimizer_steps(cfg: RunConfig) -> int:
    return cfg.trainer.total_training_steps * cfg.actor.ppo_epochs * cfg.mini_batches_per_step


def restore_state(engine: TrainEngine, folder: Path, name: str) -> None:
    if not engine.load_state(folder):
        console.print(f"[yellow]{folder.parent.name}: no {name} optimizer state this backend "
                      f"({engine.name}) can read; continuing from the saved weights with a fresh optimizer[/yellow]")


def service_args(cfg: RunConfig) -> dict:
    return {"timeout": cfg.services.timeout_s, "retries": cfg.services.retries,
            "api_key": os.environ.get("ALIGNRL_API_KEY")}


def ref_folder(cfg: RunConfig) -> str:
    """The reference's model folder: model.ref_path, a model of its own, else the base policy model.path."""
    return cfg.model.ref_path or cfg.model.path


def check_ref_folder(cfg: RunConfig) -> None:
    """model.ref_path is a model folder whose tokenizer reads token ids as the policy's does (its log-probs are of
    the policy's sampled tokens): ModelError otherwise, one line, before any weights load. Nothing to check when no
    KL term reads a reference."""
    if not cfg.model.ref_path or not needs_reference(cfg):
        return
    from alignrl.models.loader import SCORE_INFO, ModelError, load_tokenizer, resolve_model_path

    quiet = lambda *_: None  # noqa: E731
    folder = resolve_model_path(cfg.model.ref_path, quiet, "model.ref_path")
    if (Path(folder) / SCORE_INFO).is_file():  # a sharded load would not look (load_causal_lm does)
        raise ModelError(f"model.ref_path={cfg.model.ref_path} is a reward or cost model saved by `alignrl train rm` "
                         f"({SCORE_INFO}): it scores text and has no language-model head; give a causal LM")
    theirs = load_tokenizer(folder, chat=False)
    ours = load_tokenizer(resolve_model_path(cfg.model.path, quiet), chat=False)
    if len(theirs) != len(ours) or theirs.get_vocab() != ours.get_vocab():
        raise ModelError(f"model.ref_path={cfg.model.ref_path}: its tokenizer is not the policy's ({len(theirs)} "
                         f"tokens against {len(ours)} of model.path, or other ids); the reference scores the "
                         "policy's token ids, so give it a model of the same tokenizer")


def build_ref(cfg: RunConfig, device: torch.device, base=None, policy=None) -> RefScorer | None:
    """The reference service when configured, else model.ref_path's model when set (LoRA or not: a model of its
    own), else the base model: the trained `policy` itself with its LoRA adapters switched off when it has them (no
    second copy), else a frozen copy of `base` when the caller already loaded model.path (in model.dtype), else
    loaded here. None when no KL term needs it."""
    if not needs_reference(cfg):
        return None
    if cfg.services.reference_url:
        return RemoteRefScorer(cfg.services.reference_url, temperature=cfg.logprob_temperature, **service_args(cfg))
    loaded = None  # a model loaded here for the reference alone is frozen in place: no second host copy of it
    if cfg.model.ref_path:  # neither the caller's base nor the policy: another model
        check_ref_folder(cfg)
        loaded = load_model(cfg.model.ref_path, cfg.model.dtype, chat=False, key="model.ref_path")[0]
    elif policy is not None and lora.has_adapters(policy):
        return lora.AdaptersOffScorer(LocalRefScorer(policy, cfg.logprob_temperature, cfg.actor.forward_micro_batch,
                                                     forward_layout(cfg)), policy)
    elif base is None:
        loaded = load_model(cfg.model.path, cfg.model.dtype, chat=False)[0]
    ref = frozen_copy(base) if loaded is None else loaded.eval().requires_grad_(False)
    return LocalRefScorer(ref.to(device), cfg.logprob_temperature, cfg.actor.forward_micro_batch, forward_layout(cfg))


def reward_scorer(cfg: RunConfig, tokenizer, device: torch.device, loaded: SequenceScorer | None = None
                  ) -> SequenceScorer | None:
    """The reward model's scorer of the policy's rows: the reward service, else algorithm.reward_model (`loaded`
    when it is loaded elsewhere: a Ray reward group), through its own chat template when its tokenizer is not the
    policy's (`models.rm_template`)."""
    a = cfg.algorithm
    if cfg.services.reward_url:
        return RemoteReward(cfg.services.reward_url, tokenizer=tokenizer, messages=a.reward_model_retemplate,
                            **service_args(cfg))
    if not a.reward_model or loaded is not None and not a.reward_model_retemplate:
        return loaded  # a reward group's ids path: its workers checked and loaded the folder
    # decided before the weights load: a vocabulary the model cannot read is one line, not a load later
    template = reward_input(tokenizer, Path(a.reward_model), a.reward_model_retemplate,
                            a.reward_model_max_length or cfg.data.max_prompt_length + response_cap(cfg))
    scorer = loaded or ModelScorer(a.reward_model, cfg.model.dtype, log=console.print, device=device,
                                   normalize=a.reward_model_normalize)
    return scorer if template is None else RetemplatingScorer(scorer, tokenizer, template, console.print)


def build_rewards(cfg: RunConfig, tokenizer, device: torch.device, loaded: SequenceScorer | None = None
                  ) -> RewardStage:
    """The reward stage; `loaded`: the reward model's scorer when it lives elsewhere (`reward_scorer`)."""
    a, s = cfg.algorithm, cfg.safety
    # before they load: a swapped pair trains with no error (the CLI checked before the policy); a reward model loaded
    # elsewhere was checked where it loads
    check_rl_scorers(cfg if loaded is None else replace(cfg, algorithm=replace(a, reward_model="")))
    reward_model = reward_scorer(cfg, tokenizer, device, loaded)
    # loaded once: the reward is the correctness itself unless a format bonus shapes it, and the stage then scores
    # each row once (a code row's program runs once, a batch function is called once)
    correct = timed_rule(cfg, "reward")  # under algorithm.reward_timeout_s in workers, or the rule itself
    return RewardStage(tokenizer, with_format_bonus(correct, a.format_reward_weight), correct,
                       response_cap(cfg), a.overlong_buffer_len, a.overlong_penalty_factor, reward_model,
                       model_mix=a.reward_model_mix, model_weight=a.reward_model_weight,
                       truncated_reward_coef=a.truncated_reward_coef, missing_eos_penalty=a.missing_eos_penalty,
                       normalize_each=a.multi_objective_aggregation == "normalize_then_sum",
                       components=RewardComponents(tuple(a.gdpo_reward_keys), tuple(a.gdpo_reward_weights),
                                                   a.norm_adv_by_std_in_grpo) if a.adv_estimator == "gdpo" else None,
                       cost_fn=timed_rule(cfg, "cost") if s.cost_fn else None,
                       cost_model=ModelScorer(s.cost_model, cfg.model.dtype, log=console.print, device=device)
                       if s.cost_model else None)


def timed_rule(cfg: RunConfig, which: str):
    """run_rule's rule scored under algorithm.reward_timeout_s (`rewards.timed_rules`), or the rule itself without a
    limit. A cost past the limit stops the run with one line: scored 0 it would read as safe."""
    a = cfg.algorithm
    return timed(run_rule(cfg, which), functools.partial(run_rule, cfg, which), a.reward_timeout_s,
                 a.reward_workers, give_up=which != "cost")


def producer_prompts(cfg: RunConfig, tokenizer) -> tuple[list, PromptData]:
    """A producer's training rows (a ZeroMQ sampler, a Ray rollout worker) and their prompts, templated as the
    trainer templates its own: with the run's chat-template variables (data.chat_template_kwargs, bound to
    `tokenizer` here, for the tool turns too) and verl's tool schemas."""
    with_template_variables(tokenizer, cfg.data.chat_template_kwargs)
    tools = run_tool_schemas(cfg)
    train = load_task_data(cfg, tokenizer, tools)[0]
    return train, PromptData(tokenizer, train, cfg.data.max_prompt_length, cfg.data.truncation, tools)


def build_maker(cfg: RunConfig, engine: RolloutEngine, tokenizer, ref: RefScorer | None, device: torch.device,
                seed_rank: int, reward_model: SequenceScorer | None = None) -> RolloutMaker:
    """The producer of every placement: `engine` (already with its tools: `placements.episodes.with_tools`; paired
    with the reference's own answers under XPO), the reward stage and the reference. `seed_rank` decorrelates the
    samples of producers that share a step; `reward_model`: a scorer that lives elsewhere (a Ray reward group), in
    place of the one `cfg` would load here."""
    engine = reference_answers(cfg, engine, ref, tokenizer)
    return RolloutMaker(cfg, engine, build_rewards(cfg, tokenizer, device, reward_model), ref, seed_rank)


def build_critic(cfg: RunConfig, name: str, resume: Path | None, env: DistEnv = SINGLE) -> Critic:
    """The critic `name` ("critic", or "cost_critic" seeded one apart); from the checkpoint's `<name>/`
    folder and its optimizer state when resuming."""
    c = cfg.critic
    adapters = cfg.model.lora_rank > 0  # resumed from the base and the checkpoint's trained tensors
    path = str(resume / name) if resume and not adapters else (c.model_path or cfg.model.path)
    seed = cfg.trainer.seed + (name == "cost_critic")
    four_bit = FourBit.of(cfg.model) if cfg.model.load_in_4bit else None  # QLoRA quantizes the critics too
    model = load_value_model(path, cfg.model.dtype, seed, console.print, four_bit, env.device)
    if adapters:
        model = with_adapters(cfg, model, resume / f"{name}_state" if resume else None, value_model=True)
    spec = OptimSpec(lr=c.lr, weight_decay=c.weight_decay, betas=tuple(c.betas), warmup_steps=c.lr_warmup_steps,
                     total_steps=total_optimizer_steps(cfg), schedule=c.lr_scheduler, min_lr_ratio=c.min_lr_ratio,
                     grad_clip=c.grad_clip)
    engine = make_engine(cfg, model, spec, env)
    if resume:
        restore_state(engine, resume / f"{name}_state", name)
    # the reward's critic normalizes as the reward model does (a cost critic's scale is the cost model's, not it)
    scale = (score_normalization(model.config, path, console.print, "critic")
             if cfg.algorithm.reward_model_normalize and name == "critic" else (0.0, 1.0))
    return Critic(engine, cliprange_value=c.cliprange_value or None, name=name, remove_padding=c.use_remove_padding,
                  lanes=cfg.trainer.cpu_lanes, normalization=scale)


def critic_names(cfg: RunConfig) -> list[str]:
    """The value models the run trains: none, the critic, or (with a safety cost) the cost critic too."""
    if not cfg.critic.enable:
        return []
    return ["critic", "cost_critic"] if cfg.safety.cost_fn or cfg.safety.cost_model else ["critic"]


def build_critics(cfg: RunConfig, resume: Path | None, env: DistEnv = SINGLE,
                  make: Callable[[str], object] | None = None) -> CriticParts | None:
    """The critic (and, with a safety cost, the cost critic and multiplier), trained in this process, or
    made by `make(name)` where they train elsewhere (a Ray critic group); the multiplier stays here."""
    names = critic_names(cfg)
    if not names:
        return None
    make = make or (lambda name: build_critic(cfg, name, resume, env))
    parts = CriticParts(critic=make("critic"))
    if "cost_critic" in names:
        s = cfg.safety
        parts.cost_critic = make("cost_critic")
        parts.lagrangian = LagrangeMultiplier(s.lambda_init, s.lambda_lr, s.cost_limit, s.lambda_max,
                                              s.lambda_update_delay_steps, s.episode_cost_window_size)
    return parts


def forward_layout(cfg: RunConfig) -> ForwardLayout:
    """How the policy's and the reference's forwards lay out a micro-batch (actor.share_prompt, use_remove_padding)
    and how many run side by side on a CPU (trainer.cpu_lanes)."""
    return ForwardLayout(cfg.actor.share_prompt, cfg.actor.use_remove_padding, cfg.trainer.cpu_lanes)


def load_policy(cfg: RunConfig, folder: Path, env: DistEnv, in_shards: bool) -> tuple[torch.nn.Module, Callable | None]:
    """The policy of `folder`, and FSDP2's `materialize` for it. `in_shards` (nothing in this process needs the whole
    model): a ZeRO-3 policy is built in its partitions as it loads (deepspeed.zero.Init), an FSDP2 one on the meta
    device, its shards then reading their own rows of the weights; no rank holds the whole model at any time."""
    strategy = resolve_strategy(cfg, env)
    if cfg.model.load_in_4bit:  # QLoRA: each rank quantizes the whole base onto its device (4-bit does not shard)
        model = load_causal_lm(folder, cfg.model.dtype, four_bit=FourBit.of(cfg.model), device=env.device)
        console.print(f"policy: base quantized to 4-bit {cfg.model.bnb_4bit_quant_type.upper()} on {env.device} "
                      "(model.load_in_4bit); LoRA adapters train on it")
        return prepare_for_adapters(model), None  # build_actor recomputes activations (actor.gradient_checkpointing)
    in_shards = in_shards and cfg.model.lora_rank == 0  # adapters go on the whole model, before an engine shards it
    if in_shards and strategy == "fsdp2":
        model = meta_model(folder, DTYPES[cfg.model.dtype])
        if model is not None:
            console.print(f"policy: built in FSDP2 shards over {env.world_size} ranks, each reading its own rows")
            return model, lambda m: fill_shards(m, folder, env.device)
    in_shards = in_shards and strategy == "deepspeed"
    with partitioned_init(ds_settings(cfg, env), env) if in_shards else nullcontext():
        model = load_causal_lm(folder, cfg.model.dtype)
    if in_shards:
        console.print(f"policy: built in ZeRO-3 partitions over {env.world_size} ranks as it loads")
    return model, None


def lora_of(cfg: RunConfig) -> lora.LoraSpec:
    m = cfg.model
    return lora.lora_spec(m.lora_rank, m.lora_alpha, m.lora_dropout, m.target_modules)


def with_adapters(cfg: RunConfig, model, state: Path | None, value_model: bool = False):
    """`model` with LoRA adapters (model.lora_rank > 0): only they train, and a value model's new head, whole.
    `state`: a checkpoint's `<name>_state` folder, whose trained tensors are loaded (exact resume)."""
    head = []
    if value_model:  # the head is not part of the pretrained backbone: it trains whole, without an adapter
        prefix = getattr(model, "base_model_prefix", "model") + "."
        head = [n for n, _ in model.named_parameters() if not n.startswith(prefix)]
    with torch.random.fork_rng(devices=[]):  # the adapters' initial values depend on the seed alone
        torch.manual_seed(cfg.trainer.seed)
        model = lora.add_adapters(model, lora_of(cfg), task=None if value_model else "CAUSAL_LM",
                                  exclude=tuple(sorted({n.rsplit(".", 1)[0] for n in head})))
    for name, p in lora.unwrapped(model).named_parameters():
        if lora.plain_name(name) in head:
            p.requires_grad_(True)
    if not value_model or cfg.model.load_in_4bit:  # a critic is written merged, unless its base is 4-bit codes
        lora.set_export(model, cfg.model.lora_export)
    if state is not None and not lora.load_trained(model, state):
        from alignrl.train.checkpoint import CheckpointError

        raise CheckpointError(f"{state} has no {lora.TRAINED_FILE}: it was written without LoRA; resume with "
                              "model.lora_rank=0, or start afresh with trainer.resume_mode=disable")
    return model


def trained_policy(cfg: RunConfig, model, resume: Path | None):
    """The policy as it trains: with LoRA adapters (model.lora_rank > 0; a resumed run's from its checkpoint),
    and its actor.freeze_prefix parameters frozen."""
    if cfg.model.lora_rank > 0:
        model = with_adapters(cfg, model, resume / "model_state" if resume else None)
    if cfg.actor.freeze_prefix:
        lora.freeze_prefixes(model, cfg.actor.freeze_prefix)
    return model


def build_actor(cfg: RunConfig, model, resume: Path | None, env: DistEnv, materialize: Callable | None = None,
                tokenizer=None) -> Actor:
    """The actor on its training engine; `model` as loaded (adapters and frozen prefixes are added here, before
    an engine wraps it). `tokenizer` reads PPO-ptx's texts (ptx.data)."""
    a = cfg.actor
    model = trained_policy(cfg, model, resume)
    spec = OptimSpec(lr=a.lr, weight_decay=a.weight_decay, betas=tuple(a.betas), warmup_steps=a.lr_warmup_steps,
                     total_steps=total_optimizer_steps(cfg), schedule=a.lr_scheduler, min_lr_ratio=a.min_lr_ratio,
                     grad_clip=a.grad_clip)
    if a.gradient_checkpointing:  # before the engine wraps the model (DDP, FSDP2, DeepSpeed)
        recompute_activations(model)
    engine = make_engine(cfg, model, spec, env, materialize)
    if resume:
        restore_state(engine, resume / "model_state", "actor")
    average = PolicyAverage(engine, a.ema_beta, tokenizer, resume) if a.ema_beta else None
    return Actor(engine, forward_layout(cfg), build_ptx(cfg, tokenizer, env), average)


def build_ptx(cfg: RunConfig, tokenizer, env: DistEnv = SINGLE) -> PretrainMix | None:
    """PPO-ptx's texts and weight (ptx.*), or None when ptx.data is not set; each rank draws its own texts."""
    p = cfg.ptx
    if not p.data:
        return None
    if tokenizer is None:  # a caller that cannot read texts must not turn the term off quietly
        raise ValueError("ptx.data is set but the actor was built without a tokenizer to read its texts")
    cap = p.max_length or cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    texts = load_pretrain_texts(p.data, p.key, tokenizer, cap, p.data_probs, cfg.trainer.seed)
    return PretrainMix(texts, p.coef, p.micro_batch_size or cfg.actor.ppo_micro_batch_size, cfg.trainer.seed,
                       env.rank, env.world_size)
