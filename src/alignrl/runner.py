"""Run a GRPO job end to end: set up, resume, loop with metrics and checkpoints, evaluate, summarise.

The runner asks the placement for its parts (`placements.choose` for the producers a config's pipeline names,
`placements.local.place` for the trainer and its sinks) and never asks which placement it got.

Output layout (as in the seeds): `<output_dir>/<experiment_name>/{config.yaml, checkpoints/, logs/,
summary.json}`; logs hold `metrics.jsonl`, `tensorboard/` and `curves.png`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import Progress

from alignrl.config import ConfigError, RunConfig, check_world_size, to_yaml
from alignrl.data.collate import encode_prompts
from alignrl.data.prompts import PromptData, load_task_data
from alignrl.data.sampler import BatchSampler
from alignrl.interfaces import BatchSource, RemoteProducers
from alignrl.models.loader import resolve_model_path, run_tokenizer, with_template_variables
from alignrl.placements.build import resolve_strategy, timed_rule
from alignrl.placements.episodes import run_tool_schemas
from alignrl.placements.choose import remote_producers
from alignrl.placements.local import Placed, place
from alignrl.rewards.timed_rules import late_rows, say_timeouts
from alignrl.rewards.reward_log import logging_rewards
from alignrl.rl.evaluate import format_room, heldout_eval, room, validation_params
from alignrl.rl.generation_logs import RolloutDump, jsonl, log_generations, records, write_jsonl
from alignrl.rl.producer import InlineSource, trainer_state
from alignrl.rl.replay import check_replay, data_order_keys, with_replay
from alignrl.rl.step import GRPOStep
from alignrl.rl.trainer import PolicyTrainer
from alignrl.runtime.cores import LoadWatch, fit_threads
from alignrl.runtime.env import DistEnv, barrier, init_distributed, interrupted, mean_metrics
from alignrl.train.checkpoint import (check_not_past, hold_run_dir, load_trainer_state, resume_point,
                                      save_checkpoint, set_rng_state)
from alignrl.utils.atomic import atomic_write_text
from alignrl.utils.progress import Phase, bar_columns
from alignrl.utils.tracking import Tracker, console


def algorithm_name(cfg: RunConfig) -> str:
    """What the run trains, for its header and progress bar: PPO when a critic gives the advantages."""
    names = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_plus_plus": "REINFORCE++",
             "reinforce_plus_plus_baseline": "REINFORCE++ (baseline)", "remax": "ReMax", "opo": "OPO",
             "grpo_passk": "GRPO (pass@k)", "rloo_vectorized": "RLOO", "grpo_vectorized": "GRPO"}
    name = names.get(cfg.algorithm.adv_estimator, cfg.algorithm.adv_estimator)
    if cfg.algorithm.outcome_baseline != "none":
        name += f" ({cfg.algorithm.outcome_baseline} baseline)"
    return "PPO" if cfg.critic.enable else name


def describe_batch(cfg: RunConfig, world: int = 1) -> str:
    """The batch arithmetic users otherwise get wrong (verl #180)."""
    p, n, seqs = cfg.data.train_batch_size, cfg.rollout.n, cfg.mini_batch_sequences
    n_mini, last, run = cfg.mini_batches_per_step, p * n % seqs, run_batch_numbers(cfg, world)
    minis = f"{n_mini - 1} mini-batch(es) of {seqs} sequences and one of {last}" if last else \
        f"{n_mini} mini-batch(es) of {seqs} sequences"
    return (f"{p} prompts/step × {n} samples/prompt = {p * n} sequences/step; {minis} × {cfg.actor.ppo_epochs} "
            f"epoch(s) = {n_mini * cfg.actor.ppo_epochs} optimizer steps/RL step; effective batch = "
            f"{run['train_micro_batch_size_per_gpu']} sequences/micro-batch × {world} rank(s) × "
            f"{run['gradient_accumulation_steps']} accumulation step(s) ≈ {seqs} sequences")


def _fmt(acc: dict[str, float]) -> str:
    text = f"{acc['accuracy']:.3f}"
    if "accuracy_flexible" in acc:  # a GSM8K-scored task
        text += f" (last-number extraction: {acc['accuracy_flexible']:.3f})"
    return text + "".join(f", {k} {v:.3f}" for k, v in acc.items() if k.startswith("pass@"))


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
    file that the run does not follow are named once (the ZeroMQ trainer follows its file)."""
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
    # ranks of a launch had their share set by the launcher (OMP_NUM_THREADS); a lone process measures its own
    check_replay(cfg)  # before any work: a replay setting without its correction is refused at once
    threads = fit_threads(cfg.trainer.threads)
    env = init_distributed(cfg.trainer.device)
    check_world_size(cfg, env.world_size)
    console.quiet = not env.is_main  # one rank speaks
    console.print(threads.line(), markup=False)
    if env.is_main:
        try:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a path under /proc, a read-only or full disk: named, not a traceback
            raise ConfigError(f"cannot create the run folder {cfg.run_dir} ({e.strerror}): set trainer.output_dir "
                              "to a folder this process can write") from None
    claim = hold_run_dir(cfg.run_dir) if env.is_main else None  # held while the run writes there
    try:
        return _train(cfg, env, wall_start, producers, LoadWatch(threads) if env.world_size == 1 else None)
    finally:  # a run that failed lets the next one in at once, even in a process that lives on (a notebook, Ray)
        if claim is not None:
            claim.close()


@dataclass
class Run:
    """What one launch of a run works with, once placed: the trainer's parts and the batches' source, the
    held-out set, and the state a checkpoint carries on (`state`: the base model's scores, earlier wall time)."""

    cfg: RunConfig
    env: DistEnv
    placed: Placed
    source: BatchSource
    val: list
    val_prompts: list
    correct_fn: object
    held: str = "held-out"
    state: dict = field(default_factory=dict)
    start_step: int = 0
    watch: LoadWatch | None = None  # re-fits the threads between steps as other processes come and go
    tracker: Tracker | None = None  # where held-out answers are logged (trainer.log_val_generations)
    train_rows: int = 0  # the training rows, for the epochs TRL's reward functions read (trainer_state)

    def evaluate(self, n: int, subset: int | None = None, step: int = 0):
        """Held-out accuracy on the first `n` problems (and on the first `subset` of them, from the same answers),
        after RL step `step`; the answers go where trainer.validation_data_dir and log_val_generations say."""
        r, t = self.cfg.rollout, self.cfg.trainer
        params = validation_params(r.max_new_tokens, r.stop, r.val_temperature, r.val_top_p, r.val_top_k, r.val_n,
                                   t.seed, r.min_p, r.repetition_penalty)
        answers = [] if t.validation_data_dir or t.log_val_generations else None
        # the callers print the phase's line with its seconds (or log them as timing/val): the bar alone here
        with Phase("held-out evaluation", n, "problems", say=False, bar=t.progress_bar) as p:
            out = heldout_eval(self.placed.eval_engine, self.placed.tokenizer, self.val[:n], self.val_prompts[:n],
                               self.correct_fn, r.max_new_tokens, subset=subset, params=params, progress=p.advance,
                               answers=answers, state=trainer_state(self.cfg, step, self.train_rows))
        say_timeouts("held-out evaluation", late_rows([self.correct_fn]), self.cfg.algorithm.reward_timeout_s)
        if answers:
            rows = records(*zip(*answers), step=step)
            if t.validation_data_dir:
                write_jsonl(Path(t.validation_data_dir), step, jsonl(rows))
            if t.log_val_generations and self.tracker is not None:
                log_generations(self.cfg.log_root, self.tracker, step, rows, t.log_val_generations)
        return out

    @property
    def how(self) -> str:
        """How the held-out answers are made, for the console."""
        r = self.cfg.rollout
        return "greedy" if r.val_temperature <= 0 else f"sampled (T={r.val_temperature:g}, {r.val_n} a problem)"

    def measure_room(self, label: str, step: int = 0) -> dict | None:
        """pass@1 and pass@k on the held-out set (trainer.eval_pass_at_k) after `step` RL steps (what TRL's reward
        functions read as their trainer_state), printed and returned."""
        cfg, val = self.cfg, self.val
        if not cfg.trainer.eval_pass_at_k:
            return None
        t0 = time.time()  # the longest silent stretch of a run otherwise: say what it is doing
        console.print(f"{label}: sampling {cfg.rollout.n} answers to each of {len(val)} held-out problems "
                      f"(pass@{cfg.rollout.n}, trainer.eval_pass_at_k) ...", markup=False)
        with Phase(f"{label} pass@{cfg.rollout.n}", 2 * len(val), "problems (greedy, then sampled)", say=False,
                   bar=cfg.trainer.progress_bar) as p, logging_rewards(trainer_state(cfg, step, self.train_rows)):
            r = room(self.placed.eval_engine, self.placed.tokenizer, val, self.val_prompts, self.correct_fn,
                     cfg.rollout.max_new_tokens, cfg.rollout.n, cfg.rollout.temperature, seed=cfg.trainer.seed,
                     stop=cfg.rollout.stop, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, progress=p.advance,
                     min_p=cfg.rollout.min_p, repetition_penalty=cfg.rollout.repetition_penalty)
        console.print(f"{label} held-out room on {len(val)} problems ({time.time() - t0:.1f}s):\n{format_room(r)}",
                      markup=False)
        say_timeouts(f"{label} pass@{cfg.rollout.n}", late_rows([self.correct_fn]), cfg.algorithm.reward_timeout_s)
        return r


def _train(cfg: RunConfig, env: DistEnv, wall_start: float, producers: RemoteProducers | None,
           watch: LoadWatch | None) -> dict | None:
    # verl's tool schemas are part of each prompt: the overlong filter and the cut count them, as verl's dataset does
    tools = run_tool_schemas(cfg)
    train, val = load_task_data(cfg, _filtering_tokenizer(cfg), tools)
    sampler = BatchSampler(len(train), cfg.data.draw_size, cfg.trainer.seed, cfg.data.shuffle)
    # the newest complete checkpoint; folders this run would write over are moved aside, never deleted (with
    # the config of the run that wrote them, on a fresh start). Its line is printed unwrapped and literally:
    # it holds paths and a user-written tracker file's text.
    resume = resume_point(cfg.checkpoint_root, cfg.trainer.resume_mode, env,
                          lambda line: console.print(line, markup=False, soft_wrap=True), cfg.run_dir / "config.yaml")
    check_not_past(resume, cfg.trainer.total_training_steps)
    if resume:  # before any model loads or sampler port binds
        _check_same_reference(cfg, resume, load_trainer_state(resume, mmap=True).get("ref_path"))
    if producers is None:  # samplers in other processes make the batches where the config's pipeline says so
        producers = remote_producers(cfg, to_yaml(cfg), cfg.log_root, train)
    placed = place(cfg, str(resume / "model") if resume else cfg.model.path, resume, env, producers)
    trainer = placed.trainer
    correct_fn = timed_rule(cfg, "reward")
    rows = PromptData(placed.tokenizer, train, cfg.data.max_prompt_length, cfg.data.truncation, tools)
    source = with_replay(producers.source(sampler, trainer, env) if producers else
                         InlineSource(placed.maker, sampler, rows, lambda: trainer.version, env),
                         cfg, placed.tokenizer.pad_token_id)
    save_ds_config(cfg, trainer, cfg.run_dir, env)
    run = Run(cfg, env, placed, source, val, [], correct_fn, watch=watch, train_rows=len(train))
    if resume:
        _resume(run, resume)
    placed.before_first_step(trainer.version, resumed_at_end=run.start_step == cfg.trainer.total_training_steps)
    if env.is_main:  # once the run can start (its ports bound, its checkpoint read): a failed start leaves it be
        atomic_write_text(cfg.run_dir / "config.yaml", to_yaml(cfg))
    tracker = Tracker(cfg.log_root, cfg.trainer.logger if env.is_main else [], resume_step=run.start_step,
                      write=env.is_main, project=cfg.trainer.project_name, run_name=cfg.trainer.experiment_name,
                      config=cfg, tensorboard_dir=cfg.run_dir / cfg.trainer.tensorboard_dir
                      if cfg.trainer.tensorboard_dir else None)  # relative: inside the run folder, as log_dir
    run.val_prompts = encode_prompts(placed.tokenizer, val, cfg.data.max_prompt_length, cfg.data.truncation, tools)
    run.tracker = tracker
    _announce(run, len(train))
    _evaluate_base(run, tracker)
    dump = (RolloutDump(Path(cfg.trainer.rollout_data_dir), placed.tokenizer, train, env)
            if cfg.trainer.rollout_data_dir else None)
    finished = False
    try:
        _loop(run, GRPOStep(source, trainer, dump), tracker, wall_start)
        finished = True
    finally:  # samplers are told the run is over, or left waiting for a restarted trainer; the ports are freed
        source.close(finished)
    if not env.is_main:
        tracker.close()
        return None
    return _finish(run, tracker, wall_start)


def _filtering_tokenizer(cfg: RunConfig):
    """The policy's tokenizer where data.filter_overlong_prompts measures the prompts at load, else None (the
    tokenizer loads with the policy; a checkpoint holds the same one)."""
    if not cfg.data.filter_overlong_prompts:
        return None
    return with_template_variables(run_tokenizer(cfg, resolve_model_path(cfg.model.path, lambda *_: None)),
                                   cfg.data.chat_template_kwargs)


def _resume(run: Run, resume: Path) -> None:
    """The checkpoint's data order, trainer state and RNG, into this launch's parts."""
    state = load_trainer_state(resume)
    # inline/Ray and zmq keep different data-order state (a replay buffer's own entry aside)
    if data_order_keys(state["source"]) != data_order_keys(run.source.state_dict()):
        run.source.close(False)
        raise ConfigError(f"{resume} was written under another pipeline.placement (its data-order state holds "
                          f"{sorted(state['source'])}): resume with the placement that wrote it, or set "
                          "trainer.resume_mode=disable to start afresh")
    run.source.load_state_dict(state["source"])
    run.placed.trainer.load_state_dict(state["trainer"])
    set_rng_state(state["rng"])
    run.state, run.start_step = state, state["step"]
    console.print(f"resumed from {resume} (step {run.start_step})")


def recorded_path(path: str) -> str:
    """A model folder as a checkpoint records it: a local folder by its absolute path (a resume from another working
    folder names it the same), a Hub id or "" as written."""
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def _check_same_reference(cfg: RunConfig, resume: Path, saved: str | None) -> None:
    """A run resumes against the reference it trained against: another model.ref_path (or none where it had one)
    would change what the KL term or online DPO's loss pulls toward, silently. A checkpoint from before the key was
    recorded (None) is not checked."""
    now = recorded_path(cfg.model.ref_path)
    if saved is None or saved == now:
        return
    fix = f"with model.ref_path={saved}" if saved else "without model.ref_path"
    raise ConfigError(f"{resume} was trained against model.ref_path={saved or '(none: the base policy)'} and this "
                      f"line gives {now or 'none'}: resume {fix}, or set trainer.resume_mode=disable to start afresh")


def _announce(run: Run, n_train: int) -> None:
    """The run's header: the algorithm, ranks and batch arithmetic, and what the held-out set is."""
    cfg, env = run.cfg, run.env
    console.print(f"[bold]{algorithm_name(cfg)}[/bold] on {env.world_size} rank(s), strategy "
                  f"{resolve_strategy(cfg, env)}: {describe_batch(cfg, env.world_size)}")
    # a file that is also the training data is no held-out set (OpenRLHF's --prompt_data without --eval_dataset)
    d = cfg.data
    run.held = "held-out" if d.val_files == "synthetic" or d.val_files != d.train_files else "training-prompt"
    if d.val_files == "synthetic" and d.train_files != "synthetic":  # the accuracy is not on the user's task
        run.held += " (synthetic arithmetic: data.val_files names a held-out file of the task)"
    console.print(f"train problems {n_train}, {run.held} {len(run.val)}; run dir {cfg.run_dir}", markup=False)
    p = cfg.pipeline
    if p.replay_buffer_size:
        console.print(f"replay buffer: the newest {p.replay_buffer_size} groups with reward spread replace groups "
                      f"without it{f' and {p.replay_share:g} of each batch' if p.replay_share else ''}; replayed "
                      f"groups are corrected by truncated importance sampling (algorithm.rollout_is="
                      f"{cfg.algorithm.rollout_is})", markup=False)


def _evaluate_base(run: Run, tracker: Tracker) -> None:
    """The base model's held-out scores, once per run (a resumed run keeps its checkpoint's)."""
    if "base" in run.state:
        return
    t0, env, state = time.time(), run.env, run.state
    if env.is_main:  # evaluation runs on rank 0's full (unsharded) rollout model; the others wait
        cfg = run.cfg
        state["base"], small = run.evaluate(len(run.val), subset=min(cfg.data.val_size_during_training, len(run.val)))
        console.print(f"base model {run.held} {run.how} accuracy: {_fmt(state['base'])} on {len(run.val)} problems "
                      f"({time.time() - t0:.1f}s)")
        tracker.log(0, {f"val/{k}": v for k, v in small.items()})
        state["base_room"] = run.measure_room("base model")
    barrier(env)


def _loop(run: Run, step_fn: GRPOStep, tracker: Tracker, wall_start: float) -> None:
    """Steps after the resume point, with their metrics, periodic evaluation and checkpoints."""
    cfg, env, t = run.cfg, run.env, run.cfg.trainer
    total, n_val_small = t.total_training_steps, min(cfg.data.val_size_during_training, len(run.val))
    earlier_s = float(run.state.get("wall_seconds", 0.0))  # the launches before a resume, up to their checkpoint
    strategy = resolve_strategy(cfg, env)

    def checkpoint(step: int) -> None:
        placed, state = run.placed, run.state
        save_checkpoint(cfg.checkpoint_root, step, placed.engines(), placed.tokenizer,
                        {"source": run.source.state_dict(), "trainer": placed.trainer.state_dict(),
                         "base": state.get("base"), "base_room": state.get("base_room"),
                         "wall_seconds": earlier_s + time.time() - wall_start, "strategy": strategy,
                         "ref_path": recorded_path(cfg.model.ref_path)},
                        t.max_checkpoints, env, placed.saved_elsewhere(), placed.collected_for_save())

    # off a terminal each step has its own log line, and a finished bar would only repeat the count
    with Progress(*bar_columns(), console=console, disable=not t.progress_bar or not console.is_terminal) as bar:
        task = bar.add_task(algorithm_name(cfg), total=total, completed=run.start_step)
        for step in range(run.start_step + 1, total + 1):
            if interrupted():  # a Ctrl-C whose KeyboardInterrupt a finalizer swallowed still stops the run here
                raise KeyboardInterrupt
            metrics = mean_metrics(env, step_fn.run(step))
            refit = run.watch.check() if run.watch else None
            if refit:
                console.print(refit.line(), markup=False)
            if t.test_freq and (step % t.test_freq == 0 or step == total):
                t0 = time.perf_counter()
                if env.is_main:
                    metrics.update({f"val/{k}": v for k, v in run.evaluate(n_val_small, step=step).items()})
                barrier(env)
                metrics["timing/val"] = time.perf_counter() - t0
            tracker.log(step, metrics)
            if (t.save_freq and step % t.save_freq == 0) or step == total:
                checkpoint(step)
            bar.update(task, completed=step)


def _finish(run: Run, tracker: Tracker, wall_start: float) -> dict:
    """The trained model's held-out scores against the base's, the curves, and summary.json (rank 0)."""
    cfg, val = run.cfg, run.val
    t0 = time.time()
    final = run.evaluate(len(val), step=cfg.trainer.total_training_steps)
    console.print(f"final {run.held} {run.how} accuracy: {_fmt(final)} on {len(val)} problems "
                  f"({time.time() - t0:.1f}s)")
    final_room = run.measure_room("trained model", cfg.trainer.total_training_steps)
    tracker.plot(cfg.log_root / "curves.png")
    tracker.close()
    base = run.state["base"]
    earlier_s = float(run.state.get("wall_seconds", 0.0))
    summary = {"base_accuracy": base["accuracy"], "final_accuracy": final["accuracy"],
               "gain_points": round(100 * (final["accuracy"] - base["accuracy"]), 2),
               "steps": cfg.trainer.total_training_steps,
               "heldout_problems": len(val), "wall_seconds": round(earlier_s + time.time() - wall_start, 1),
               "run_dir": str(cfg.run_dir)}
    if "accuracy_flexible" in final:
        summary.update(base_accuracy_flexible=base["accuracy_flexible"], final_accuracy_flexible=final["accuracy_flexible"],
                       gain_points_flexible=round(100 * (final["accuracy_flexible"] - base["accuracy_flexible"]), 2))
    if final_room is not None:
        summary.update(base_room=run.state.get("base_room"), final_room=final_room)
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
