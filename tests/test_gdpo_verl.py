"""verl's GDPO (algorithm.adv_estimator=gdpo): each component of the reward function's dict normalized in its prompt
group as GRPO's advantage, weighted and summed, then whitened over the batch's tokens; verl's script line reads as
it, and the logs show the plain score."""

import statistics

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import ADVANTAGES, OutcomeInputs, decoupled_group_sum


def verl_gdpo(table, group, weights, mask, eps=1e-6):
    """verl's compute_gdpo_outcome_advantage written out: per key its GRPO advantage (group mean, torch.std, + eps),
    weighted and summed, then verl_F.masked_whiten over the response tokens (unbiased variance, + 1e-8)."""
    summed = [0.0] * len(group)
    for k, w in enumerate(weights):
        for g in set(group):
            rows = [i for i, x in enumerate(group) if x == g]
            vals = [table[i][k] for i in rows]
            mean, std = statistics.mean(vals), statistics.stdev(vals)
            for i in rows:
                summed[i] += w * (table[i][k] - mean) / (std + eps)
    tokens = [(i, t) for i in range(len(group)) for t in range(len(mask[i])) if mask[i][t]]
    values = [summed[i] for i, _ in tokens]
    mean, var = statistics.mean(values), statistics.variance(values)
    out = [[0.0] * len(mask[0]) for _ in group]
    for i, t in tokens:
        out[i][t] = (summed[i] - mean) / (var + 1e-8) ** 0.5
    return out


def test_the_advantage_is_verls_gdpo():
    table = [[1.0, 0.2], [0.0, 0.9], [1.0, 0.4], [0.0, 0.0], [1.0, 1.0], [1.0, 0.5]]
    group, weights = [0, 0, 0, 1, 1, 1], [1.0, 0.5]
    mask = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    summed = decoupled_group_sum(torch.tensor(table), torch.tensor(group), torch.tensor(weights))
    m = torch.tensor(mask, dtype=torch.float32)
    adv = ADVANTAGES["gdpo"](OutcomeInputs(summed, torch.zeros(6, 3), m, torch.tensor(group)))
    assert adv.tolist() == [pytest.approx(row, abs=1e-5) for row in verl_gdpo(table, group, weights, mask)]
    # a component of one scale dominates the plain sum; decoupled, each counts by its rank in the group
    assert decoupled_group_sum(torch.tensor([[10.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]),
                               torch.tensor([1.0, 1.0])).tolist() == pytest.approx([0.0, 0.0], abs=1e-5)


def test_the_stage_trains_on_the_decoupled_sum_and_logs_the_score(tmp_path, tiny_model):
    from alignrl.data.records import Rollout, Sample
    from alignrl.rewards.errors import ScoreError
    from alignrl.rewards.registry import load_reward_fn
    from alignrl.rl.scoring import RewardComponents, RewardStage

    _, tok = tiny_model
    (tmp_path / "rw.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right, short = float(ground_truth in solution_str), float(len(solution_str) < 3)\n"
        "    if solution_str == 'bad':\n"
        "        return {'score': 0.0, 'accuracy_reward': right}\n"
        "    return {'score': right + short, 'accuracy_reward': right, 'format_reward': short, 'note': 'x'}\n")
    fn = load_reward_fn(f"{tmp_path / 'rw.py'}:compute_score")
    parts = RewardComponents(("accuracy_reward", "format_reward"), (1.0, 0.5))
    stage = RewardStage(tok, fn, fn, max_new_tokens=8, components=parts)

    def rollout(texts):
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        return Rollout(prompt_ids=torch.ones(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1).bool(),
                       response_ids=torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids]),
                       response_mask=torch.tensor([[k < len(i) for k in range(width)] for i in ids]),
                       logprobs=torch.zeros(4, width), truncated=torch.zeros(4).bool(),
                       group=torch.tensor([0, 0, 1, 1]))

    samples = [Sample(messages=[{"role": "user", "content": "q"}], ground_truth="7", data_source="d")] * 2
    ro = rollout(["7", "no 7 at all", "x", "yyyy"])
    scores = stage.score(ro, samples)
    table = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    expected = decoupled_group_sum(table, ro.group, torch.tensor([1.0, 0.5]))
    assert scores.rewards.tolist() == pytest.approx(expected.tolist())
    assert scores.shown.tolist() == [2.0, 1.0, 1.0, 0.0]  # reward/mean logs the score, as verl's critic/score
    assert scores.correct.tolist() == [True, True, True, False]  # a score of 1 or more, as ever
    with pytest.raises(ScoreError, match=r"compute_score returned no number under 'format_reward' for row 1 "
                                         r"\(data_source d\)"):
        stage.score(rollout(["7", "bad", "x", "y"]), samples)
    from alignrl.rewards.values import RowScore, TimedOut

    # a row past the time limit scores 0 in each component, as in the reward; a dict of its score alone has it
    got = parts.reward([RowScore(1.0, parts={"accuracy_reward": 1.0, "format_reward": 1.0}), TimedOut(0.0)],
                       samples, torch.tensor([0, 0]), "f")
    assert got == pytest.approx(decoupled_group_sum(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), torch.tensor([0, 0]),
                                                    torch.tensor([1.0, 0.5])).tolist())
    from alignrl.rewards.registry import finite_score

    assert RewardComponents(("score",)).reward([finite_score({"score": 0.5}, "f", "d"), finite_score(
        {"score": 1.5}, "f", "d")], samples, torch.tensor([0, 0]), "f") == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_verls_keys_and_the_refusals():
    verl = ["algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
            "reward.reward_manager.name=gdpo", "actor_rollout_ref.rollout.n=4"]
    a = load_config(None, verl).algorithm
    assert (a.adv_estimator, a.gdpo_reward_keys, a.gdpo_reward_weights) == \
        ("gdpo", ["accuracy_reward", "format_reward"], [])
    for extra, words in ((["algorithm.gdpo_reward_keys=[]"], "normalizes each reward component apart: name them"),
                         (["algorithm.gdpo_reward_weights=[1.0]"], r"1 weight\(s\) for 2 gdpo_reward_keys"),
                         (["algorithm.overlong_buffer_len=4"], "which algorithm.overlong_buffer_len would not reach"),
                         (["algorithm.reward_clip=[-1,1]"], "which algorithm.reward_clip would not reach"),
                         (["actor_rollout_ref.rollout.n=1"], "rollout.n=1 leaves none to compare with")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, verl + extra)
    with pytest.raises(ConfigError, match="act with algorithm.adv_estimator=gdpo"):
        load_config(None, ["algorithm.gdpo_reward_keys=[a]"])


def test_a_gdpo_run_trains_a_step(tiny_model_dir, tmp_path):
    import json
    import math

    from smallrun import overrides

    from alignrl.runner import train_grpo

    (tmp_path / "rw.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = float(solution_str.strip().endswith(str(ground_truth)))\n"
        "    return {'score': right, 'accuracy_reward': right, 'format_reward': float('####' in solution_str)}\n")
    cfg = load_config(None, overrides(tiny_model_dir, tmp_path, "gdpo", 1, 0) + [
        "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
        f"algorithm.reward_fn={tmp_path / 'rw.py'}:compute_score"])
    assert train_grpo(cfg)["steps"] == 1
    row = [json.loads(x) for x in (tmp_path / "gdpo" / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert all(math.isfinite(row[k]) for k in ("actor/grad_norm", "actor/entropy", "reward/mean"))
    assert 0.0 <= row["reward/mean"] <= 1.0  # the plain score, not the whitened sum
