"""TRL's multi_objective_aggregation=normalize_then_sum (GDPO): each reward function normalized in its prompt group,
then weighted and summed, then the batch's std."""

import json
import math

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import normalize_then_sum

NAN = float("nan")


def test_each_function_is_normalized_in_its_group_before_the_weighted_sum():
    per_function = torch.tensor([[1.0, 0.5], [0.0, 0.5], [0.0, NAN], [NAN, 1.0], [NAN, 3.0], [1.0, 5.0]])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    got = normalize_then_sum(per_function, group, torch.tensor([1.0, 2.0]))
    sd = math.sqrt(1 / 3)  # group 0, function 1: 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3)
    high, low = (2 / 3) / (sd + 1e-4), (-1 / 3) / (sd + 1e-4)
    # group 0, function 2: two equal values -> 0 each; group 1, function 1: one value -> skipped
    step = 2.0 / (2.0 + 1e-4)  # group 1, function 2: 1, 3, 5 -> mean 3, std 2
    assert got.tolist() == pytest.approx([high, low, low, -2 * step, 0.0, 2 * step], rel=1e-6)


def test_the_stage_rewards_normalized_sums_and_counts_correct_on_the_plain_sum(tmp_path, tiny_model):
    from alignrl.data.records import Rollout, Sample
    from alignrl.rewards.registry import load_reward_fn
    from alignrl.rewards.trl_reward import WithColumns
    from alignrl.rl.scoring import RewardStage

    _, tok = tiny_model
    (tmp_path / "rw.py").write_text("def right(completions, answer, **kw):\n"
                                    "    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]\n"
                                    "def short(completions, **kw):\n"
                                    "    return [0.0 if len(c) < 3 else -1.0 for c in completions]\n")
    fn = load_reward_fn(f"trl:{tmp_path / 'rw.py'}:right;{tmp_path / 'rw.py'}:short@0.5")
    stage = RewardStage(tok, fn, fn, max_new_tokens=8, normalize_each=True)
    texts = ["7", "no 7", "x", "yy"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    ro = Rollout(prompt_ids=torch.ones(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1).bool(),
                 response_ids=torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids]),
                 response_mask=torch.tensor([[k < len(i) for k in range(width)] for i in ids]),
                 logprobs=torch.zeros(4, width), truncated=torch.zeros(4).bool(), group=torch.tensor([0, 0, 1, 1]))
    samples = [Sample(messages=[{"role": "user", "content": "q"}], ground_truth="", data_source="d",
                      extra=WithColumns({}, {"prompt": "q", "answer": "7"})) for _ in range(2)]
    scores = stage.score(ro, samples)
    table = torch.tensor([[1.0, 0.0], [1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    expected = normalize_then_sum(table, ro.group, torch.tensor([1.0, 0.5]))
    assert scores.rewards.tolist() == pytest.approx(expected.tolist())
    assert scores.correct.tolist() == [True, False, False, False]  # the plain weighted sum decides: 1, 0.5, 0, 0
    assert scores.rewards[0] > scores.rewards[1] and scores.rewards[2] == scores.rewards[3] == 0.0
    assert scores.filter_scores.tolist() == [1.0, 0.5, 0.0, 0.0]  # dynamic sampling's bounds read the plain sum
    assert scores.shown.tolist() == [1.0, 0.5, 0.0, 0.0]  # and reward/mean logs it, as TRL's "reward"


def test_a_trl_line_asks_for_it_and_the_config_keeps_it_to_trl_functions(tmp_path):
    from alignrl.compat.trl_grpo_keys import from_line

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "solution": "2"}) + "\n")
    words, _ = from_line(["--model_name_or_path", "demo", "--dataset_name", str(data), "--reward_funcs",
                          "accuracy_reward", "think_format_reward", "--multi_objective_aggregation",
                          "normalize_then_sum", "--scale_rewards", "none"])
    cfg = load_config(None, [w for w in words if "=" in w])
    a = cfg.algorithm
    assert (a.multi_objective_aggregation, a.grpo_std_scope, a.norm_adv_by_std_in_grpo) == \
        ("normalize_then_sum", "batch", True)
    with pytest.raises(ConfigError, match="normalizes each of a TRL reward's functions"):
        load_config(None, ["algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.grpo_std_scope=batch"])
    with pytest.raises(ConfigError, match="drop algorithm.format_reward_weight"):
        load_config(None, [w for w in words if "=" in w] + ["algorithm.format_reward_weight=0.1"])
    with pytest.raises(ConfigError, match="algorithm.truncated_reward_coef would shape or replace in its units"):
        load_config(None, [w for w in words if "=" in w] + ["algorithm.truncated_reward_coef=0"])
