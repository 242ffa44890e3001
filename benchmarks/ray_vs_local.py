"""Seconds per GRPO step of the same tiny run in one process, under torchrun, and on Ray (one node),
in one command; Ray's overhead printed as a ratio.

    python benchmarks/ray_vs_local.py             # demo model, 6 steps of 4 prompts x 4, <= 16 tokens
    python benchmarks/ray_vs_local.py --steps 10 --prompts 8 --n 8

Workload: the same model (`--model`, default the embedded demo model), data, seed, learning rate and
loss, `--steps` RL steps of `--prompts` prompts x `--n` samples, one optimizer step per RL step, a
reference model for the KL loss, no intermediate evaluation or checkpoints. Configurations, each a fresh
process tree:

    in-process   `alignrl train grpo` (one process: generation, reference and training share it)
    torchrun     `alignrl train grpo --nproc 2` (two DDP ranks, each generating its half)
    ray          `alignrl train ppo-ray` on a local one-node Ray: 2 actor ranks, 1 reference worker,
                 1 rollout engine (the engine generates the whole batch; weights are broadcast to it
                 after every step)

What is measured: the mean of the trainer's own `timing/step` rows in metrics.jsonl over steps 2..S
(step 1 is warm-up; process and cluster start-up, model loading and evaluation are not counted), and the
whole command's wall time for reference. Every process gets OMP_NUM_THREADS=1. On a shared or 2-core
machine the numbers are noisy and the Ray run has more processes than cores: read the ratio as an upper
bound of Ray's overhead for a tiny model, where the fixed per-step costs (object store, weight
broadcast, actor calls) weigh most.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def common(args, out: Path, name: str) -> list[str]:
    return [f"model.path={args.model}", "data.train_size=256", "data.val_size=8", "data.val_size_during_training=8",
            f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"actor.ppo_mini_batch_size={args.prompts}", f"actor.ppo_micro_batch_size={args.prompts * args.n // 2}",
            "actor.kl_loss_coef=0.01", f"trainer.total_training_steps={args.steps}", "trainer.test_freq=0",
            "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.threads=1",
            f"trainer.output_dir={out}", f"trainer.experiment_name={name}", "trainer.resume_mode=disable"]


def ray_flags(args, out: Path) -> list[str]:
    return ["--pretrain", args.model, "--save_path", str(out / "ray"), "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "2", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", str(args.n),
            "--rollout_batch_size", str(args.prompts), "--train_batch_size", str(args.prompts * args.n),
            "--micro_train_batch_size", str(args.prompts * args.n // 2), "--generate_max_len",
            str(args.max_new_tokens), "--max_samples", "256", "--prompt_max_len", "128", "--use_kl_loss", "--init_kl_coef", "0.01",
            "--kl_estimator", "k3", "--actor_learning_rate", "1e-6", "--val_size", "8", "--total_steps",
            str(args.steps), "--seed", "0"]


def run(cmd: list[str], log: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("RAY_ADDRESS", None)  # one local node, started by the run itself
    t0 = time.time()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        sys.exit(f"{' '.join(cmd[:6])} ... failed (exit {code}); its output is in {log}")
    return time.time() - t0


def step_seconds(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["timing/step"] for r in rows if "timing/step" in r][1:]
    return sum(steps) / len(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="ray_vs_local_"))
    alignrl = [sys.executable, "-m", "alignrl"]
    configs = {
        "in-process": ([*alignrl, "train", "grpo", *common(args, out, "local")], "local"),
        "torchrun x2": ([*alignrl, "train", "grpo", "--nproc", "2", *common(args, out, "torchrun")], "torchrun"),
        "ray (1 node)": ([*alignrl, "train", "ppo-ray", *ray_flags(args, out)], "ray"),
    }
    results = {}
    for name, (cmd, folder) in configs.items():
        wall = run(cmd, out / f"{folder}.log")
        results[name] = (step_seconds(out / folder), wall)
        print(f"{name:14s} {results[name][0]:.3f} s/step (steps 2..{args.steps}), command wall {wall:.1f} s", flush=True)
    base = results["in-process"][0]
    print(f"\nRay's overhead: {results['ray (1 node)'][0] / base:.2f}x the in-process seconds per step, "
          f"{results['ray (1 node)'][0] / results['torchrun x2'][0]:.2f}x torchrun's "
          f"(torchrun {results['torchrun x2'][0] / base:.2f}x in-process); logs in {out}")


if __name__ == "__main__":
    main()
