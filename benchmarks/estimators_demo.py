#!/usr/bin/env python
"""Every advantage estimator (or, with --losses, every policy loss) on the demo: held-out gains, strict and
last-number, and the policy's entropy at the end, one run each.

    python benchmarks/estimators_demo.py [--only GRPO,RLOO] [--out output/estimators] [key=value ...]
    python benchmarks/estimators_demo.py --losses [--only clip_cov,sapo] [key=value ...]

Each run is `alignrl demo` (the demo config, the same base model, data and step budget) with only the
estimator's (or loss's) keys changed; extra `key=value` overrides apply to every run (e.g.
trainer.total_training_steps=50 for a quicker look). Prints one row per run and a Markdown table for
docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import alignrl

# The estimator's own keys on top of the demo config (the demo's GRPO recipe otherwise: batch, lr schedule,
# temperature, steps). PPO's critic starts from the base model with a new value head and warms up first.
ESTIMATORS = {
    "GRPO": ["algorithm.adv_estimator=grpo"],
    "Dr.GRPO": ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
                "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    "RLOO": ["algorithm.adv_estimator=rloo"],
    "REINFORCE++": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "PPO (critic)": ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.lr=1e-4", "critic.warmup_steps=5"],
    # TRL's RLOO (`alignrl train rloo`'s recipe): the k1 KL in the reward at its beta 0.05, PPO's clip on each
    # answer's whole likelihood ratio, one optimizer step per batch as TRL's default
    "RLOO (TRL's)": ["algorithm.adv_estimator=rloo", "actor.policy_loss=seq_ppo_clip",
                     "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.05", "algorithm.kl_penalty=k1",
                     "actor.ppo_mini_batch_size=32", "actor.recompute_old_logprobs=true"],
    # TRL's online DPO: two answers a prompt, so four times the prompts for the same samples a step, in one
    # optimizer step (its update is the DPO loss's gradient at the weights that scored the batch)
    "Online DPO": ["algorithm.adv_estimator=online_dpo", "rollout.n=2", "data.train_batch_size=128",
                   "actor.ppo_mini_batch_size=128", "actor.recompute_old_logprobs=true"],
    # TRL's XPO: online DPO whose second answer of each prompt is the reference model's, with its exploration term
    # at XPOConfig's alpha
    "XPO": ["algorithm.adv_estimator=xpo", "rollout.n=2", "data.train_batch_size=128", "actor.ppo_mini_batch_size=128",
            "actor.recompute_old_logprobs=true"],
    # SPIN: the training rows' correct worked solutions (`spin_targets`) chosen over the opponent's answers, the
    # opponent (the reference) replaced by the policy every 60 steps: four of SPIN's iterations; at the demo's lr
    # (1e-4) both answers' likelihoods collapsed (held-out 0.14 at step 40), so a tenth of it
    "SPIN": ["algorithm.adv_estimator=spin", "rollout.n=2", "data.train_batch_size=128",
             "actor.ppo_mini_batch_size=128", "actor.recompute_old_logprobs=true", "actor.ref_sync_steps=60",
             "actor.ref_mixup_alpha=1.0", "actor.lr=1e-5"],
    # TRL's Nash-MD: the policy's answer against one of the geometric mixture of policy and reference (its 0.5)
    "Nash-MD": ["algorithm.adv_estimator=nash_md", "rollout.n=2", "data.train_batch_size=128",
                "actor.ppo_mini_batch_size=128", "actor.recompute_old_logprobs=true"],
}
# The policy losses with the demo's GRPO advantages; the settings are each method's paper's (or verl's) defaults,
# except Clip-Cov's and KL-Cov's share of tokens: the demo's micro-batches hold a few hundred response tokens, where
# 2e-4 of them is a single token (the least), so 1e-2 (a few tokens each) is used.
LOSSES = {
    "ppo_clip": ["actor.policy_loss=ppo_clip"],
    "clip_cov": ["actor.policy_loss=clip_cov", "actor.clip_cov_ratio=1e-2"],
    "kl_cov": ["actor.policy_loss=kl_cov", "actor.kl_cov_ratio=1e-2"],
    "sapo": ["actor.policy_loss=sapo"],
    "dppo_tv": ["actor.policy_loss=dppo_tv"],
    "dppo_kl": ["actor.policy_loss=dppo_kl"],
    "gspo": ["actor.policy_loss=gspo", "actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4"],
}


def spin_targets(out: Path) -> list[str]:
    """SPIN's training rows: the demo's training problems with their correct worked solutions as the targets (the
    demo's base model was fine-tuned on solutions that add what a "gives away" step gives: models/tiny.py)."""
    from alignrl.data.synthetic import DATA_SOURCE, generate

    path = out / "spin_targets.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": s.messages, "answer": s.extra["answer"], "data_source": DATA_SOURCE})
                            + "\n" for s in generate("train", 20000)))
    return [f"data.train_files={path}", "data.prompt_key=prompt", "data.label_key=answer"]


def run(name: str, keys: list[str], out: Path, extra: list[str]) -> dict:
    from alignrl.runner import train_grpo
    from alignrl.config import load_config

    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    cfg = load_config(Path(alignrl.__file__).parent / "examples" / "demo.yaml",
                      keys + [f"trainer.output_dir={out}", f"trainer.experiment_name={slug}",
                              "trainer.progress_bar=false", "trainer.resume_mode=disable", *extra])
    t0 = time.time()
    summary = train_grpo(cfg, wall_start=t0)
    logged = [json.loads(x) for x in (out / slug / "logs" / "metrics.jsonl").read_text().splitlines()]
    entropy = [r["actor/entropy"] for r in logged if "actor/entropy" in r]
    return {"estimator": name, **{k: summary[k] for k in ("base_accuracy", "final_accuracy", "gain_points",
                                                           "base_accuracy_flexible", "final_accuracy_flexible",
                                                           "gain_points_flexible", "steps")},
            "entropy_first": entropy[0], "entropy_last": entropy[-1], "seconds": round(time.time() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--losses", action="store_true", help="compare the policy losses instead of the estimators")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(ESTIMATORS) + " (with "
                    "--losses: " + ", ".join(LOSSES) + ")")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = ap.parse_args()
    table = LOSSES if args.losses else ESTIMATORS
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown {'loss' if args.losses else 'estimator'} {unknown[0]!r}; choose from "
                         f"{', '.join(table)}")
    out = Path(args.out or ("output/losses" if args.losses else "output/estimators"))
    rows = []
    for name in names:
        rows.append(run(name, table[name] + (spin_targets(out) if name == "SPIN" else []), out, args.overrides))
        r = rows[-1]
        print(f"{name:14s} strict {r['base_accuracy']:.3f} -> {r['final_accuracy']:.3f} ({r['gain_points']:+.1f}) "
              f"last-number {r['base_accuracy_flexible']:.3f} -> {r['final_accuracy_flexible']:.3f} "
              f"({r['gain_points_flexible']:+.1f})  entropy {r['entropy_first']:.3f} -> {r['entropy_last']:.3f}  "
              f"{r['steps']} steps, {r['seconds']}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("losses.json" if args.losses else "estimators.json")).write_text(json.dumps(rows, indent=2))
    print(f"\n| {'loss' if args.losses else 'estimator'} | strict gain (points) | last-number gain (points) | "
          "entropy first -> last step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['estimator']} | {r['gain_points']:+.1f} | {r['gain_points_flexible']:+.1f} | "
              f"{r['entropy_first']:.3f} -> {r['entropy_last']:.3f} |")


if __name__ == "__main__":
    main()
