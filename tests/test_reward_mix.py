"""A reward model's score alone, or with the rule reward added on rows whose data has an answer to check."""

import torch

from alignrl.data.records import Rollout, Sample
from alignrl.rl.scoring import RewardStage


class _Tok:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"answer {i}" for i in range(len(ids))]


class _Scorer:
    name = "rm"

    def score(self, *tensors):
        return torch.tensor([0.5, -0.5, 0.25, 0.75])


def _rollout() -> Rollout:
    z = torch.zeros(4, 2, dtype=torch.long)
    ones = torch.ones(4, 2, dtype=torch.bool)
    return Rollout(z, ones, z, ones, torch.zeros(4, 2), torch.zeros(4, dtype=torch.bool), torch.arange(4) // 2)


def _rule(data_source, text, ground_truth, extra):  # the rule: 1 when the text ends with the answer
    return float(bool(ground_truth) and text.endswith(str(ground_truth)))


SAMPLES = [Sample([], "1", "gsm8k"), Sample([], "", "chat")]  # the second prompt has no answer


def test_replace_is_the_models_score_alone():
    scores = RewardStage(_Tok(), _rule, _rule, 2, reward_model=_Scorer()).score(_rollout(), SAMPLES)
    assert scores.rewards.tolist() == [0.5, -0.5, 0.25, 0.75]


def test_add_puts_the_rule_reward_on_rows_that_have_an_answer():
    stage = RewardStage(_Tok(), _rule, _rule, 2, reward_model=_Scorer(), add_rule=True)
    scores = stage.score(_rollout(), SAMPLES)
    # rows 0, 1 answer "1": texts "answer 0" (wrong) and "answer 1" (right); rows 2, 3 have no answer
    assert scores.rewards.tolist() == [0.5, 0.5, 0.25, 0.75]
    assert scores.correct.tolist() == [False, True, False, False]


def test_the_config_key_reaches_the_reward_stage(monkeypatch):
    from alignrl.config import load_config
    from alignrl.placements import build

    monkeypatch.setattr(build, "check_rl_scorers", lambda cfg: None)
    monkeypatch.setattr(build, "ModelScorer", lambda folder, *a, **k: _Scorer())
    for mix, add in (("replace", False), ("add", True)):
        cfg = load_config(None, ["algorithm.reward_model=rm_folder", f"algorithm.reward_model_mix={mix}"])
        stage = build.build_rewards(cfg, _Tok(), torch.device("cpu"))
        assert isinstance(stage.reward_model, _Scorer) and stage.add_rule is add
