"""`alignrl demo safe`: Safe-MM-DPO with LoRA teaches a tiny model to refuse harmful requests while it keeps
answering everyday ones (Safe RLHF's recipe, end to end on CPU).

    alignrl demo safe [--seed N] [--heldout N] [--run_dir DIR] [key=value ...] [rm.key=value ...]
    alignrl demo safe [--seed N] --build-base DIR

Takes the safety demo's base model (a tiny Qwen2 whose SFT data refused red-team requests in two harm categories
and complied in three: `demos/safe_data.py`), trains a helpfulness reward model and a harmlessness cost model on
the demo world's preference pairs (`alignrl train rm --task helpful|harmless`), measures the base model on
held-out prompts (greedy answers; safety rate over red-team prompts, mean helpfulness over everyday ones:
`alignrl.preference.safety_eval`), trains the policy with Safe-MM-DPO through LoRA adapters (`alignrl train dpo`
with `examples/preference/safe_demo_dpo.yaml`; λ moves after every step), and measures the trained policy the same way.

Everything goes under the run folder (default output/safe_demo; an earlier run there is moved aside): models/,
logs/ (each trainer's metrics.jsonl), eval/ (every judged answer), summary.json (`base_safety_rate`,
`final_safety_rate`, `base_helpfulness`, `final_helpfulness`, `final_lambda`, `wall_seconds`, ...) and curves.png
(λ over the DPO steps, the before/after bars). The last line printed holds the numbers. `key=value` overrides go to
the DPO run (e.g. epochs=1), `rm.key=value` ones to both scorer runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.demos.common import check_overrides
from alignrl.demos.safe_data import DATA_DIR, FILES, write_data
from alignrl.demos.safe_model import SafeRecipe, ensure_safe_model
from alignrl.errors import UserError

PROG = "alignrl demo safe"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RM_CONFIG, DPO_CONFIG = EXAMPLES / "preference" / "safe_demo_rm.yaml", EXAMPLES / "preference" / "safe_demo_dpo.yaml"
SHIPPED_SEED = 0  # the world whose files ship in demos/data
DEFAULT_RUN_DIR = "output/safe_demo"


class StageFailed(Exception):
    """A trainer said what went wrong (one line) and returned `code`; the demo stops with that code."""

    def __init__(self, code: int):
        super().__init__(f"exit code {code}")
        self.code = code


def demo_files(seed: int, run_dir: Path) -> dict[str, Path]:
    """The preference and prompt files of the world of `seed`: the shipped ones, or written into the run folder."""
    if seed != SHIPPED_SEED:
        return write_data(run_dir / "data", seed)
    files = {key: DATA_DIR / name for key, name in FILES.items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        from alignrl.data.loaders import DataError

        raise DataError(f"the safety demo's shipped data file {missing[0]} is missing (reinstall alignrl, or pass "
                        "--seed 1 to generate a world into the run folder)")
    return files


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(DPO overrides, scorer overrides without their `rm.` prefix)."""
    check_overrides(PROG, overrides, "--seed, --heldout, --run_dir, key=value overrides of the DPO run and "
                    "rm.key=value ones of the scorer runs")
    dpo, rm = [], []
    for o in overrides:
        (rm if o.startswith("rm.") else dpo).append(o.removeprefix("rm."))
    return dpo, rm


def stage_args(run_dir: Path, base: Path, files: dict[str, Path], dpo: list[str], rm: list[str]) -> dict[str, list]:
    """The command lines (after `alignrl train rm|dpo`) of the three training runs."""
    models, logs = run_dir / "models", run_dir / "logs"
    data = [f"model_path={base}", f"helpful_train_file={files['helpful']}",
            f"helpful_eval_file={files['helpful_test']}", f"harmless_train_file={files['harmless']}",
            f"harmless_eval_file={files['harmless_test']}"]
    out = {task: ["--config", str(RM_CONFIG), "--task", task, "--output_dir", str(models / f"{task}_rm"),
                  "--logging_dir", str(logs / f"{task}_rm"), *data, *rm] for task in ("helpful", "harmless")}
    out["dpo"] = ["--config", str(DPO_CONFIG), "--output_dir", str(models / "policy"), "--logging_dir",
                  str(logs / "dpo"), f"model_path={base}", f"helpful_rm={models / 'helpful_rm'}",
                  f"harmless_rm={models / 'harmless_rm'}", f"train_files=[{files['helpful']},{files['harmless']}]",
                  f"eval_files=[{files['helpful_test']},{files['harmless_test']}]", *dpo]
    return out


def check_stages(args: dict[str, list]) -> None:
    """Every run's config parsed and checked now (no torch): a mistaken override fails before minutes of training."""
    from alignrl.preference.cli import parse_dpo, parse_rm

    parse_rm(args["helpful"])
    parse_rm(args["harmless"])
    parse_dpo(args["dpo"])


def train(command: str, argv: list[str]) -> None:
    from alignrl.preference.cli import dpo_main, rm_main

    code = (dpo_main if command == "dpo" else rm_main)(argv)
    if code:
        raise StageFailed(code)


def fresh_run_dir(run_dir: Path, log=print) -> None:
    """An earlier run's folder is moved aside (never deleted): its models would otherwise be moved one by one."""
    if run_dir.exists() and any(run_dir.iterdir()):
        from alignrl.utils.tracking import aside

        old = aside(run_dir)
        os.replace(run_dir, old)
        log(f"{run_dir} held an earlier run: moved it to {old}")
    run_dir.mkdir(parents=True, exist_ok=True)


def metric_curve(metrics: Path, key: str = "lambda") -> list[tuple[int, float]]:
    """(step, value) of `key` at every logged step of a trainer's metrics.jsonl: the Safe-MM-DPO trainer logs λ
    after each optimizer step as `lambda`, and what moved it, J_C (the moving average of the policy's expected cost
    plus cost_threshold), as `lambda_cost_ema`."""
    from alignrl.utils.tracking import json_rows

    rows = json_rows(metrics.read_text()) if metrics.is_file() else []
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def run(seed: int, overrides: Sequence[str], heldout: int, run_dir: Path, log=print) -> dict:
    """The whole demo; returns the summary (also written to `<run dir>/summary.json`)."""
    from alignrl.preference import safety_eval as se
    from alignrl.utils.atomic import atomic_write_text

    t0 = time.time()
    dpo_over, rm_over = split_overrides(overrides)
    check_stages(stage_args(run_dir, Path("base"), {k: Path(k) for k in FILES}, dpo_over, rm_over))
    base = ensure_safe_model(SafeRecipe(seed=seed), log)
    fresh_run_dir(run_dir, log)
    files = demo_files(seed, run_dir)
    args = stage_args(run_dir, base, files, dpo_over, rm_over)
    prompts = se.load_prompts(str(files["prompts"]), heldout or None)
    for task in ("helpful", "harmless"):
        log(f"== {'helpfulness reward' if task == 'helpful' else 'harmlessness cost'} model: alignrl train rm "
            f"--task {task}")
        train("rm", args[task])
    models = run_dir / "models"
    reward, cost = str(models / "helpful_rm"), str(models / "harmless_rm")
    log(f"== the base model on {len(prompts)} held-out prompts (greedy)")
    base_rep, base_rows = se.evaluate_policies({"base": str(base)}, reward, cost, prompts, log=log)["base"]
    log("base model: " + _line(base_rep))
    log("== Safe-MM-DPO with LoRA: alignrl train dpo --config examples/preference/safe_demo_dpo.yaml")
    train("dpo", args["dpo"])
    final_rep, final_rows = se.evaluate_policies({"final": str(models / "policy")}, reward, cost, prompts,
                                                 log=log)["final"]
    log("trained model: " + _line(final_rep))
    log(se.table({"base": base_rep, "final": final_rep}))
    _write_answers(run_dir / "eval", {"base": base_rows, "final": final_rows})
    metrics = run_dir / "logs" / "dpo" / "metrics.jsonl"
    curve = metric_curve(metrics)
    summary = _summary(base_rep, final_rep, curve, run_dir, base, files)
    plot(run_dir / "curves.png", curve, metric_curve(metrics, "lambda_cost_ema"), base_rep, final_rep)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(base, final, curve: list[tuple[int, float]], run_dir: Path, base_model: Path, files: dict) -> dict:
    from alignrl.preference.safety_eval import relative_change

    change = relative_change(base.helpfulness, final.helpfulness)
    scorers = {}
    for task in ("helpful", "harmless"):
        f = run_dir / "models" / f"{task}_rm" / "eval_results.json"
        scorers[task] = json.loads(f.read_text()).get("eval_accuracy") if f.is_file() else None
    return {"base_safety_rate": round(base.safety_rate, 4), "final_safety_rate": round(final.safety_rate, 4),
            "safety_gain_points": round(100 * (final.safety_rate - base.safety_rate), 2),
            "base_helpfulness": round(base.helpfulness, 4), "final_helpfulness": round(final.helpfulness, 4),
            "helpfulness_change": round(change, 4) if math.isfinite(change) else None,  # None: a base of 0
            "final_lambda": curve[-1][1] if curve else None, "lambda_steps": len(curve),
            "base_by_kind": base.by_kind, "final_by_kind": final.by_kind,
            "base_safety_by_category": base.safety_by_category, "final_safety_by_category": final.safety_by_category,
            "decoding": base.decoding,
            "red_team_answers": base.safety_answers, "benign_answers": base.helpfulness_answers,
            "scorer_heldout_accuracy": scorers, "base_model": str(base_model), "prompts": str(files["prompts"]),
            "policy": str(run_dir / "models" / "policy"), "curves": str(run_dir / "curves.png")}


def _write_answers(folder: Path, judged: dict[str, list]) -> None:
    from dataclasses import asdict

    from alignrl.utils.atomic import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in judged.items():
        atomic_write_text(folder / f"{name}_answers.jsonl",
                          "".join(json.dumps({**asdict(r), "safe": r.safe}) + "\n" for r in rows))


def plot(path: Path, curve: list[tuple[int, float]], cost: list[tuple[int, float]], base, final) -> None:
    """λ and J_C, which moves it (λ grows while J_C > 0), over the DPO steps beside the before/after bars of safety
    rate and helpfulness, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_s, ax_h) = plt.subplots(1, 3, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2, 1, 1]})
    if curve:
        ax_l.plot(*zip(*curve), "-", color="#2a7ab0", label="λ")
    ax_l.set(xlabel="DPO optimizer step", ylabel="λ", title="Lagrange multiplier λ")
    ax_l.grid(alpha=0.3)
    if cost:
        ax_c = ax_l.twinx()
        ax_c.plot(*zip(*cost), "--", color="#c0392b", label="J_C: expected cost (EMA) + threshold")
        ax_c.axhline(0.0, color="#c0392b", lw=0.6)
        ax_c.set_ylabel("J_C", color="#c0392b")
        handles = ax_l.get_legend_handles_labels()[0] + ax_c.get_legend_handles_labels()[0]
        ax_l.legend(handles=handles, loc="center right", fontsize=8)
    bars = ((ax_s, (100 * base.safety_rate, 100 * final.safety_rate), "safety rate (%)", "{:.1f}"),
            (ax_h, (base.helpfulness, final.helpfulness), "helpfulness (mean reward)", "{:.2f}"))
    for ax, values, title, fmt in bars:
        drawn = ax.bar(["base", "final"], values, color=["#999999", "#2a7ab0"])
        for b, v in zip(drawn, values):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
        ax.set_title(title)
    ax_s.set_ylim(0, 105)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def _line(r) -> str:
    return (f"safety rate {r.safety_rate:.3f} on {r.safety_answers} red-team prompts, helpfulness "
            f"{r.helpfulness:.3f} on {r.helpfulness_answers} everyday prompts")


def _percent(change: float | None) -> str:
    return "n/a" if change is None else f"{100 * change:+.1f}%"


def _parser():
    from alignrl.runtime.one_line import OneLineParser

    p = OneLineParser(prog=PROG, description="Safe-MM-DPO with LoRA makes a tiny model refuse harm, helpfulness kept.")
    p.add_argument("--seed", type=int, default=SHIPPED_SEED, help="seed of the demo world and base model")
    p.add_argument("--heldout", type=int, default=0, help="held-out prompts measured before and after; 0: all")
    p.add_argument("--run_dir", default=DEFAULT_RUN_DIR, help="where models, logs and the summary go")
    p.add_argument("--build-base", metavar="DIR", default=None,
                   help="only (re)build the base model of --seed into DIR from its seed, then exit (the shipped "
                        "one is src/alignrl/demos/data/safe_base)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the DPO run, rm.key=value of the scorer runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.heldout < 0:
        raise ConfigError(f"--heldout must be 0 (all) or more, got {args.heldout}")
    if args.build_base:
        from alignrl.demos.safe_model import build_safe_model

        if args.overrides or rest:
            raise ConfigError("--build-base takes only --seed (the base model's recipe has no overrides)")
        build_safe_model(Path(args.build_base), SafeRecipe(seed=args.seed))
        return 0
    try:
        s = run(args.seed, [*args.overrides, *rest], args.heldout, Path(args.run_dir))
    except StageFailed as e:  # the trainer printed its one line already
        return e.code
    lam = "n/a" if s["final_lambda"] is None else f"{s['final_lambda']:.4g}"
    print(f"base_safety_rate={s['base_safety_rate']:.3f} final_safety_rate={s['final_safety_rate']:.3f} "
          f"gain={s['safety_gain_points']:+.1f} points base_helpfulness={s['base_helpfulness']:.3f} "
          f"final_helpfulness={s['final_helpfulness']:.3f} ({_percent(s['helpfulness_change'])}) "
          f"final_lambda={lam} wall_seconds={s['wall_seconds']:.0f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
