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

from alignrl.rl.evaluate import format_room, greedy_eval, room
from alignrl.rl.step import GRPOStep
from alignrl.placements.build import RemoteProducers, place, resolve_strategy
from alignrl.rl.producer import InlineSource
from alignrl.rl.sinks import EngineCopy
from alignrl.rl.trainer import PolicyTrainer
from alignrl.config import ConfigError, RunConfig, check_world_size, to_yaml
from alignrl.data import synthetic
from alignrl.data.collate import encode_prompts
from alignrl.data.loaders import DataError, load_samples
from alignrl.data.records import rows_digest
from alignrl.data.sampler import BatchSampler
from alignrl.placements.zmq.coordinator import Coordinator
from alignrl.runtime.env import DistEnv, barrier, init_distributed, mean_metrics
from alignrl.rewards.registry import ground_truth_problem, load_reward_fn
from alignrl.train.checkpoint import (check_not_past, hold_run_dir, load_trainer_state, resume_point,
                                      save_checkpoint, set_rng_state)
from alignrl.utils.atomic import atomic_write_text
from alignrl.utils.tracking import Tracker, console


def load_task_data(cfg: RunConfig):
    d = cfg.data
    # a file's columns: detected (GSM8K/verl), or named by data.prompt_key/label_key (both splits alike)
    if d.input_template and "\\n" in d.input_template and "\n" not in d.input_template:  # OpenRLHF warns too
        console.print("data.input_template holds the two characters \\n, not a newline: in bash pass "
                      "$'...\\n...', or write the template in double quotes in the YAML file", markup=False)
    keys = dict(system_prompt=d.system_prompt, prompt_key=d.prompt_key, label_key=d.label_key,
                input_template=d.input_template, apply_chat_template=d.apply_chat_template)
    train = (synthetic.generate("train", d.train_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
             if d.train_files == "synthetic" else
             load_samples(d.train_files, d.format, limit=d.train_row_cap, **keys))
    val = (synthetic.generate("test", d.val_size, seed=cfg.trainer.seed, system_prompt=d.system_prompt)
           if d.val_files == "synthetic" else
           load_samples(d.val_files, d.format, limit=d.val_size, key="data.val_files", **keys))
    if cfg.algorithm.reward_fn is None:  # a user's function decides what its ground truth looks like
        for s in (*train, *val):
            problem = ground_truth_problem(s.data_source, s.ground_truth)
            if problem:
                raise DataError(f"{s.source or 'a row'}: {problem}")
    return train, val


def algorithm_name(cfg: RunConfig) -> str:
    """What the run trains, for its header and progress bar: PPO when a critic gives the advantages."""
    names = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_plus_plus": "REINFORCE++",
             "reinforce_plus_plus_baseline": "REINFORCE++ (baseline)", "remax": "ReMax"}
    name = names.get(cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator)
    if cfg.algorithm.outcome_baseline != "none":
        name += f" ({cfg.algorithm.outcome_baseline} baseline)"
    return "PPO" if cfg.critic.enable else name


class PromptData:
    """Dataset rows -> (samples, prompt ids), the ids templated on first use: templating a large dataset up
    front costs seconds."""

    def __init__(self, tokenizer, samples, max_len: int):
        self.tokenizer, self.samples, self.max_len, self.cache = tokenizer, samples, max_len, {}

    def prompt(self, i: int) -> list[int]:
        if i not in self.cache:
            self.cache[i] = encode_prompts(self.tokenizer, [self.samples[i]], self.max_len)[0]
        return self.cache[i]

    def __call__(self, index) -> tuple[list, list[list[int]]]:
        return [self.samples[i] for i in index], [self.prompt(i) for i in index]


def describe_batch(cfg: RunConfig, world: int = 1) -> str:
    """The batch arithmetic users otherwise get wrong (verl #180)."""
    p, n, seqs = cfg.data.train_batch_size, cfg.rollout.n, cfg.mini_batch_sequences
    n_mini, run = p * n // seqs, run_batch_numbers(cfg, world)
    return (f"{p} prompts/step × {n} samples/prompt = {p * n} sequences/step; "
            f"{n_mini} mini-batch(es) of {seqs} sequences × {cfg.actor.ppo_epochs} epoch(s) = "
            f"{n_mini * cfg.actor.ppo_epochs} optimizer steps/RL step; effective batch = "
            f"{run['train_micro_batch_size_per_gpu']} sequences/micro-batch × {world} rank(s) × "
            f"{run['gradient_accumulation_steps']} accumulation step(s) ≈ {seqs} sequences")


def _fmt(acc: dict[str, float]) -> str:
    if "accuracy_flexible" not in acc:  # not a GSM8K-scored task
        return f"{acc['accuracy']:.3f}"
    return f"{acc['accuracy']:.3f} (last-number extraction: {acc['accuracy_flexible']:.3f})"


def run_batch_numbers(cfg: RunConfig, world: int) -> dict[str, int]:
    """DeepSpeed's three batch numbers for what the run does (describe_batch's): sequences per optimizer step, per
    micro-batch on a rank, micro-batches per optimizer step on a rank."""
    per_rank = cfg.mini_batch_sequences // world
    micro = min(cfg.actor.ppo_micro_batch_size, per_rank)
    return {"train_batch_size": cfg.mini_batch_sequences, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": -(-per_rank // micro)}


def save_ds_config(cfg: RunConfig, trainer: PolicyTrainer, run_dir: Path, env: DistEnv) -> None:
    """The DeepSpeed config in use is saved with the run (generated or read from the user's file), with the run's
    batch numbers: DeepSpeed is handed nominal ones, as alignrl drives the accumulation. Batch numbers of the user's
    file that the run does not follow are named once (seed 004's trainer follows its file: seed004_deepspeed)."""
    engine = trainer.actor.engine
    if not env.is_main or engine.name != "deepspeed":
        return
    ds = engine.config
    run = run_batch_numbers(cfg, env.world_size)
    path = cfg.trainer.deepspeed_config
    theirs = json.loads(Path(path).read_text()) if path else {}
    differ = [f"{k} {theirs[k]}" for k in run if theirs.get(k) not in (None, "auto", run[k])]
    if differ:
        console.print(f"{path}: {', '.join(differ)} not followed: alignrl drives the batch, here "
                      f"{run['train_micro_batch_size_per_gpu']} sequences a micro-batch "
                      f"(actor.ppo_micro_batch_size) and {run['train_batch_size']} an optimizer step "
                      "(actor.ppo_mini_batch_size); set those", markup=False, soft_wrap=True)
    atomic_write_text(run_dir / "deepspeed.json", json.dumps({**ds, **run}, indent=2))


def train_grpo(cfg: RunConfig, wall_start: float | None = None, producers: RemoteProducers | None = None
               ) -> dict | None:
    """Runs on every rank of a torchrun launch; returns the summary on rank 0, None elsewhere. With
    `producers`, batches come from sampler processes instead of this one."""
    wall_start = wall_start or time.time()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    env = init_distributed(cfg.trainer.device)
    check_world_size(cfg, env.world_size)
    console.quiet = not env.is_main  # one rank speaks
    if env.is_main:
        try:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a path under /proc, a read-only or full disk: named, not a traceback
            raise ConfigError(f"cannot create the run folder {cfg.run_dir} ({e.strerror}): set trainer.output_dir "
                              "to a folder this process can write") from None
    claim = hold_run_dir(cfg.run_dir) if env.is_main else None  # held while the run writes there
    try:
        return _train(cfg, env, wall_start, producers)
    finally:  # a run that failed lets the next one in at once, even in a process that lives on (a notebook, Ray)
        if claim is not None:
            claim.close()


def _train(cfg: RunConfig, env: DistEnv, wall_start: float, producers: RemoteProducers | None) -> dict | None:
    run_dir, ckpt_root, log_dir = cfg.run_dir, cfg.checkpoint_root, cfg.log_root
    train, val = load_task_data(cfg)
    sampler = BatchSampler(len(train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
    # the newest complete checkpoint; folders this run would write over are moved aside, never deleted (with
    # the config of the run that wrote them, on a fresh start). Its line is printed unwrapped and literally:
    # it holds paths and a user-written tracker file's text.
    resume = resume_point(ckpt_root, cfg.trainer.resume_mode, env,
                          lambda line: console.print(line, markup=False, soft_wrap=True), run_dir / "config.yaml")
    total = cfg.trainer.total_training_steps
    check_not_past(resume, total)
    if producers is None and cfg.pipeline.placement == "zmq":  # samplers in other processes make the batches
        producers = Coordinator(cfg, to_yaml(cfg), log_dir, rows_digest(train))
    placed = place(cfg, str(resume / "model") if resume else cfg.model.path, resume, env, producers)
    tokenizer, engine, trainer = placed.tokenizer, placed.eval_engine, placed.trainer
    correct_fn = load_reward_fn(cfg.algorithm.reward_fn)
    rows = PromptData(tokenizer, train, cfg.data.max_prompt_length)
    source = (producers.source(sampler, trainer, env) if producers else
              InlineSource(placed.maker, sampler, rows, lambda: trainer.version, env))
    step_fn = GRPOStep(source, trainer)
    save_ds_config(cfg, trainer, run_dir, env)

    start_step, state = 0, {}
    if resume:
        state = load_trainer_state(resume)
        if set(state["source"]) != set(source.state_dict()):  # inline/Ray and zmq keep different data-order state
            source.close(False)
            raise ConfigError(f"{resume} was written under another pipeline.placement (its data-order state holds "
                              f"{sorted(state['source'])}): resume with the placement that wrote it, or set "
                              "trainer.resume_mode=disable to start afresh")
        source.load_state_dict(state["source"])
        trainer.load_state_dict(state["trainer"])
        set_rng_state(state["rng"])
        start_step = state["step"]
        console.print(f"resumed from {resume} (step {start_step})")
    if placed.remote_eval and start_step == total:  # resumed at its end: no step publishes, and the engines that
        placed.sink.publish(trainer.version)  # evaluate hold the base weights (collective on every rank)
    if env.is_main:  # once the run can start (its ports bound, its checkpoint read): a failed start leaves it be
        atomic_write_text(run_dir / "config.yaml", to_yaml(cfg))
    if isinstance(placed.sink, EngineCopy) and placed.sink.main_only:
        # the server may hold other weights (a fresh server, a resumed run): send ours
        placed.sink.publish(trainer.version)
        console.print(f"generation service {cfg.services.generation_url}: weights pushed")
    tracker = Tracker(log_dir, cfg.trainer.logger if env.is_main else [], resume_step=start_step,
                      write=env.is_main, project=cfg.trainer.project_name, run_name=cfg.trainer.experiment_name,
                      config=cfg, tensorboard_dir=run_dir / cfg.trainer.tensorboard_dir if cfg.trainer.tensorboard_dir
                      else None)  # relative: inside the run folder, as log_dir

    val_prompts = encode_prompts(tokenizer, val, cfg.data.max_prompt_length)
    n_val_small = min(cfg.data.val_size_during_training, len(val))

    def evaluate(n: int) -> dict[str, float]:
        return greedy_eval(engine, tokenizer, val[:n], val_prompts[:n], correct_fn, cfg.rollout.max_new_tokens,
                           stop=cfg.rollout.stop)

    def measure_room(label: str) -> dict | None:
        """pass@1 and pass@k on the held-out set (trainer.eval_pass_at_k), printed and returned."""
        if not cfg.trainer.eval_pass_at_k:
            return None
        t0 = time.time()  # the longest silent stretch of a run otherwise: say what it is doing
        console.print(f"{label}: sampling {cfg.rollout.n} answers to each of {len(val)} held-out problems "
                      f"(pass@{cfg.rollout.n}, trainer.eval_pass_at_k) ...", markup=False)
        r = room(engine, tokenizer, val, val_prompts, correct_fn, cfg.rollout.max_new_tokens, cfg.rollout.n,
                 cfg.rollout.temperature, seed=cfg.trainer.seed, stop=cfg.rollout.stop, top_p=cfg.rollout.top_p,
                 top_k=cfg.rollout.top_k)
        console.print(f"{label} held-out room on {len(val)} problems ({time.time() - t0:.1f}s):\n{format_room(r)}",
                      markup=False)
        return r

    strategy = resolve_strategy(cfg, env)
    name = algorithm_name(cfg)
    console.print(f"[bold]{name}[/bold] on {env.world_size} rank(s), strategy {strategy}: "
                  f"{describe_batch(cfg, env.world_size)}")
    # a file that is also the training data is no held-out set (OpenRLHF's --prompt_data without --eval_dataset)
    d = cfg.data
    held = "held-out" if d.val_files == "synthetic" or d.val_files != d.train_files else "training-prompt"
    if d.val_files == "synthetic" and d.train_files != "synthetic":  # the accuracy is not on the user's task
        held += " (synthetic arithmetic: data.val_files names a held-out file of the task)"
    console.print(f"train problems {len(train)}, {held} {len(val)}; run dir {run_dir}", markup=False)
    if "base" not in state:
        t0 = time.time()
        if env.is_main:  # evaluation runs on rank 0's full (unsharded) rollout model; the others wait
            state["base"], small = greedy_eval(engine, tokenizer, val, val_prompts, correct_fn,
                                               cfg.rollout.max_new_tokens, subset=n_val_small, stop=cfg.rollout.stop)
            console.print(f"base model {held} greedy accuracy: {_fmt(state['base'])} on {len(val)} problems "
                          f"({time.time() - t0:.1f}s)")
            tracker.log(0, {f"val/{k}": v for k, v in small.items()})
            state["base_room"] = measure_room("base model")
        barrier(env)

    earlier_s = float(state.get("wall_seconds", 0.0))  # the launches before a resume, up to their checkpoint

    def checkpoint(step: int) -> None:
        save_checkpoint(ckpt_root, step, placed.engines(), tokenizer,
                        {"source": source.state_dict(), "trainer": trainer.state_dict(), "base": state.get("base"),
                         "base_room": state.get("base_room"), "wall_seconds": earlier_s + time.time() - wall_start,
                         "strategy": strategy}, cfg.trainer.max_checkpoints, env, placed.saved_elsewhere())

    columns = [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn()]
    finished = False
    try:
        with Progress(*columns, console=console, disable=not cfg.trainer.progress_bar) as bar:
            task = bar.add_task(name, total=total, completed=start_step)
            for step in range(start_step + 1, total + 1):
                metrics = mean_metrics(env, step_fn.run(step))
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
        finished = True
    finally:  # samplers are told the run is over, or left waiting for a restarted trainer; the ports are freed
        source.close(finished)
    if not env.is_main:
        tracker.close()
        return None
    t0 = time.time()
    final = evaluate(len(val))
    console.print(f"final {held} greedy accuracy: {_fmt(final)} on {len(val)} problems ({time.time() - t0:.1f}s)")
    final_room = measure_room("trained model")
    tracker.plot(log_dir / "curves.png")
    tracker.close()
    base = state["base"]
    summary = {"base_accuracy": base["accuracy"], "final_accuracy": final["accuracy"],
               "gain_points": round(100 * (final["accuracy"] - base["accuracy"]), 2),
               "steps": total,
               "heldout_problems": len(val), "wall_seconds": round(earlier_s + time.time() - wall_start, 1),
               "run_dir": str(run_dir)}
    if "accuracy_flexible" in final:
        summary.update(base_accuracy_flexible=base["accuracy_flexible"], final_accuracy_flexible=final["accuracy_flexible"],
                       gain_points_flexible=round(100 * (final["accuracy_flexible"] - base["accuracy_flexible"]), 2))
    if final_room is not None:
        summary.update(base_room=state.get("base_room"), final_room=final_room)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
