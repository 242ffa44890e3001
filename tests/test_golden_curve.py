"""A short deterministic demo run reproduces its stored per-step reward and loss curve, and learns.

The stored curve (`tests/golden/demo_curve.json`) is the one this repository's code produced. A change that
silently stops the loop from learning (a zero learning rate, a dropped advantage, a detached loss, a mask
that hides every token) moves the curve off it and fails here. When a change is meant to alter the run
(a new demo recipe, a new default), regenerate the file and commit it with the change:

    .venv/bin/python tests/test_golden_curve.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import alignrl

GOLDEN = Path(__file__).parent / "golden" / "demo_curve.json"
REGENERATE = "if this change is meant to alter training, regenerate it: .venv/bin/python tests/test_golden_curve.py"
# The demo recipe, shortened: 10 RL steps on the demo model, each on the same 16 problems x 8 samples (a
# training set of 16), so the reward measures what the previous updates taught; a constant learning rate
# without warm-up so the curve rises within those steps; a small held-out set (the base evaluation is not
# what is guarded here).
OVERRIDES = ["model.path=demo", "trainer.total_training_steps=10", "data.train_size=16", "data.train_batch_size=16",
             "actor.ppo_mini_batch_size=8", "actor.lr=1e-4", "actor.lr_warmup_steps=0", "actor.lr_scheduler=constant",
             "data.val_size=16", "data.val_size_during_training=16", "trainer.eval_pass_at_k=false",
             "trainer.test_freq=0", "trainer.save_freq=0", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
             "trainer.experiment_name=golden"]
CURVES = ("reward/mean", "actor/approx_kl", "actor/entropy", "actor/grad_norm")
# Tolerances. On one machine and torch build the run is bit-for-bit repeatable (seeded sampling, seeded
# mini-batch order, fp32). Elsewhere, a different CPU or thread count reorders float sums: a logit moves by
# ~1e-6 and, rarely, a sampled token flips, after which that row (and, through the update, later steps) differ
# a little. A flipped answer moves a step's mean reward by 1/128; 0.05 lets six of them through, while a run
# that does not learn stays near its first steps' reward. The losses' statistics are smooth in the weights:
# 30% on the policy's drift within a step (approx_kl between the rollout and the updated policy) and on the
# gradient norm, 0.03 nats on the entropy absorb a few flipped rows; a policy that does not move has an
# approx_kl orders of magnitude below the stored one.
ATOL = {"reward/mean": 0.05, "actor/approx_kl": 0.0, "actor/entropy": 0.03, "actor/grad_norm": 0.0}
RTOL = {"reward/mean": 0.0, "actor/approx_kl": 0.3, "actor/entropy": 0.0, "actor/grad_norm": 0.3}


def run_curve(out_dir: Path, extra: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Per-step values of CURVES from a fresh short demo run under `out_dir`."""
    from alignrl.runner import train_grpo
    from alignrl.config import load_config

    cfg = load_config(Path(alignrl.__file__).parent / "examples" / "demo.yaml",
                      OVERRIDES + [f"trainer.output_dir={out_dir}", *extra])
    train_grpo(cfg)
    rows = [json.loads(line) for line in (out_dir / "golden" / "logs" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {k: [float(f"{r[k]:.6g}") for r in rows] for k in CURVES}


def mismatches(fresh: dict[str, list[float]], golden: dict[str, list[float]]) -> list[str]:
    out = []
    for key in CURVES:
        if len(fresh[key]) != len(golden[key]):
            out.append(f"{key}: {len(fresh[key])} steps, stored {len(golden[key])}")
            continue
        for step, (a, b) in enumerate(zip(fresh[key], golden[key]), start=1):
            if abs(a - b) > ATOL[key] + RTOL[key] * abs(b):
                out.append(f"{key} step {step}: {a:.6g}, stored {b:.6g} (tolerance {ATOL[key]} + {RTOL[key]}×stored)")
    return out


def rise(curve: list[float]) -> float:
    """Mean of the last three steps minus mean of the first three."""
    return sum(curve[-3:]) / 3 - sum(curve[:3]) / 3


def test_fresh_run_matches_the_golden_curve_and_learns(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES, f"{GOLDEN} was made with other settings; {REGENERATE}"
    fresh = run_curve(tmp_path)
    bad = mismatches(fresh, golden["curves"])
    assert not bad, f"the run left the stored curve in {GOLDEN}:\n  " + "\n  ".join(bad) + f"\n{REGENERATE}"
    # the stored curve itself must show learning, or matching it would prove nothing
    assert rise(golden["curves"]["reward/mean"]) >= 0.1, f"{GOLDEN} shows no learning; regenerate it from a run that learns"
    assert rise(fresh["reward/mean"]) >= 0.5 * rise(golden["curves"]["reward/mean"])


def test_a_run_that_cannot_learn_leaves_the_curve(tmp_path):
    """The guard has teeth: with a zero learning rate the run leaves the stored curve. Its first five steps
    suffice (the settings have no schedule that the shorter run would change), at half the cost."""
    golden = json.loads(GOLDEN.read_text())["curves"]
    # the schema refuses 0; 1e-12 is 0 in effect
    frozen = run_curve(tmp_path, ("actor.lr=1e-12", "trainer.total_training_steps=5"))
    assert mismatches(frozen, {k: v[:5] for k, v in golden.items()})


if __name__ == "__main__":  # regenerate the stored curve
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        curves = run_curve(Path(tmp))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({"overrides": OVERRIDES, "curves": curves}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: reward/mean {curves['reward/mean']}", file=sys.stderr)
