"""The safety demo: its seeded world and shipped files, the base model's room to improve, the command line's
checks before training, the λ curve it reads, and a small run of the whole command."""

import json
import re

import pytest

from alignrl.config import ConfigError
from alignrl.demos import safe, safe_data
from alignrl.demos.safe_data import BENIGN, COVERED, RED_TEAM
from alignrl.preference.safety_eval import load_prompts


def test_shipped_files_are_the_seeded_world(tmp_path):
    fresh = safe_data.write_data(tmp_path, seed=0)
    shipped = safe.demo_files(0, tmp_path / "unused")
    assert set(fresh) == set(shipped) == set(safe_data.FILES)
    for key in fresh:
        assert fresh[key].read_text() == shipped[key].read_text()
    assert sum(p.stat().st_size for p in shipped.values()) < 1 << 20
    other = safe_data.write_data(tmp_path / "s1", seed=1)
    assert other["prompts"].read_text() != fresh["prompts"].read_text()  # the seed moves the split


def test_held_out_prompts_are_never_trained_on_and_cover_both_kinds():
    sft = {s.messages[-1]["content"] for s in safe_data.sft_samples(0)}
    pref = {r["prompt"] for r in safe_data.preference_rows(0)["helpful"]}
    test = [r["prompt"] for r in safe_data.heldout_prompts(0)]
    assert not (set(test) & sft) and not (set(test) & pref) and not (sft & pref)
    assert len(test) == len(set(test)) > 300
    prompts = load_prompts(str(safe.demo_files(0, None)["prompts"]))
    kinds = [p.kind for p in prompts]
    assert 0.4 < kinds.count(RED_TEAM) / len(kinds) < 0.6 and set(kinds) == {RED_TEAM, BENIGN}
    assert {p.category for p in prompts if p.kind == RED_TEAM} == set(safe_data.HARMS)


def test_sft_data_refuses_only_the_covered_harms():
    samples = safe_data.sft_samples(0)
    red = [s for s in samples if s.extra["kind"] == RED_TEAM]
    for s in red:
        refused = s.extra["answer"].startswith(safe_data.REFUSAL)
        assert refused == (s.extra["category"] in COVERED)
        assert refused or s.extra["answer"].startswith("Sure.")
    # the base model's room: about two red-team requests in five are refused
    assert 0.3 < sum(s.extra["category"] in COVERED for s in red) / len(red) < 0.6
    benign = [s for s in samples if s.extra["kind"] == BENIGN]
    assert all(s.extra["answer"] in safe_data.TASKS.values() for s in benign)


def test_preference_pairs_prefer_safe_and_helpful_answers():
    rows = safe_data.preference_rows(0)
    assert len(rows["helpful"]) == len(rows["harmless"]) > 700
    for h, s in zip(rows["helpful"], rows["harmless"]):
        assert h["prompt"] == s["prompt"] and h["chosen"] != h["rejected"] and s["chosen"] != s["rejected"]
        # no pair prefers compliance with a harmful request, on either axis
        assert not h["chosen"].startswith("Sure.") and not s["chosen"].startswith("Sure.")
        assert s["is_chosen_safe"] is True and s["is_rejected_safe"] is False
        if h["chosen"].startswith(safe_data.REFUSAL):  # a red-team prompt: the refusal that points to help wins
            assert h["rejected"] in safe_data.BARE_REFUSALS and s["rejected"].startswith("Sure.")


def test_shipped_base_model_is_its_recipe_and_bad_overrides_fail_before_training(tmp_path):
    from alignrl.demos.safe_model import SHIPPED, SafeRecipe
    from alignrl.models.tiny import demo_model_problem

    assert demo_model_problem(SHIPPED, SafeRecipe()) is None
    with pytest.raises(ConfigError, match="unrecognized argument"):
        safe.split_overrides(["--epochs"])
    assert safe.split_overrides(["epochs=1", "rm.batch_size=8"]) == (["epochs=1"], ["batch_size=8"])
    # an unknown key of the DPO run is one line before any model is copied or trained
    with pytest.raises(ConfigError, match="epoch"):
        safe.run(0, ["epoch=1"], 0, tmp_path / "run", log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_the_lambda_curve_is_read_from_the_metrics_log(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "lambda": 0.9, "loss": 0.7}) + "\n" + json.dumps({"step": 2, "loss": 0.6})
                 + "\n" + json.dumps({"step": 3, "lambda": 0.8}) + "\n" + '{"step": 4, "lamb')
    assert safe.metric_curve(f) == [(1, 0.9), (3, 0.8)]  # rows without λ and a torn last line are skipped
    assert safe.metric_curve(tmp_path / "none.jsonl") == []


@pytest.mark.slow
def test_the_demo_end_to_end_small(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    rc = safe.main(["--heldout", "24", "--run_dir", str(run_dir), "max_train_pairs=32", "epochs=1",
                    "rm.max_train_pairs=64", "rm.max_eval_pairs=32", "max_eval_pairs=16"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"base_safety_rate=\S+ final_safety_rate=\S+ gain=\S+ points base_helpfulness=\S+ "
                        r"final_helpfulness=\S+ \(\S+%\) final_lambda=\S+ wall_seconds=\d+", last)
    s = json.loads((run_dir / "summary.json").read_text())
    for key in ("base_safety_rate", "final_safety_rate", "base_helpfulness", "final_helpfulness", "wall_seconds",
                "final_lambda"):
        assert isinstance(s[key], float)
    assert s["red_team_answers"] + s["benign_answers"] == 24
    # λ moved after each of the 4 optimizer steps (2 files x 32 pairs / 16 a step) and stayed in its clamp
    curve = safe.metric_curve(run_dir / "logs" / "dpo" / "metrics.jsonl")
    assert [step for step, _ in curve] == [1, 2, 3, 4] and all(1e-6 <= v <= 10 for _, v in curve)
    assert s["final_lambda"] == curve[-1][1]
    assert (run_dir / "curves.png").stat().st_size > 0
    answers = [json.loads(x) for x in (run_dir / "eval" / "final_answers.jsonl").read_text().splitlines()]
    assert len(answers) == 24 and sum(a["safe"] for a in answers if a["kind"] == RED_TEAM) == round(
        s["final_safety_rate"] * s["red_team_answers"])
    # a second run keeps the first one, moved aside
    assert safe.main(["--heldout", "4", "--run_dir", str(run_dir), "max_train_pairs=16", "epochs=1",
                      "rm.max_train_pairs=16", "rm.max_eval_pairs=8", "max_eval_pairs=8"]) == 0
    assert len(list(tmp_path.glob("run.*"))) == 1


@pytest.mark.parametrize("argv, expect", [
    (["demo", "safe", "epoch=1"], "unknown config key 'epoch'"),
    (["demo", "safe", "rm.batch_size=0"], "batch_size=0 is out of range"),
    (["demo", "safe", "--heldout", "-2"], "--heldout must be 0"),
    (["demo", "safe", "--build-base", "x", "epochs=1"], "--build-base takes only --seed"),
])
def test_the_command_s_mistakes_are_one_line(argv, expect, cli_in_process, tmp_path):
    got = cli_in_process(*argv, "--run_dir", str(tmp_path / "run"))
    assert got.returncode == 2 and expect in got.stderr and len(got.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
