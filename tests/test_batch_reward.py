"""verl's batch reward manager (reward_model.reward_manager=batch -> algorithm.reward_fn_batch) and its reward_kwargs
(custom_reward_function.reward_kwargs -> algorithm.reward_fn_kwargs): one call scores a batch, the keyword arguments
reach the function, and what a batch function gets wrong is one line."""

import json

import pytest
import torch

from alignrl.config import load_config
from alignrl.data.records import Rollout, Sample
from alignrl.rewards.batch_reward import BatchedReward
from alignrl.rewards.errors import RewardError, ScoreError
from alignrl.rewards.registry import load_reward_fn
from alignrl.rl.scoring import rule_scores

BATCH_FILE = '''
CALLS = []

def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    CALLS.append(len(solution_strs))
    return [{"score": float(s.strip() == str(g)) + bonus} for s, g in zip(solution_strs, ground_truths)]

def per_row(data_source, solution_str, ground_truth, extra_info, scale=1.0):
    return scale * len(solution_str)
'''


def _rows(n):
    return [Sample([{"role": "user", "content": f"q{i}"}], str(i), "gsm8k") for i in range(n)]


def test_one_call_scores_the_batch_with_the_keyword_arguments(tmp_path):
    (tmp_path / "r.py").write_text(BATCH_FILE)
    fn = load_reward_fn(f"{tmp_path / 'r.py'}:compute_score", kwargs={"bonus": 0.5}, batched=True)
    assert isinstance(fn, BatchedReward)
    scores = rule_scores(fn, "reward function", _rows(4), ["0", "x", "2", "3 "])
    assert scores == [1.5, 0.5, 1.5, 1.5]
    module = fn.fn.func.__globals__  # the user's module, through functools.partial
    assert module["CALLS"] == [4]  # one call for the four rows
    assert fn("gsm8k", "7", "7") == {"score": 1.5}  # a single row is a batch of one (the caller checks the dict)
    assert module["CALLS"] == [4, 1]


def test_reward_kwargs_reach_a_row_function(tmp_path):
    (tmp_path / "r.py").write_text(BATCH_FILE)
    fn = load_reward_fn(f"{tmp_path / 'r.py'}:per_row", kwargs={"scale": 2.0})
    assert fn("gsm8k", "abc", "1") == 6.0


@pytest.mark.parametrize("returned, words", [
    ("[1.0]", "returned 1 scores for 2 rows"), ("'ab'", "returned a str for a batch"),
    ("{'score': 1}", "returned a dict for a batch"),
    ("1 / 0", "raised ZeroDivisionError: division by zero on a batch of 2"),
    ("[1.0, float('nan')]", "returned nan"),
])
def test_what_a_batch_function_gets_wrong_is_one_line(tmp_path, returned, words):
    (tmp_path / "b.py").write_text(f"def f(data_sources, solution_strs, ground_truths, extra_infos):\n"
                                   f"    return {returned}\n")
    fn = load_reward_fn(f"{tmp_path / 'b.py'}:f", batched=True)
    with pytest.raises(ScoreError, match=words) as err:
        rule_scores(fn, "reward function", _rows(2), ["a", "b"])
    assert "\n" not in str(err.value)


def test_numpy_scores_are_read(tmp_path):
    (tmp_path / "n.py").write_text("import numpy as np\n\ndef f(data_sources, solution_strs, ground_truths, "
                                   "extra_infos):\n    return np.arange(len(solution_strs), dtype=np.float32)\n")
    fn = load_reward_fn(f"{tmp_path / 'n.py'}:f", batched=True)
    assert rule_scores(fn, "reward function", _rows(3), ["a", "b", "c"]) == [0.0, 1.0, 2.0]


def test_verls_batch_manager_and_reward_kwargs_translate():
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "custom_reward_function.path=r.py",
                             "reward_model.reward_manager=batch", "+custom_reward_function.reward_kwargs.bonus=0.5",
                             "+reward.custom_reward_function.reward_kwargs.other=x"])
    a = cfg.algorithm
    assert (a.reward_fn, a.reward_fn_batch, dict(a.reward_fn_kwargs)) == ("r.py:compute_score", True,
                                                                         {"bonus": 0.5, "other": "x"})
    assert not load_config(None, ["algorithm.adv_estimator=grpo", "reward_model.reward_manager=naive"]
                           ).algorithm.reward_fn_batch
    with pytest.raises(RewardError, match="reward_fn_batch needs algorithm.reward_fn=path/to/file.py:function"):
        load_reward_fn(None, batched=True)


def test_a_verl_run_with_the_batch_manager_trains(tmp_path, tiny_model_dir, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "judge.py").write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos, "
                                       "level=0.0):\n    return [level] * len(solution_strs)\n")
    got = cli_in_process(
        "train", "ppo", "algorithm.adv_estimator=grpo", "custom_reward_function.path=judge.py",
        "reward_model.reward_manager=batch", "+custom_reward_function.reward_kwargs.level=0.25",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_batch_size=2", "data.max_response_length=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2", "trainer.logger=['console','jsonl']", "trainer.total_training_steps=1",
        "trainer.total_epochs=1", "trainer.test_freq=-1", "trainer.save_freq=-1", "data.val_size=4",
        f"trainer.output_dir={tmp_path / 'out'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false")
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(line) for line in next((tmp_path / "out").glob("*/logs/metrics.jsonl")).read_text().splitlines()]
    assert [r["reward/mean"] for r in rows if "reward/mean" in r] == [0.25]


def test_the_reward_stage_calls_a_batch_function_once(tmp_path):
    """build_rewards gives the stage one function as the reward and the correctness (no format bonus): one call."""
    from alignrl.placements.build import build_rewards

    (tmp_path / "r.py").write_text(BATCH_FILE)
    cfg = load_config(None, [f"algorithm.reward_fn={tmp_path / 'r.py'}:compute_score",
                             "algorithm.reward_fn_batch=true"])

    class Tok:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens=True):
            return [str(int(r[0])) for r in ids]

    ids = torch.tensor([[0], [5], [2]])
    ro = Rollout(prompt_ids=torch.zeros(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.bool),
                 response_ids=ids, response_mask=torch.ones(3, 1, dtype=torch.bool),
                 logprobs=torch.zeros(3, 1), truncated=torch.zeros(3, dtype=torch.bool), group=torch.tensor([0, 1, 2]))
    stage = build_rewards(cfg, Tok(), torch.device("cpu"))
    assert stage.reward_fn is stage.correct_fn
    scores = stage.score(ro, _rows(3))
    assert scores.rewards.tolist() == [1.0, 0.0, 1.0] and scores.correct.tolist() == [True, False, True]
    assert stage.reward_fn.fn.__globals__["CALLS"] == [3]  # one call for the reward and the correctness
