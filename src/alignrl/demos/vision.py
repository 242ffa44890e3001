"""`alignrl demo vision`: RLOO teaches a tiny vision-language model to count what it sees (CPU, a few minutes).

    alignrl demo vision [--seed N] [--heldout N] [--train-rows N] [key.sub=value ...]

Builds (or takes from the cache) the demo's base model, a tiny Qwen2-VL SFT'd to count the red squares of a 56x56
picture with a sloppy annotator's answers (`demos/vision_model.py`); writes the task's pictures and rows (LMM-R1's
chatml layout: `message` holds the image as a content item) into the run folder; measures the base model on
held-out pictures; trains it with `alignrl train`'s loop on `examples/vision_demo.yaml` (RLOO, the R1 rule reward:
format + math-verified count); and measures the trained model the same way. Accuracy is the greedy answer's, as
the loop's held-out accuracy; beside it, from 8 samples per picture at temperature 1, the sampled accuracy (pass@1)
and pass@8. The numbers go to `<run dir>/summary.json` (`base_accuracy`, `final_accuracy`, `base_pass@8`, ...,
`seconds_per_step`, `wall_seconds`) beside the run's curves (`logs/curves.png`); the last line printed holds them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from alignrl.config import ConfigError, load_config
from alignrl.demos.common import check_overrides, raise_on_sigterm
from alignrl.demos.vision_data import SPLIT_SEEDS, pictures, write_data
from alignrl.demos.vision_model import VisionRecipe, ensure_vision_model, evaluate

PROG = "alignrl demo vision"
CONFIG = Path(__file__).resolve().parent.parent / "examples" / "vision_demo.yaml"
K = 8  # samples per held-out picture: accuracy is their mean, pass@K their best


def final_model(cfg) -> Path:
    """The last step's saved model (the loop saves it at the end whatever trainer.save_freq is)."""
    return cfg.checkpoint_root / f"global_step_{cfg.trainer.total_training_steps}" / "model"


def run(recipe: VisionRecipe, overrides: Sequence[str], heldout: int, train_rows: int, log=print) -> dict:
    """The whole demo; returns the summary (also written to `<run dir>/summary.json`)."""
    from alignrl.runner import train_grpo
    from alignrl.utils.atomic import atomic_write_text

    t0 = time.time()
    run_dir = load_config(CONFIG, list(overrides)).run_dir  # a bad override fails here, before the model build
    model = ensure_vision_model(recipe, log)
    files = write_data(run_dir / "data", recipe.seed, train_rows, heldout)
    cfg = load_config(CONFIG, [f"model.path={model}", f"data.train_files={files['train']}",
                               f"data.val_files={files['test']}", *overrides])
    held = pictures(heldout, recipe.seed * 1000 + SPLIT_SEEDS["test"])  # the pictures of files['test']
    log(f"measuring the base model on {len(held)} held-out pictures ({K} samples each)")
    base = evaluate(model, held, K, seed=recipe.seed)
    log("base model: " + _line(base))
    t_train = time.time()
    summary = train_grpo(cfg, wall_start=t0) or {}
    train_seconds = time.time() - t_train
    final = evaluate(final_model(cfg), held, K, seed=recipe.seed, processor_folder=model)
    log("trained model: " + _line(final))
    steps = cfg.trainer.total_training_steps
    summary.update({f"{when}_{k}": v for when, m in (("base", base), ("final", final)) for k, v in m.items()})
    summary.update(accuracy_gain_points=round(100 * (final["accuracy"] - base["accuracy"]), 2),
                   heldout_pictures=len(held), base_model=str(model), curves=str(cfg.log_root / "curves.png"),
                   train_seconds=round(train_seconds, 1), seconds_per_step=round(train_seconds / max(1, steps), 2),
                   wall_seconds=round(time.time() - t0, 1))
    atomic_write_text(cfg.run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _line(m: dict[str, float]) -> str:
    return (f"accuracy {m['accuracy']:.3f} (greedy), sampled {m['sampled_accuracy']:.3f} (pass@1 of {K}), "
            f"pass@{K} {m[f'pass@{K}']:.3f}, R1 format {m['format_rate']:.3f}")


def _parser():
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="RLOO teaches a tiny vision-language model to count (on CPU).")
    p.add_argument("--seed", type=int, default=0, help="seed of the pictures and the base model")
    p.add_argument("--heldout", type=int, default=200, help="held-out pictures measured before and after")
    p.add_argument("--train-rows", type=int, default=2000, help="training pictures written")
    p.add_argument("overrides", nargs="*", help="dotted overrides on top of examples/vision_demo.yaml")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    check_overrides(PROG, rest, "--seed, --heldout, --train-rows and key.sub=value overrides")
    if args.heldout < 1 or args.train_rows < 1:
        raise ConfigError(f"--heldout and --train-rows must be at least 1, got {args.heldout} and {args.train_rows}")
    raise_on_sigterm()  # `finally` blocks (the build lock, temp folders) run on a kill too
    s = run(VisionRecipe(seed=args.seed), [*args.overrides, *rest], args.heldout, args.train_rows)
    print(f"base_accuracy={s['base_accuracy']:.3f} final_accuracy={s['final_accuracy']:.3f} "
          f"gain={s['accuracy_gain_points']:+.1f} points "
          f"pass@{K}={s[f'base_pass@{K}']:.3f}->{s[f'final_pass@{K}']:.3f} "
          f"sampled={s['base_sampled_accuracy']:.3f}->{s['final_sampled_accuracy']:.3f} "
          f"steps={s.get('steps', '?')} s/step={s['seconds_per_step']:.2f} wall_seconds={s['wall_seconds']:.0f}")
    return 0
