"""Run a GRPO job end to end: set up, resume, loop with metrics and checkpoints, evaluate, summarise.

Output layout (as in the seeds): `<output_dir>/<experiment_name>/{config.yaml, checkpoints/, logs/,
summary.json}`; logs hold `metrics.jsonl`, `tensorboard/` and `curves.png`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from alignrl.algos.evaluate import greedy_eval
from alignrl.algos.grpo import CriticParts, GRPOStep, LocalRefScorer
from alignrl.config import RunConfig, check_world_size, to_yaml
from alignrl.core.lagrangian import LagrangeMultiplier
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.loaders import load_samples
from alignrl.data.sampler import BatchSampler
from alignrl.models.loader import frozen_copy, load_model
from alignrl.models.value import ModelScorer, load_value_model
from alignrl.rewards.registry import load_reward_fn, make_reward
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rollout.remote import RemoteRefScorer, RemoteReward, RemoteRolloutEngine
from alignrl.dist.env import SINGLE, DistEnv, barrier, init_distributed, mean_metrics, shard
from alignrl.train.actor import Actor
from alignrl.train.checkpoint import (atomic_write_text, latest_checkpoint, load_trainer_state, save_checkpoint,
                                      set_rng_state)
from alignrl.train.critic import Critic
from alignrl.train.engines import OptimSpec, TrainEngine, build_engine
from alignrl.utils.tracking import Tracker, console


def load_task_data(cfg: RunConfig):
    d = cfg.data
    train = (synthetic.generate("train", d.train_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
             if d.train_files == "synthetic" else load_samples(d.train_files, d.format, system_prompt=d.system_prompt))
    val = (synthetic.generate("test", d.val_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
           if d.val_files == "synthetic" else
           load_samples(d.val_files, d.format, system_prompt=d.system_prompt, limit=d.val_size))
    return train, val


class LazyPrompts:
    """Prompt ids encoded on first use: templating a large dataset up front costs seconds."""

    def __init__(self, tokenizer, samples, max_len: int):
        self.tokenizer, self.samples, self.max_len, self.cache = tokenizer, samples, max_len, {}

    def __getitem__(self, i: int) -> list[int]:
        if i not in self.cache:
            self.cache[i] = encode_prompts(self.tokenizer, [self.samples[i]], self.max_len)[0]
        return self.cache[i]


def describe_batch(cfg: RunConfig, world: int = 1) -> str:
    """The batch arithmetic users otherwise get wrong (verl #180)."""
    p, n, mini = cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size
    n_mini, micro = p // mini, cfg.actor.ppo_micro_batch_size
    per_rank = mini * n // world
    accum = -(-per_rank // micro)
    return (f"{p} prompts/step × {n} samples/prompt = {p * n} sequences/step; "
            f"{n_mini} mini-batch(es) of {mini * n} sequences × {cfg.actor.ppo_epochs} epoch(s) = "
            f"{n_mini * cfg.actor.ppo_epochs} optimizer steps/RL step; effective batch = {min(micro, per_rank)} "
            f"sequences/micro-batch × {world} rank(s) × {accum} accumulation step(s) ≈ {mini * n} sequences")


def resolve_strategy(cfg: RunConfig, env: DistEnv) -> str:
    s = cfg.trainer.strategy
    return ("ddp" if env.distributed else "single") if s == "auto" else s


def optim_spec(lr: float, warmup: int, total: int, grad_clip: float, weight_decay: float = 0.0, betas=(0.9, 0.999),
               schedule: str = "constant", min_lr_ratio: float = 0.0) -> OptimSpec:
    return OptimSpec(lr=lr, weight_decay=weight_decay, betas=tuple(betas), warmup_steps=warmup, total_steps=total,
                     schedule=schedule, min_lr_ratio=min_lr_ratio, grad_clip=grad_clip)


def make_engine(cfg: RunConfig, model, spec: OptimSpec, env: DistEnv) -> TrainEngine:
    t = cfg.trainer
    return build_engine(resolve_strategy(cfg, env), model, spec, env, zero_stage=t.zero_stage, offload=t.offload,
                        deepspeed_config=t.deepspeed_config or None, bf16=cfg.model.dtype == "bfloat16")


def shards_weights(cfg: RunConfig, env: DistEnv) -> bool:
    """Whether the training engine keeps only a shard of the weights on each rank (then generation runs
    on a full copy, synced after every step)."""
    strategy = resolve_strategy(cfg, env)
    return strategy == "fsdp2" or (strategy == "deepspeed" and cfg.trainer.zero_stage == 3)


def build_critics(cfg: RunConfig, resume: Path | None, total_opt_steps: int, env: DistEnv = SINGLE
                  ) -> CriticParts | None:
    """The critic (and, with safety.cost_fn, the cost critic, cost function and multiplier); from the
    checkpoint's `critic/`, `cost_critic/` folders when resuming."""
    if not cfg.critic.enable:
        return None
    c = cfg.critic

    def make(name: str, seed: int) -> Critic:
        path = str(resume / name) if resume else (c.model_path or cfg.model.path)
        model = load_value_model(path, cfg.model.dtype, seed=seed, log=console.print)
        engine = make_engine(cfg, model, optim_spec(c.lr, c.lr_warmup_steps, total_opt_steps, c.grad_clip), env)
        if resume:
            restore_state(engine, resume / f"{name}_state", name)
        return Critic(engine, cliprange_value=c.cliprange_value, name=name)

    parts = CriticParts(critic=make("critic", cfg.trainer.seed))
    s = cfg.safety
    if s.cost_fn or s.cost_model:
        parts.cost_critic = make("cost_critic", cfg.trainer.seed + 1)
        parts.cost_fn = load_reward_fn(s.cost_fn) if s.cost_fn else None
        parts.cost_model = (ModelScorer(s.cost_model, cfg.model.dtype, log=console.print, device=env.device)
                            if s.cost_model else None)
        parts.lagrangian = LagrangeMultiplier(s.lambda_init, s.lambda_lr, s.cost_limit)
    return parts


def restore_state(engine: TrainEngine, folder: Path, name: str) -> None:
    if not engine.load_state(folder):
        console.print(f"[yellow]{folder.parent.name}: no {name} optimizer state this backend "
                      f"({engine.name}) can read; continuing from the saved weights with a fresh optimizer[/yellow]")


def build_step(cfg: RunConfig, policy_path: str, resume: Path | None = None, env: DistEnv = SINGLE) -> GRPOStep:
    """Policy (from `policy_path`), frozen reference (from the base `cfg.model.path`), actor on its
    training engine, rollout engine (colocated, or a full copy when the engine shards the weights),
    reward functions and critics, wired into one GRPOStep."""
    model, tokenizer = load_model(policy_path, cfg.model.dtype, log=console.print)
    a = cfg.actor
    total_opt_steps = (cfg.trainer.total_training_steps * a.ppo_epochs
                       * (cfg.data.train_batch_size // a.ppo_mini_batch_size))
    ref = build_ref(cfg, model, policy_path, env.device)
    remote = bool(cfg.services.generation_url)
    rollout_model = (frozen_copy(model).to(env.device) if shards_weights(cfg, env) and not remote
                     else None)  # copied before the engine shards the policy
    spec = optim_spec(a.lr, a.lr_warmup_steps, total_opt_steps, a.grad_clip, a.weight_decay, a.betas, a.lr_scheduler,
                      a.min_lr_ratio)
    actor = Actor(make_engine(cfg, model, spec, env))
    if resume:
        restore_state(actor.engine, resume / "model_state", "actor")
    if remote:
        engine = RemoteRolloutEngine(cfg.services.generation_url, tokenizer, **service_args(cfg))
    else:  # colocated: generation shares the policy's weights unless the engine keeps only a shard of them
        engine = HFRolloutEngine(rollout_model if rollout_model is not None else actor.model, tokenizer)
    reward_fn = make_reward(cfg.algorithm.reward_fn, cfg.algorithm.format_reward_weight)
    return GRPOStep(cfg, engine, actor, ref, tokenizer, reward_fn, load_reward_fn(cfg.algorithm.reward_fn),
                    build_critics(cfg, resume, total_opt_steps, env), env, build_reward_model(cfg, env.device))


def service_args(cfg: RunConfig) -> dict:
    return {"timeout": cfg.services.timeout_s, "retries": cfg.services.retries,
            "api_key": os.environ.get("ALIGNRL_API_KEY")}


def build_ref(cfg: RunConfig, model, policy_path: str, device: torch.device):
    """The RefScorer: the reference service when configured, else a frozen copy of the base model;
    None when no KL term needs it."""
    if not ((cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0) or cfg.algorithm.use_kl_in_reward):
        return None
    if cfg.services.reference_url:
        return RemoteRefScorer(cfg.services.reference_url, temperature=cfg.rollout.temperature, **service_args(cfg))
    # the reference is the base model, not a checkpoint
    base = model if policy_path == cfg.model.path else load_model(cfg.model.path, cfg.model.dtype)[0]
    return LocalRefScorer(frozen_copy(base).to(device), cfg.rollout.temperature, cfg.actor.ppo_micro_batch_size)


def build_reward_model(cfg: RunConfig, device: torch.device):
    if cfg.services.reward_url:
        return RemoteReward(cfg.services.reward_url, **service_args(cfg))
    if cfg.algorithm.reward_model:
        return ModelScorer(cfg.algorithm.reward_model, cfg.model.dtype, log=console.print, device=device)
    return None


def train_engines(step_fn: GRPOStep) -> dict[str, TrainEngine]:
    """Checkpoint folder name -> engine: `model` (the policy), `critic`, `cost_critic`."""
    return {"model": step_fn.actor.engine, **{name: c.engine for name, c in critic_objects(step_fn).items()}}


def critic_objects(step_fn: GRPOStep) -> dict[str, Critic]:
    parts = step_fn.critics
    if parts is None:
        return {}
    return {"critic": parts.critic, **({"cost_critic": parts.cost_critic} if parts.cost_critic else {})}


def _fmt(acc: dict[str, float]) -> str:
    return f"{acc['accuracy']:.3f} (last-number extraction: {acc['accuracy_flexible']:.3f})"


def save_ds_config(step_fn: GRPOStep, run_dir: Path, env: DistEnv) -> None:
    """The DeepSpeed config in use is saved with the run (generated or read from the user's file)."""
    ds = getattr(step_fn.actor.engine, "config", None)
    if env.is_main and ds is not None:
        atomic_write_text(run_dir / "deepspeed.json", json.dumps(ds, indent=2))


def train_grpo(cfg: RunConfig, wall_start: float | None = None) -> dict | None:
    """Runs on every rank of a torchrun launch; returns the summary on rank 0, None elsewhere."""
    wall_start = wall_start or time.time()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    env = init_distributed(cfg.trainer.device)
    check_world_size(cfg, env.world_size)
    console.quiet = not env.is_main  # one rank speaks
    run_dir = cfg.run_dir
    ckpt_root, log_dir = cfg.checkpoint_root, cfg.log_root
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))

    train, val = load_task_data(cfg)
    sampler = BatchSampler(len(train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    resume = latest_checkpoint(ckpt_root) if cfg.trainer.resume_mode == "auto" else None
    step_fn = build_step(cfg, str(resume / "model") if resume else cfg.model.path, resume, env)
    tokenizer, engine = step_fn.tokenizer, step_fn.engine
    correct_fn = step_fn.correct_fn
    save_ds_config(step_fn, run_dir, env)
    if step_fn.remote:  # the server may hold other weights (a fresh server, a resumed run): send ours
        step_fn.push_weights()
        console.print(f"generation service {cfg.services.generation_url}: weights pushed "
                      f"(version {engine.weight_version()})")

    start_step, state = 0, {}
    if resume:
        state = load_trainer_state(resume)
        if step_fn.critics is not None and step_fn.critics.lagrangian is not None:
            step_fn.critics.lagrangian.load_state_dict(state["lagrangian"])
        if step_fn.kl_ctrl is not None:
            step_fn.kl_ctrl.value = state["kl_coef"]
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        console.print(f"resumed from {resume} (step {start_step})")
    tracker = Tracker(log_dir, cfg.trainer.logger if env.is_main else [], resume_step=start_step,
                      write=env.is_main)

    max_len = cfg.data.max_prompt_length
    train_prompts = LazyPrompts(tokenizer, train, max_len)
    val_prompts = encode_prompts(tokenizer, val, max_len)
    n_val_small = min(cfg.data.val_size_during_training, len(val))

    def evaluate(n: int) -> dict[str, float]:
        return greedy_eval(engine, tokenizer, val[:n], val_prompts[:n], correct_fn, cfg.rollout.max_new_tokens)

    strategy = resolve_strategy(cfg, env)
    console.print(f"[bold]GRPO[/bold] on {env.world_size} rank(s), strategy {strategy}: {describe_batch(cfg, env.world_size)}")
    console.print(f"train problems {len(train)}, held-out {len(val)}; run dir {run_dir}")
    if "base" not in state:
        t0 = time.time()
        if env.is_main:  # evaluation runs on rank 0's full (unsharded) rollout model; the others wait
            state["base"], small = greedy_eval(engine, tokenizer, val, val_prompts, correct_fn,
                                               cfg.rollout.max_new_tokens, subset=n_val_small)
            console.print(f"base model held-out greedy accuracy: {_fmt(state['base'])} on {len(val)} problems "
                          f"({time.time() - t0:.1f}s)")
            tracker.log(0, {f"val/{k}": v for k, v in small.items()})
        barrier(env)

    def checkpoint(step: int) -> None:
        extra_state = {}
        if step_fn.critics is not None and step_fn.critics.lagrangian is not None:
            extra_state["lagrangian"] = step_fn.critics.lagrangian.state_dict()
        if step_fn.kl_ctrl is not None:
            extra_state["kl_coef"] = step_fn.kl_ctrl.value
        save_checkpoint(ckpt_root, step, train_engines(step_fn), tokenizer,
                        {"sampler": sampler.state_dict(), "base": state.get("base"), "strategy": strategy,
                         **extra_state}, cfg.trainer.max_checkpoints, env)

    total = cfg.trainer.total_training_steps
    columns = [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not cfg.trainer.progress_bar) as bar:
        task = bar.add_task("GRPO", total=total, completed=start_step)
        for step in range(start_step + 1, total + 1):
            def batch():  # the sampler's position is checkpointed, so extra DAPO rounds resume exactly
                idx = shard(sampler.next(), env)  # every rank draws the same batch and keeps its share
                return [train[i] for i in idx], [train_prompts[i] for i in idx]

            metrics = mean_metrics(env, step_fn.run(step, *batch(), more_prompts=batch))
            if cfg.trainer.test_freq and (step % cfg.trainer.test_freq == 0 or step == total):
                t0 = time.perf_counter()
                if env.is_main:
                    metrics.update({f"val/{k}": v for k, v in evaluate(n_val_small).items()})
                barrier(env)
                metrics["timing/val"] = time.perf_counter() - t0
            tracker.log(step, metrics)
            if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or step == total:
                checkpoint(step)
            bar.update(task, completed=step)

    if not env.is_main:
        tracker.close()
        return None
    t0 = time.time()
    final = evaluate(len(val))
    console.print(f"final held-out greedy accuracy: {_fmt(final)} on {len(val)} problems ({time.time() - t0:.1f}s)")
    tracker.plot(log_dir / "curves.png")
    tracker.close()
    base = state["base"]
    summary = {"base_accuracy": base["accuracy"], "final_accuracy": final["accuracy"],
               "gain_points": round(100 * (final["accuracy"] - base["accuracy"]), 2),
               "base_accuracy_flexible": base["accuracy_flexible"],
               "final_accuracy_flexible": final["accuracy_flexible"], "steps": total,
               "heldout_problems": len(val), "wall_seconds": round(time.time() - wall_start, 1),
               "run_dir": str(run_dir)}
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
