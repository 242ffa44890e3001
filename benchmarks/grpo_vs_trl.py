#!/usr/bin/env python
"""Seconds per GRPO step: alignrl vs TRL's `GRPOTrainer`, same workload, alternating in one process.

    pip install -c constraints.txt -e '.[bench]'        # trl, datasets, accelerate
    python benchmarks/grpo_vs_trl.py                    # 8 rounds, 16 prompts x 8 samples, 32 new tokens
    python benchmarks/grpo_vs_trl.py --steps 3 --prompts 4 --n 4 --max-new-tokens 16   # quick check

TRL's `trainer.train()` drives the run; a `TrainerCallback` times each TRL step (`on_step_begin` ->
`on_step_end`: generation, reward, reference log-probs, advantages, forward/backward, clip, optimizer
step) and, right after it, runs and times one alignrl step (`RolloutMaker.make` then `PolicyTrainer.train`, plus templating the step's
prompts, which TRL also does inside its step). So the two alternate TRL, alignrl, TRL, alignrl, ... and
share whatever else the machine is doing. The first step of each is warm-up and left out of the medians.
Both run in one process with the same torch thread count (--threads). On a CPU shared with other
busy processes, more torch threads than free cores makes step times swing by up to 10x: give --threads
no more than the idle cores, and read the per-round columns, not only the medians.

Same on both sides:
  * model: one HF folder (default: the demo base model of `alignrl demo`, built once and cached
    under $ALIGNRL_CACHE; or --model PATH), loaded separately for each framework; fp32; each side has its
    own frozen reference copy of the same weights (KL coefficient --beta, default 0.001).
  * prompts: the same synthetic arithmetic problems, the same P prompts at step k on both sides
    (TRL: shuffle_dataset=False; alignrl: problems (k-1)*P .. k*P-1), chat template with generation prompt.
  * sampling: n completions per prompt (group size), temperature 1.0, no top-k / top-p, at most
    --max-new-tokens tokens, stop at eos.
  * reward: alignrl's `default_compute_score` (GSM8K-style correctness); advantages normalised by the
    group std; PPO-clip 0.2; token-mean loss over the whole batch (TRL loss_type="dapo"); KL k3 to the
    reference (TRL use_bias_correction_kl=False, the plain k3 term); lr 1e-5 constant, no warm-up, no
    weight decay, grad-norm clip 1.0.
  * batch: one generation of P*n sequences and exactly one optimizer step per step (alignrl:
    train_batch_size = ppo_mini_batch_size = P, ppo_epochs 1; TRL: per_device_train_batch_size = P*n,
    gradient_accumulation_steps 1, steps_per_generation 1, num_iterations 1). The gradient is the same
    token-mean over the whole batch on both sides; how it is computed differs (below).
  * old log-probs: TRL does not recompute them in this on-policy setting (it uses the current
    log-probs, detached); alignrl is set to match with actor.recompute_old_logprobs=false (it uses the
    rollout engine's log-probs of the same fp32 model), so neither side spends an extra forward on them.
  * no gradient checkpointing (TRL's default is on; turned off), no vLLM, no logging, no checkpoints, no
    evaluation.

Remaining differences (inherent to the frameworks, part of what is measured):
  * forward layout: alignrl runs as the demo recipe does, with each prompt going through the model once
    for its n samples (actor.share_prompt; its keys and values are the responses' cache, gradients flow
    back through them) and the real tokens of a micro-batch packed into one row (actor.use_remove_padding);
    both change only float rounding. `--no-share-prompt` and `--no-remove-padding` turn them off.
  * padding: alignrl accumulates the batch in length-grouped micro-batches of --micro-batch sequences
    (default 32) for the reference forward and the forward/backward; TRL runs the whole P*n batch at
    once, padded to its longest sequence. `--micro-batch 0` makes alignrl take the whole batch at once.
  * generation: TRL calls `model.generate` (keeps finished rows in the batch until all stop); alignrl uses
    its own KV-cache sampler that drops finished rows and decodes the samples that drew the same tokens so far
    once (rollout.hf_engine). Completions are sampled, so their lengths differ
    run to run and side to side; the mean completion length of each side is printed to show the work done
    was comparable.
  * threads: with two or more torch threads, alignrl runs the update's micro-batches in two lanes of half the
    threads each (trainer.cpu_lanes, its default; docs/runs.md), TRL each op on all of them. `--cpu-lanes 1`
    turns the lanes off.
  * optimizer implementation: TRL uses the Trainer's default AdamW (`adamw_torch_fused` on torch >= 2.8),
    alignrl `torch.optim.AdamW(foreach=True)`; same hyper-parameters.
  * TRL's step also includes its Trainer bookkeeping (metric gathering, flops/token counting); the
    Trainer's dataloader fetch for a step happens just before `on_step_begin` and is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="GRPO steps of each framework (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion length limit")
    p.add_argument("--model", type=str, default=None,
                   help="HF model folder (default: the demo base model, built once and cached)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 keeps torch's default)")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (reference model on both sides)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=32,
                   help="alignrl sequences per forward/backward (length-grouped); 0 = the whole batch at once as TRL")
    p.add_argument("--no-share-prompt", dest="share_prompt", action="store_false",
                   help="run every sequence's prompt through the model (alignrl's actor.share_prompt=false)")
    p.add_argument("--no-remove-padding", dest="remove_padding", action="store_false",
                   help="forward padded micro-batches (alignrl's actor.use_remove_padding=false)")
    p.add_argument("--cpu-lanes", type=int, default=2,
                   help="alignrl's trainer.cpu_lanes: micro-batches side by side on a CPU (1: one at a time)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.prompts < 1 or a.max_new_tokens < 1:
        p.error("--steps, --prompts and --max-new-tokens must be >= 1")
    if a.n < 2:
        p.error("--n must be >= 2 (TRL's GRPO needs at least 2 completions per prompt)")
    return a


def prepare_model(args) -> Path:
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            sys.exit(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
        return path
    from alignrl.models.tiny import ensure_demo_model

    return ensure_demo_model(log=lambda m: print(m, flush=True))


def alignrl_side(model_dir: Path, samples, args):
    """The in-process producer and trainer, placed as `alignrl.runner.train_grpo` does, configured for the
    shared workload."""
    from alignrl.placements.local import place
    from alignrl.data.prompts import PromptData
    from alignrl.config import load_config

    P, n = args.prompts, args.n
    cfg = load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32",
        f"data.train_batch_size={P}", "data.max_prompt_length=128",
        f"rollout.n={n}", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=-1",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"actor.ppo_mini_batch_size={P}", f"actor.ppo_micro_batch_size={args.micro_batch or P * n}", "actor.ppo_epochs=1",
        f"actor.logprob_micro_batch_size={P * n}",  # the reference forward: the whole batch at once, as TRL's
        f"actor.lr={args.lr}", "actor.lr_warmup_steps=0", "actor.lr_scheduler=constant", "actor.weight_decay=0.0",
        "actor.grad_clip=1.0", "actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.2", "actor.entropy_coeff=0.0",
        f"actor.use_kl_loss={'true' if args.beta > 0 else 'false'}", f"actor.kl_loss_coef={args.beta}",
        "actor.kl_loss_type=low_var_kl", "actor.recompute_old_logprobs=false",
        "algorithm.norm_adv_by_std_in_grpo=true", f"trainer.seed={args.seed}",
        f"actor.share_prompt={str(args.share_prompt).lower()}",
        f"actor.use_remove_padding={str(args.remove_padding).lower()}",
        f"trainer.cpu_lanes={args.cpu_lanes}",
    ])
    placed = place(cfg, str(model_dir))
    rows = PromptData(placed.tokenizer, samples, cfg.data.max_prompt_length)

    def run(k: int) -> dict:
        """alignrl RL step k (1-based) on problems (k-1)*P .. k*P-1: the producer's batch, then the update."""
        batch = placed.maker.make(k, range((k - 1) * P, k * P), rows)
        return {**batch.metrics, **placed.trainer.train(k, batch)}

    return run


def trl_reward():
    from alignrl.rewards.registry import default_compute_score

    def correctness(completions, ground_truth, data_source, **kwargs) -> list[float]:
        return [default_compute_score(ds, c[0]["content"] if isinstance(c, list) else c, gt)
                for c, gt, ds in zip(completions, ground_truth, data_source)]

    return correctness


def trl_side(model_dir: Path, samples, args, callback, out_dir: str):
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    P, n = args.prompts, args.n
    wanted = dict(
        output_dir=out_dir, seed=args.seed, use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": "float32"},
        # one generation of P*n sequences and one optimizer step per Trainer step
        per_device_train_batch_size=P * n, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=n, max_steps=args.steps, shuffle_dataset=False,
        # sampling
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        max_prompt_length=128,  # only in older TRL versions; the prompts are shorter anyway
        use_vllm=False, use_transformers_continuous_batching=False,
        # objective and optimizer
        beta=args.beta, loss_type="dapo", scale_rewards="group", epsilon=0.2, use_bias_correction_kl=False,
        mask_truncated_completions=False, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, gradient_checkpointing=False,
        # nothing else: no logging, saving, evaluation
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False, remove_unused_columns=False, dataloader_num_workers=0,
    )
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(k for k in wanted if k not in known)
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})

    dataset = Dataset.from_dict({"prompt": [s.messages for s in samples],
                                 "ground_truth": [s.ground_truth for s in samples],
                                 "data_source": [s.data_source for s in samples]})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left", truncation_side="left")
    threads = torch.get_num_threads()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=trl_reward(), args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
    torch.set_num_threads(threads)  # in case anything in the set-up changed it
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    # Record what each generation is asked for, so the callback can check the workload matches alignrl's.
    generate = getattr(trainer, "_generate_and_score_completions", None)
    if generate is not None:
        def recorded(inputs, *a, **kw):
            out = generate(inputs, *a, **kw)
            callback.trl_generations.append(([x["prompt"][-1]["content"] for x in inputs],
                                             "old_per_token_logps" in out, "ref_per_token_logps" in out))
            return out

        trainer._generate_and_score_completions = recorded
    wrap_phase_timers(trainer, callback.trl_phases)
    return trainer, dropped


def wrap_phase_timers(trainer, phases: dict) -> None:
    """Adds each TRL step's seconds in generation (its `_generate` call), in log-prob forwards without a graph
    (the reference's) and in the whole generate-and-score stage to `phases`; the update is the step's rest."""
    import torch

    def timed(name: str, fn, key=None):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            k = key() if key else name
            phases[k] = phases.get(k, 0.0) + time.perf_counter() - t0
            return out
        return run

    if hasattr(trainer, "_generate"):
        trainer._generate = timed("gen", trainer._generate)
    if hasattr(trainer, "_get_per_token_logps_and_entropies"):
        trainer._get_per_token_logps_and_entropies = timed(
            "", trainer._get_per_token_logps_and_entropies,
            key=lambda: "logp_forward" if torch.is_grad_enabled() else "ref")
    if hasattr(trainer, "_generate_and_score_completions"):
        trainer._generate_and_score_completions = timed("stage", trainer._generate_and_score_completions)


def make_callback(alignrl_run, samples, bench):
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        """Times each TRL step, then runs and times one alignrl step."""

        def __init__(self):
            self.trainer = None
            self.rows: list[dict] = []
            # (prompts, recomputed old log-probs?, reference log-probs?) per TRL generation, from a wrapper
            self.trl_generations: list[tuple[list[str], bool, bool]] = []
            self.mismatches: list[str] = []
            self.trl_phases: dict[str, float] = {}  # this step's seconds by phase (`wrap_phase_timers`)
            self.checked = 0
            self._t0 = 0.0

        def check_workload(self, k: int) -> None:
            """TRL generated exactly once this step, for the same P prompts x n as alignrl's step k."""
            gens, self.trl_generations = self.trl_generations, []
            mine = [s.messages[-1]["content"] for s in samples[(k - 1) * bench.prompts: k * bench.prompts]]
            self.checked += 1
            if len(gens) != 1:
                self.mismatches.append(f"step {k}: TRL generated {len(gens)} times")
                return
            prompts, old_lp, ref_lp = gens[0]
            if sorted(prompts) != sorted(c for c in mine for _ in range(bench.n)):
                self.mismatches.append(f"step {k}: TRL's prompts differ from alignrl's")
            if old_lp:
                self.mismatches.append(f"step {k}: TRL recomputed old log-probs (alignrl does not)")
            if ref_lp != (bench.beta > 0):
                self.mismatches.append(f"step {k}: TRL reference log-probs {'present' if ref_lp else 'missing'}")

        def on_step_begin(self, args, state, control, **kwargs):
            self.trl_phases.clear()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            trl_s = time.perf_counter() - self._t0
            trl_len = float("nan")
            if self.trainer is not None:
                lens = self.trainer._metrics.get("train", {}).get("completions/mean_length") or []
                trl_len = lens[-1] if lens else float("nan")
            k = len(self.rows) + 1
            if self.trainer is not None and hasattr(self.trainer, "_generate_and_score_completions"):
                self.check_workload(k)
            t0 = time.perf_counter()
            m = alignrl_run(k)
            al_s = time.perf_counter() - t0
            row = {"round": k, "trl": trl_s, "alignrl": al_s, "trl_len": trl_len,
                   "alignrl_len": m["response/length_mean"], "alignrl_acc": m["reward/accuracy"],
                   "phases": {"trl": trl_split(self.trl_phases, trl_s), "alignrl": alignrl_split(m, al_s)}}
            self.rows.append(row)
            print(f"{k:>5}  {trl_s:>9.3f}  {al_s:>9.3f}  {trl_len:>12.1f}  {row['alignrl_len']:>12.1f}"
                  f"{'   (warm-up, not in medians)' if k == 1 and bench.steps > 1 else ''}", flush=True)

    return Alternate()


PHASES = ("generation", "reference", "update", "other")


def trl_split(ph: dict, total: float) -> dict:
    gen, ref, stage = ph.get("gen", 0.0), ph.get("ref", 0.0), ph.get("stage", 0.0)
    return {"generation": gen, "reference": ref, "update": total - stage, "other": stage - gen - ref}


def alignrl_split(m: dict, total: float) -> dict:
    gen, ref, upd = m.get("timing/gen", 0.0), m.get("timing/ref", 0.0), m.get("timing/train", 0.0)
    return {"generation": gen, "reference": ref, "update": upd, "other": total - gen - ref - upd}


def print_phases(timed: list[dict]) -> None:
    """Median seconds per step of each phase (the update: forward, backward, clip, optimizer step; other:
    reward, advantages, templating, bookkeeping)."""
    print(f"\n{'where the seconds go':<21}" + "".join(f"{p:>12}" for p in PHASES))
    for fw in ("alignrl", "trl"):
        med = {p: statistics.median(r["phases"][fw][p] for r in timed) for p in PHASES}
        print(f"{fw:<21}" + "".join(f"{med[p]:>12.3f}" for p in PHASES))


def summarise(rows: list[dict]) -> None:
    timed = rows[1:] if len(rows) > 1 else rows
    if len(rows) == 1:
        print("note: only one step per framework, so the warm-up step is included")
    print()
    print(f"{'framework':<10} {'median s/step':>14} {'min':>9} {'max':>9} {'steps':>6} {'mean len':>9}")
    med = {}
    for fw in ("alignrl", "trl"):
        xs = [r[fw] for r in timed]
        med[fw] = statistics.median(xs)
        lens = [r[f"{fw}_len"] for r in timed]
        print(f"{fw:<10} {med[fw]:>14.3f} {min(xs):>9.3f} {max(xs):>9.3f} {len(xs):>6} "
              f"{statistics.fmean(lens):>9.1f}")
    print_phases(timed)
    ratio = med["trl"] / med["alignrl"]
    verdict = "alignrl faster" if ratio > 1 else ("TRL faster" if ratio < 1 else "tie")
    print(f"ratio trl/alignrl = {ratio:.2f}x ({verdict})")


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    import trl

    from alignrl.data import synthetic

    model_dir = prepare_model(args)
    samples = synthetic.generate("train", args.steps * args.prompts, seed=args.seed)

    t0 = time.perf_counter()
    alignrl_run = alignrl_side(model_dir, samples, args)
    callback = make_callback(alignrl_run, samples, args)
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl.") as out_dir:
        trainer, dropped = trl_side(model_dir, samples, args, callback, out_dir)
        callback.trainer = trainer
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(f"model {model_dir} ({n_params / 1e6:.2f}M params, fp32); set-up {time.perf_counter() - t0:.1f}s")
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
              f"{torch.get_num_threads()} torch threads")
        print(f"workload per step: {args.prompts} prompts x {args.n} samples = {args.prompts * args.n} sequences, "
              f"<= {args.max_new_tokens} new tokens, 1 optimizer step, KL beta {args.beta}, lr {args.lr}")
        if dropped:
            print(f"(GRPOConfig of this TRL has no {', '.join(dropped)}: left out)")
        print(f"\n{'round':>5}  {'trl s':>9}  {'alignrl s':>9}  {'trl mean len':>12}  {'alignrl len':>12}")
        trainer.train()
    if len(callback.rows) != args.steps:
        sys.exit(f"expected {args.steps} rounds, got {len(callback.rows)}")
    for m in callback.mismatches:
        print(f"WORKLOAD MISMATCH: {m}")
    if callback.checked == args.steps and not callback.mismatches:
        print("\nworkload check: every step, TRL generated once for the same prompts x n as alignrl, "
              f"{'with' if args.beta > 0 else 'without'} reference log-probs and without recomputing old log-probs")
    summarise(callback.rows)


if __name__ == "__main__":
    main()
