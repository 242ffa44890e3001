"""Run a GRPO job end to end: set up, resume, loop with metrics and checkpoints, evaluate, summarise.

Output layout (as in the seeds): `<output_dir>/<experiment_name>/{config.yaml, checkpoints/, logs/,
summary.json}`; logs hold `metrics.jsonl`, `tensorboard/` and `curves.png`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from alignrl.algos.evaluate import greedy_eval
from alignrl.algos.grpo import CriticParts, GRPOStep
from alignrl.config import RunConfig, to_yaml
from alignrl.core.lagrangian import LagrangeMultiplier
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.loaders import load_samples
from alignrl.data.sampler import BatchSampler
from alignrl.models.loader import frozen_copy, load_model
from alignrl.models.value import ModelScorer, load_value_model
from alignrl.rewards.registry import load_reward_fn, make_reward
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.train.actor import Actor
from alignrl.train.critic import Critic
from alignrl.train.checkpoint import (atomic_write_text, latest_checkpoint, load_trainer_state, save_checkpoint,
                                      set_rng_state)
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


def describe_batch(cfg: RunConfig) -> str:
    """The batch arithmetic users otherwise get wrong (verl #180)."""
    p, n, mini = cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size
    n_mini = p // mini
    return (f"{p} prompts/step × {n} samples/prompt = {p * n} sequences/step; "
            f"{n_mini} mini-batch(es) of {mini * n} sequences × {cfg.actor.ppo_epochs} epoch(s) = "
            f"{n_mini * cfg.actor.ppo_epochs} optimizer steps/RL step; micro-batch {cfg.actor.ppo_micro_batch_size} "
            f"sequences; effective batch on 1 process = {mini * n} sequences")


def build_critics(cfg: RunConfig, resume: Path | None, total_opt_steps: int) -> CriticParts | None:
    """The critic (and, with safety.cost_fn, the cost critic, cost function and multiplier); from the
    checkpoint's `critic/`, `cost_critic/` folders when resuming."""
    if not cfg.critic.enable:
        return None
    c = cfg.critic

    def make(name: str, seed: int) -> Critic:
        path = str(resume / name) if resume else (c.model_path or cfg.model.path)
        return Critic(load_value_model(path, cfg.model.dtype, seed=seed, log=console.print), lr=c.lr,
                      weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=c.lr_warmup_steps,
                      total_steps=total_opt_steps, grad_clip=c.grad_clip, cliprange_value=c.cliprange_value,
                      name=name)

    parts = CriticParts(critic=make("critic", cfg.trainer.seed))
    s = cfg.safety
    if s.cost_fn or s.cost_model:
        parts.cost_critic = make("cost_critic", cfg.trainer.seed + 1)
        parts.cost_fn = load_reward_fn(s.cost_fn) if s.cost_fn else None
        parts.cost_model = ModelScorer(s.cost_model, cfg.model.dtype, log=console.print) if s.cost_model else None
        parts.lagrangian = LagrangeMultiplier(s.lambda_init, s.lambda_lr, s.cost_limit)
    return parts


def build_step(cfg: RunConfig, policy_path: str, resume: Path | None = None) -> GRPOStep:
    """Policy (from `policy_path`), frozen reference (from the base `cfg.model.path`), actor with its
    optimizer, colocated rollout engine, reward functions and critics, wired into one GRPOStep."""
    model, tokenizer = load_model(policy_path, cfg.model.dtype, log=console.print)
    ref_model = None
    if (cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0) or cfg.algorithm.use_kl_in_reward:
        # the reference is the base model, not a checkpoint
        base = model if policy_path == cfg.model.path else load_model(cfg.model.path, cfg.model.dtype)[0]
        ref_model = frozen_copy(base)
    a = cfg.actor
    total_opt_steps = (cfg.trainer.total_training_steps * a.ppo_epochs
                       * (cfg.data.train_batch_size // a.ppo_mini_batch_size))
    actor = Actor(model, lr=a.lr, weight_decay=a.weight_decay, betas=a.betas, warmup_steps=a.lr_warmup_steps,
                  total_steps=total_opt_steps, schedule=a.lr_scheduler, min_lr_ratio=a.min_lr_ratio,
                  grad_clip=a.grad_clip)
    engine = HFRolloutEngine(model, tokenizer)  # colocated: shares the policy's weights
    reward_fn = make_reward(cfg.algorithm.reward_fn, cfg.algorithm.format_reward_weight)
    return GRPOStep(cfg, engine, actor, ref_model, tokenizer, reward_fn, load_reward_fn(cfg.algorithm.reward_fn),
                    build_critics(cfg, resume, total_opt_steps))


def critic_objects(step_fn: GRPOStep) -> dict[str, Critic]:
    parts = step_fn.critics
    if parts is None:
        return {}
    return {"critic": parts.critic, **({"cost_critic": parts.cost_critic} if parts.cost_critic else {})}


def _fmt(acc: dict[str, float]) -> str:
    return f"{acc['accuracy']:.3f} (last-number extraction: {acc['accuracy_flexible']:.3f})"


def train_grpo(cfg: RunConfig, wall_start: float | None = None) -> dict:
    wall_start = wall_start or time.time()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    run_dir = cfg.run_dir
    ckpt_root, log_dir = run_dir / "checkpoints", run_dir / "logs"
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))

    train, val = load_task_data(cfg)
    sampler = BatchSampler(len(train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    resume = latest_checkpoint(ckpt_root) if cfg.trainer.resume_mode == "auto" else None
    step_fn = build_step(cfg, str(resume / "model") if resume else cfg.model.path, resume)
    model, tokenizer, actor, engine = step_fn.actor.model, step_fn.tokenizer, step_fn.actor, step_fn.engine
    correct_fn = step_fn.correct_fn

    start_step, state = 0, {}
    if resume:
        state = load_trainer_state(resume)
        actor.load_state_dict(state["actor"])
        for name, critic in critic_objects(step_fn).items():
            critic.load_state_dict(state[name])
        if step_fn.critics is not None and step_fn.critics.lagrangian is not None:
            step_fn.critics.lagrangian.load_state_dict(state["lagrangian"])
        if step_fn.kl_ctrl is not None:
            step_fn.kl_ctrl.value = state["kl_coef"]
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        console.print(f"resumed from {resume} (step {start_step})")
    tracker = Tracker(log_dir, cfg.trainer.logger, resume_step=start_step)

    max_len = cfg.data.max_prompt_length
    train_prompts = LazyPrompts(tokenizer, train, max_len)
    val_prompts = encode_prompts(tokenizer, val, max_len)
    n_val_small = min(cfg.data.val_size_during_training, len(val))

    def evaluate(n: int) -> dict[str, float]:
        return greedy_eval(engine, tokenizer, val[:n], val_prompts[:n], correct_fn, cfg.rollout.max_new_tokens)

    console.print(f"[bold]GRPO[/bold] {describe_batch(cfg)}")
    console.print(f"train problems {len(train)}, held-out {len(val)}; run dir {run_dir}")
    if "base" not in state:
        t0 = time.time()
        state["base"], small = greedy_eval(engine, tokenizer, val, val_prompts, correct_fn, cfg.rollout.max_new_tokens,
                                           subset=n_val_small)
        console.print(f"base model held-out greedy accuracy: {_fmt(state['base'])} on {len(val)} problems "
                      f"({time.time() - t0:.1f}s)")
        tracker.log(0, {f"val/{k}": v for k, v in small.items()})

    def checkpoint(step: int) -> None:
        critics = critic_objects(step_fn)
        extra_state = {name: c.state_dict() for name, c in critics.items()}
        if step_fn.critics is not None and step_fn.critics.lagrangian is not None:
            extra_state["lagrangian"] = step_fn.critics.lagrangian.state_dict()
        if step_fn.kl_ctrl is not None:
            extra_state["kl_coef"] = step_fn.kl_ctrl.value
        save_checkpoint(ckpt_root, step, model, tokenizer,
                        {"actor": actor.state_dict(), "sampler": sampler.state_dict(), "base": state["base"],
                         **extra_state}, cfg.trainer.max_checkpoints,
                        extra_models={name: c.model for name, c in critics.items()})

    total = cfg.trainer.total_training_steps
    columns = [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not cfg.trainer.progress_bar) as bar:
        task = bar.add_task("GRPO", total=total, completed=start_step)
        for step in range(start_step + 1, total + 1):
            def batch():  # the sampler's position is checkpointed, so extra DAPO rounds resume exactly
                idx = sampler.next()
                return [train[i] for i in idx], [train_prompts[i] for i in idx]

            metrics = step_fn.run(step, *batch(), more_prompts=batch)
            if cfg.trainer.test_freq and (step % cfg.trainer.test_freq == 0 or step == total):
                t0 = time.perf_counter()
                metrics.update({f"val/{k}": v for k, v in evaluate(n_val_small).items()})
                metrics["timing/val"] = time.perf_counter() - t0
            tracker.log(step, metrics)
            if (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0) or step == total:
                checkpoint(step)
            bar.update(task, completed=step)

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
