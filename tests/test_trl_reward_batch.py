"""TRL's reward functions score a rollout batch in one call each, as TRL's trainer calls them."""

import json

import pytest

from alignrl.data.records import Sample
from alignrl.rewards.errors import ScoreError
from alignrl.rewards.registry import load_reward_fn
from alignrl.rewards.trl_reward import WithColumns
from alignrl.rl.scoring import rule_scores

FUNCTIONS = '''
import json, os

def judge(completions, prompts, level, **kwargs):
    with open(os.environ["CALLS"], "a") as f:
        f.write(json.dumps({"n": len(completions), "prompts": prompts, "level": level}) + "\\n")
    return [float(len(c)) if lv == "hard" else None for c, lv in zip(completions, level)]

def one(completions, **kwargs):
    return [1.0 for _ in completions]

def short(completions, **kwargs):
    return [1.0]
'''


def _rows(n: int) -> list[Sample]:
    levels = ["hard", "easy"]
    return [Sample(messages=[{"role": "user", "content": f"q{i}"}], ground_truth="", data_source="d",
                   extra=WithColumns({}, {"prompt": f"q{i}", "level": levels[i % 2]})) for i in range(n)]


def test_each_function_is_called_once_for_the_whole_batch_and_sums_skip_none(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text(FUNCTIONS)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.jsonl"))
    fn = load_reward_fn(f"trl:{tmp_path / 'rw.py'}:judge@0.5;{tmp_path / 'rw.py'}:one")
    texts = ["abcd", "ab", "abcdef", "a"]
    assert rule_scores(fn, "reward function", _rows(4), texts, ["t0", "t1", "t2", "t3"]) == [3.0, 1.0, 4.0, 1.0]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls == [{"n": 4, "prompts": ["q0", "q1", "q2", "q3"], "level": ["hard", "easy", "hard", "easy"]}]
    # one row alone (the held-out evaluation) is a batch of one, with the same value
    assert fn("d", "abcd", "", _rows(1)[0].extra) == 3.0


def test_a_function_returning_too_few_values_for_the_batch_is_one_line(tmp_path):
    (tmp_path / "rw.py").write_text(FUNCTIONS)
    fn = load_reward_fn(f"trl:{tmp_path / 'rw.py'}:short")
    with pytest.raises(ScoreError, match=r"rw.py:short returned 1 values for 3 completions"):
        rule_scores(fn, "reward function", _rows(3), ["a", "b", "c"])


def test_completion_ids_reach_trl_functions_in_training_and_in_the_held_out_evaluation(tmp_path):
    """TRL passes completion_ids, the generated ids without padding; the held-out evaluation scores a batch in one
    call as training does."""
    import torch

    from alignrl.data.records import Rollout
    from alignrl.rl.evaluate import rule_correct
    from alignrl.rl.scoring import response_id_lists

    (tmp_path / "rw.py").write_text(IDS_FUNCTION)
    fn = load_reward_fn(f"trl:{tmp_path / 'rw.py'}:ids")
    ids, mask = torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    ro = Rollout(prompt_ids=torch.tensor([[1], [1]]), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                 response_ids=ids, response_mask=mask.bool(), logprobs=torch.zeros(2, 3), truncated=torch.zeros(2).bool(),
                 group=torch.tensor([0, 1]))
    assert response_id_lists(ro) == [[5, 6], [7]]
    rows = _rows(2)
    assert rule_scores(fn, "reward function", rows, ["x", "y"], None, response_id_lists(ro)) == [2.0, 1.0]
    assert rule_correct(_Decoder(), ro, ["x", "y"], rows, 0, fn, 1) == [1.0, 1.0]


class _Decoder:
    """The one tokenizer call a prompt-reading function needs here: the prompt's ids as text."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


IDS_FUNCTION = '''
def ids(completions, completion_ids, **kwargs):
    assert len(completion_ids) == len(completions) == 2, "one call for the batch"
    return [float(len(i)) for i in completion_ids]
'''


BAD_ROW = '''
def second_is_text(completions, **kwargs):
    return [1.0, "x", 1.0][:len(completions)]

def solution_len(completions, solution, **kwargs):
    return [float(len(s or "")) for s in solution]
'''


def test_a_bad_value_names_its_row_and_kind_and_columns_come_from_every_row(tmp_path):
    (tmp_path / "rw.py").write_text(BAD_ROW)
    bad = load_reward_fn(f"trl:{tmp_path / 'rw.py'}:second_is_text")
    with pytest.raises(ScoreError, match=r"^cost function .*second_is_text returned 'x' for a completion for row 1 "):
        rule_scores(bad, "cost function", _rows(3), ["a", "b", "c"])
    rows = _rows(2)
    rows[1].extra.columns["solution"] = "abc"  # the first row lacks the column a later one has
    assert rule_scores(load_reward_fn(f"trl:{tmp_path / 'rw.py'}:solution_len"), "reward function", rows,
                       ["a", "b"]) == [0.0, 3.0]


def test_a_format_bonus_keeps_one_call_per_batch_and_episode_extras_keep_the_columns(tmp_path, monkeypatch):
    import torch

    from alignrl.data.records import Rollout
    from alignrl.rewards.registry import with_format_bonus
    from alignrl.rl.scoring import with_reward_extras

    (tmp_path / "rw.py").write_text(FUNCTIONS)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.jsonl"))
    fn = with_format_bonus(load_reward_fn(f"trl:{tmp_path / 'rw.py'}:judge"), 0.5)
    from alignrl.rewards.gsm8k import format_reward

    texts = ["ab\n#### 4", "a"]
    assert rule_scores(fn, "reward function", _rows(2), texts) == [len(texts[0]) + 0.5 * format_reward(texts[0]), 0.0]
    assert format_reward(texts[0]) > 0
    assert len((tmp_path / "calls.jsonl").read_text().splitlines()) == 1
    (tmp_path / "bad.py").write_text(BAD_ROW)
    bad = with_format_bonus(load_reward_fn(f"trl:{tmp_path / 'bad.py'}:second_is_text"), 0.5)
    with pytest.raises(ScoreError, match=r"second_is_text returned 'x' for a completion for row 1 "):
        rule_scores(bad, "reward function", _rows(3), ["a", "b", "c"])  # the bonus's call still names the row
    ro = Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1).bool(),
                 response_ids=torch.ones(2, 1, dtype=torch.long), response_mask=torch.ones(2, 1).bool(),
                 logprobs=torch.zeros(2, 1), truncated=torch.zeros(2).bool(), group=torch.tensor([0, 1]),
                 reward_extras=[{"num_turns": 2}, {}])
    merged = with_reward_extras(ro, _rows(2))
    assert merged[0].extra == {"num_turns": 2} and merged[0].extra.columns["level"] == "hard"
