"""Rule rewards under a time limit (algorithm.reward_timeout_s, verl's prime reward manager): rows scored side by
side in forked workers, a row past the limit scored 0 and counted while its worker is replaced, a row whose function
raises or whose worker dies is one line naming the row, and a run whose reward never returns still trains."""

import json
import os
import time

import pytest

from alignrl.config import load_config
from alignrl.data.records import Sample
from alignrl.rewards.registry import ScoreError, load_reward_fn
from alignrl.rewards.timed_rules import TimedRule, late_rows, timed
from alignrl.rl.scoring import rule_scores
from alignrl.runner import train_grpo
from smallrun import overrides


def _stalls(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "stall":
        time.sleep(120)  # a rule that never returns on one odd response
    if solution_str == "die":
        os._exit(3)  # a worker killed from outside, as the kernel's OOM killer would
    return float(solution_str == ground_truth)


def _rows(texts):
    return [Sample(f"q{i}", "7", "gsm8k", {}) for i in range(len(texts))]


def test_a_row_past_the_limit_scores_zero_and_the_others_are_scored(tmp_path):
    rule = timed(_stalls, 1.0, workers=2)
    texts = ["7", "stall", "8", "7"]
    assert rule_scores(rule, "reward function", _rows(texts), texts) == [1.0, 0.0, 0.0, 1.0]
    assert late_rows([rule, rule, None]) == 1 and late_rows([rule]) == 0  # counted once, then taken
    assert rule_scores(rule, "reward function", _rows(["7"]), ["7"]) == [1.0]  # the replaced worker scores on
    assert rule("x", "7", "7") == 1.0  # called as a function: here, as it is
    assert late_rows([_stalls]) is None and timed(_stalls, 0.0) is _stalls


def test_a_raising_function_and_a_dead_worker_are_one_line_naming_the_row(tmp_path):
    reward = tmp_path / "rw.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if solution_str == 'bad':\n        raise ValueError('cannot parse')\n"
                      "    return 1.0\n")
    rule = TimedRule(load_reward_fn(f"{reward}:compute_score"), 5.0, workers=2)  # registered after workers started
    texts = ["ok", "bad", "ok"]
    with pytest.raises(ScoreError, match=r"raised ValueError: cannot parse for row 1 \(data_source gsm8k\)") as e:
        rule_scores(rule, "reward function", _rows(texts), texts)
    assert "\n" not in str(e.value)
    dying = timed(_stalls, 5.0, workers=1)
    with pytest.raises(ScoreError, match=r"lost its worker process .* for row 0") as e:
        rule_scores(dying, "reward function", _rows(["die"]), ["die"])
    assert "\n" not in str(e.value)


def test_verls_prime_manager_is_a_300_second_limit():
    cfg = load_config(None, ["reward_model.reward_manager=prime", "actor_rollout_ref.rollout.n=2"])
    assert cfg.algorithm.reward_timeout_s == 300.0 and not cfg.algorithm.reward_fn_batch


def test_a_run_whose_reward_never_returns_trains_and_counts_the_rows(tiny_model_dir, tmp_path):
    never = tmp_path / "never.py"
    never.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    time.sleep(120)\n    return 1.0\n")
    over = overrides(tiny_model_dir, tmp_path, "late", 1, 0) + [
        f"algorithm.reward_fn={never}:compute_score", "algorithm.reward_timeout_s=0.3", "algorithm.reward_workers=2",
        "data.val_size=4", "trainer.test_freq=0"]
    summary = train_grpo(load_config(None, over))
    assert summary["steps"] == 1 and summary["final_accuracy"] == 0.0
    row = [json.loads(x) for x in (tmp_path / "late" / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["reward/timeouts"] == 16.0 and row["reward/mean"] == 0.0  # 4 prompts x 4 samples, each scored 0
