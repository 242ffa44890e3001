"""Rule rewards under a time limit (algorithm.reward_timeout_s, verl's prime reward manager): rows scored side by
side in workers from a fork server, a row past the limit scored 0 and counted while its worker is replaced (its
cleanup run), a row whose function raises or whose worker dies is one line naming the row, a cost past the limit
stops the run, and a run whose reward never returns still trains."""

import functools
import json
import time

import pytest

from alignrl.config import ConfigError, load_config
from alignrl.data.records import Sample
from alignrl.rewards.registry import ScoreError, load_reward_fn, with_format_bonus
from alignrl.rewards.timed_rules import late_rows, timed
from alignrl.rl.scoring import rule_scores
from alignrl.runner import train_grpo
from smallrun import overrides

RULE = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("stall"):
        try:
            time.sleep(120)  # a rule that never returns on one odd response
        finally:  # a worker told to stop unwinds: its cleanup runs
            open(os.environ["ALIGNRL_TEST_MARK"], "w").close()
    if solution_str == "die":
        os._exit(3)  # a worker killed from outside, as the kernel's OOM killer would
    if solution_str == "bad":
        raise ValueError("cannot parse")
    return float(solution_str == ground_truth)
'''


@pytest.fixture
def rule(tmp_path, monkeypatch):
    """(the rule, its recipe): a user's reward file, loaded here and in each worker."""
    path = tmp_path / "rule.py"
    # the mark's path written into the file: the workers fork from this process's fork server, whose environment is
    # the one it started with (another test of this process may have started it, with another mark or none)
    path.write_text(RULE.replace('os.environ["ALIGNRL_TEST_MARK"]', repr(str(tmp_path / "cleaned_up"))))
    monkeypatch.setenv("ALIGNRL_TEST_MARK", str(tmp_path / "cleaned_up"))
    recipe = functools.partial(load_reward_fn, f"{path}:compute_score")
    return recipe(), recipe


def _rows(n):
    return [Sample(f"q{i}", "7", "gsm8k", {}) for i in range(n)]


def _waited_for(path, timeout_s=60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def test_a_row_past_the_limit_scores_zero_its_worker_cleans_up_and_the_others_are_scored(rule, tmp_path):
    fn, recipe = rule
    timed_rule = timed(fn, recipe, 2.0, workers=2)
    texts = ["7", "stall", "8", "7"]
    assert rule_scores(timed_rule, "reward function", _rows(4), texts) == [1.0, 0.0, 0.0, 1.0]
    assert late_rows([timed_rule, timed_rule, None]) == 1 and late_rows([timed_rule]) == 0  # counted once, taken
    assert _waited_for(tmp_path / "cleaned_up")  # the stopped worker ran the rule's `finally`
    assert rule_scores(timed_rule, "reward function", _rows(1), ["7"]) == [1.0]  # its replacement scores on
    assert timed_rule("x", "7", "7") == 1.0  # called as a function: here, as it is
    assert late_rows([fn]) is None and timed(fn, recipe, 0.0) is fn


def test_a_shaped_reward_scores_each_row_once_in_the_workers(rule):
    fn, recipe = rule
    correct = timed(fn, recipe, 2.0, workers=2)
    shaped = with_format_bonus(correct, 0.5)
    texts = ["#### 7", "stall #### 7"]
    rows = _rows(2)
    # "#### 7" is not "7" but has the format; a row past the limit was never scored: no bonus either
    assert rule_scores(shaped, "reward function", rows, texts) == [0.5, 0.0]
    assert rule_scores(correct, "reward function", rows, texts) == [0.0, 0.0]  # the same rows: not scored again
    assert late_rows([shaped, correct]) == 1


def test_a_raising_function_a_dead_worker_and_a_late_cost_are_one_line_naming_the_row(rule):
    fn, recipe = rule
    with pytest.raises(ScoreError, match=r"raised ValueError: cannot parse for row 1 \(data_source gsm8k\)") as e:
        rule_scores(timed(fn, recipe, 5.0, workers=2), "reward function", _rows(3), ["7", "bad", "7"])
    assert "\n" not in str(e.value)
    with pytest.raises(ScoreError, match=r"lost its worker process .* for row 0") as e:
        rule_scores(timed(fn, recipe, 5.0, workers=1), "reward function", _rows(1), ["die"])
    assert "\n" not in str(e.value)
    with pytest.raises(ScoreError, match=r"cost function .* ran past algorithm.reward_timeout_s=1 s for row 0") as e:
        rule_scores(timed(fn, recipe, 1.0, workers=1, give_up=False), "cost function", _rows(1), ["stall"])
    assert "\n" not in str(e.value)


def test_a_rule_its_workers_cannot_load_is_one_line(rule, tmp_path):
    gone = tmp_path / "gone.py"
    gone.write_text(RULE)
    recipe = functools.partial(load_reward_fn, f"{gone}:compute_score")
    fn = recipe()
    gone.unlink()  # loaded here, then moved away: the workers cannot load it
    with pytest.raises(ScoreError, match=r"could not be loaded in a reward worker .* for row 0") as e:
        rule_scores(timed(fn, recipe, 5.0, workers=1), "reward function", _rows(1), ["7"])
    assert "\n" not in str(e.value)


def test_a_script_without_a_main_guard_is_not_run_again_by_the_workers(tmp_path):
    """Workers come from a fork server without the main module's preparation: a script that scores at its top level
    runs once."""
    import subprocess
    import sys

    rule_file = tmp_path / "rule.py"
    rule_file.write_text(RULE)
    script = tmp_path / "score.py"
    script.write_text(
        "import functools\n"
        "from alignrl.data.records import Sample\n"
        "from alignrl.rewards.registry import load_reward_fn\n"
        "from alignrl.rewards.timed_rules import timed\n"
        "from alignrl.rl.scoring import rule_scores\n"
        "print('script body', flush=True)\n"
        f"recipe = functools.partial(load_reward_fn, {str(rule_file)!r} + ':compute_score')\n"
        "rows = [Sample('q', '7', 'gsm8k', {})] * 2\n"
        "print(rule_scores(timed(recipe(), recipe, 5.0, workers=2), 'reward function', rows, ['7', '8']))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "ALIGNRL_TEST_MARK": str(tmp_path / "mark")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("script body") == 1 and "[1.0, 0.0]" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_settings_it_would_ignore_and_verls_prime_manager():
    with pytest.raises(ConfigError, match="algorithm.reward_workers=4 is read only with algorithm.reward_timeout_s"):
        load_config(None, ["algorithm.reward_workers=4"])
    with pytest.raises(ConfigError, match="drop one of them"):
        load_config(None, ["algorithm.reward_timeout_s=5", "algorithm.reward_fn_batch=true",
                           "algorithm.reward_fn=r.py:f"])
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
