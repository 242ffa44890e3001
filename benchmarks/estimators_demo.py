#!/usr/bin/env python
"""Every advantage estimator on the demo: held-out gains, strict and last-number, one run each.

    python benchmarks/estimators_demo.py [--only grpo,rloo] [--out output/estimators] [key=value ...]

Each run is `alignrl demo` (the demo config, the same base model, data and step budget) with only the
estimator's keys changed; extra `key=value` overrides apply to every run (e.g. trainer.total_training_steps=50
for a quicker look). Prints one row per estimator and a Markdown table for docs/algorithms.md.
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
}


def run(name: str, keys: list[str], out: Path, extra: list[str]) -> dict:
    from alignrl.runner import train_grpo
    from alignrl.config import load_config

    slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
    cfg = load_config(Path(alignrl.__file__).parent / "examples" / "demo.yaml",
                      keys + [f"trainer.output_dir={out}", f"trainer.experiment_name={slug}",
                              "trainer.progress_bar=false", "trainer.resume_mode=disable", *extra])
    t0 = time.time()
    summary = train_grpo(cfg, wall_start=t0)
    return {"estimator": name, **{k: summary[k] for k in ("base_accuracy", "final_accuracy", "gain_points",
                                                           "base_accuracy_flexible", "final_accuracy_flexible",
                                                           "gain_points_flexible", "steps")},
            "seconds": round(time.time() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(ESTIMATORS))
    ap.add_argument("--out", default="output/estimators")
    ap.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(ESTIMATORS)
    unknown = [n for n in names if n not in ESTIMATORS]
    if unknown:
        raise SystemExit(f"unknown estimator {unknown[0]!r}; choose from {', '.join(ESTIMATORS)}")
    out = Path(args.out)
    rows = []
    for name in names:
        rows.append(run(name, ESTIMATORS[name], out, args.overrides))
        r = rows[-1]
        print(f"{name:14s} strict {r['base_accuracy']:.3f} -> {r['final_accuracy']:.3f} ({r['gain_points']:+.1f}) "
              f"last-number {r['base_accuracy_flexible']:.3f} -> {r['final_accuracy_flexible']:.3f} "
              f"({r['gain_points_flexible']:+.1f})  {r['steps']} steps, {r['seconds']}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimators.json").write_text(json.dumps(rows, indent=2))
    print("\n| estimator | strict gain (points) | last-number gain (points) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['estimator']} | {r['gain_points']:+.1f} | {r['gain_points_flexible']:+.1f} |")


if __name__ == "__main__":
    main()
