"""A reward model's score alone, with the rule reward added on rows whose data has an answer to check, or (TRL's
reward model among its reward functions) weighted and summed with the rule reward on every row."""

import pytest
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
    stage = RewardStage(_Tok(), _rule, _rule, 2, reward_model=_Scorer(), model_mix="add")
    scores = stage.score(_rollout(), SAMPLES)
    # rows 0, 1 answer "1": texts "answer 0" (wrong) and "answer 1" (right); rows 2, 3 have no answer
    assert scores.rewards.tolist() == [0.5, 0.5, 0.25, 0.75]
    assert scores.correct.tolist() == [False, True, False, False]


def test_the_config_key_reaches_the_reward_stage(monkeypatch):
    from alignrl.config import load_config
    from alignrl.placements import build

    monkeypatch.setattr(build, "check_rl_scorers", lambda cfg: None)
    monkeypatch.setattr(build, "ModelScorer", lambda folder, *a, **k: _Scorer())
    for mix in ("replace", "add", "sum"):
        cfg = load_config(None, ["algorithm.reward_model=rm_folder", f"algorithm.reward_model_mix={mix}",
                                 "algorithm.reward_model_weight=0.5"])
        stage = build.build_rewards(cfg, _Tok(), torch.device("cpu"))
        assert isinstance(stage.reward_model, _Scorer) and (stage.model_mix, stage.model_weight) == (mix, 0.5)


def test_sum_weighs_the_model_and_adds_the_rule_reward_on_every_row():
    def fixed(data_source, text, ground_truth, extra):  # a rule that scores every row, answer or not
        return 1.0

    stage = RewardStage(_Tok(), fixed, fixed, 2, reward_model=_Scorer(), model_mix="sum", model_weight=2.0)
    assert stage.score(_rollout(), SAMPLES).rewards.tolist() == [2.0, 0.0, 1.5, 2.5]


def test_trls_reward_model_among_its_functions_is_the_weighted_sum():
    from alignrl.compat.trl_grpo_keys import reward_keys
    from alignrl.compat.trl_grpo_flags import parse

    args = parse(["--model_name_or_path", "demo", "--dataset_name", "d.jsonl", "--reward_model_name_or_path",
                  "org/rm", "--reward_funcs", "accuracy_reward", "--reward_weights", "0.5", "1.0"])
    keys = reward_keys(args)
    assert {"algorithm.reward_model=org/rm", "algorithm.reward_model_weight=0.5", "algorithm.reward_model_mix=sum"
            } <= set(keys), keys


def test_reward_model_normalization_needs_a_folder_and_one_without_statistics_scores_as_it_is(tiny_model_dir,
                                                                                                tmp_path):
    """algorithm.reward_model_normalize (OpenRLHF's --normalize_reward) reads the folder's config.json; without a
    folder it is one line, and a folder without a mean and std scores as it is, saying so."""
    from transformers import AutoModelForSequenceClassification

    from alignrl.config import ConfigError, load_config
    from alignrl.models.value import ModelScorer

    with pytest.raises(ConfigError, match="algorithm.reward_model_normalize normalizes the scores of"):
        load_config(None, ["algorithm.reward_model_normalize=true"])
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(tmp_path / "plain")
    said = []
    ids, mask = torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.bool)
    plain = ModelScorer(str(tmp_path / "plain"), log=said.append, normalize=True).score(ids, mask, ids, mask)
    assert torch.equal(plain, ModelScorer(str(tmp_path / "plain")).score(ids, mask, ids, mask))
    assert any("holds no mean and std" in line for line in said)
    rm.config.mean, rm.config.std = 2.0, 4.0
    rm.save_pretrained(tmp_path / "stats")
    normalized = ModelScorer(str(tmp_path / "stats"), log=said.append, normalize=True).score(ids, mask, ids, mask)
    torch.testing.assert_close(normalized, (plain - 2.0) / 4.0)


def test_the_critic_normalizes_its_values_as_the_reward_model_with_normalize_reward(tiny_model_dir, tmp_path):
    """OpenRLHF's --normalize_reward normalizes the critic too: one initialised from a reward model whose config.json
    holds a mean and std predicts (value - mean) / std, in scoring and in its loss; the cost critic, not on the reward
    model's scale, stays as it is."""
    from transformers import AutoModelForSequenceClassification

    from alignrl.config import load_config
    from alignrl.placements.build import build_critic

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    rm.config.pad_token_id, rm.config.mean, rm.config.std = rm.config.eos_token_id, 2.0, 4.0
    rm.save_pretrained(tmp_path / "rm")
    over = [f"model.path={tiny_model_dir}", f"algorithm.reward_model={tmp_path / 'rm'}", "critic.enable=true",
            "algorithm.adv_estimator=gae",
            f"critic.model_path={tmp_path / 'rm'}"]
    plain = build_critic(load_config(None, over), "critic", None)
    normal = build_critic(load_config(None, [*over, "algorithm.reward_model_normalize=true"]), "critic", None)
    cost = build_critic(load_config(None, [*over, "algorithm.reward_model_normalize=true"]), "cost_critic", None)
    ids, mask = torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.ones(2, 3, dtype=torch.bool)
    ro = Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask, logprobs=torch.zeros(2, 3),
                 truncated=torch.zeros(2, dtype=torch.bool), group=torch.arange(2))
    raw = plain.values(ro, 2)
    torch.testing.assert_close(normal.values(ro, 2), (raw - 2.0) / 4.0)
    assert (normal.shift, normal.scale) == (2.0, 4.0) and (cost.shift, cost.scale) == (0.0, 1.0)


def test_with_a_remote_reward_the_critic_alone_is_normalized(tiny_model_dir, tmp_path, capsys):
    """OpenRLHF builds its critic with --normalize_reward whatever scores the rows (--remote_rm_url too): with a
    reward service, the critic whose config.json holds a mean and std predicts (value - mean) / std, one without them
    predicts as it is and says so in one line; without a critic or a reward model the key is one line."""
    from transformers import AutoModelForSequenceClassification

    from alignrl.compat import openrlhf_flags as F
    from alignrl.compat import openrlhf_keys as K
    from alignrl.config import ConfigError, load_config
    from alignrl.placements.build import build_critic

    torch.manual_seed(0)
    value = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    value.config.pad_token_id = value.config.eos_token_id
    value.save_pretrained(tmp_path / "plain")
    value.config.mean, value.config.std = 2.0, 4.0
    value.save_pretrained(tmp_path / "stats")
    remote = [f"model.path={tiny_model_dir}", "services.reward_url=http://127.0.0.1:9/score", "critic.enable=true",
              "algorithm.adv_estimator=gae", "algorithm.reward_model_normalize=true"]
    with pytest.raises(ConfigError, match="and the critic's values .critic.enable., and this run has neither"):
        load_config(None, [f"model.path={tiny_model_dir}", "services.reward_url=http://127.0.0.1:9/score",
                           "algorithm.reward_model_normalize=true"])
    capsys.readouterr()
    normal = build_critic(load_config(None, [*remote, f"critic.model_path={tmp_path / 'stats'}"]), "critic", None)
    plain = build_critic(load_config(None, [*remote, f"critic.model_path={tmp_path / 'plain'}"]), "critic", None)
    said = capsys.readouterr().out
    assert (normal.shift, normal.scale, plain.shift, plain.scale) == (2.0, 4.0, 0.0, 1.0)
    assert f"critic {tmp_path / 'stats'}: values normalized as (value - 2) / 4 (its config.json)" in said
    assert sum("holds no mean and std to normalize by: values used as they are" in x for x in said.splitlines()) == 1
    ids, mask = torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.bool)
    ro = Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask, logprobs=torch.zeros(1, 3),
                 truncated=torch.zeros(1, dtype=torch.bool), group=torch.arange(1))
    torch.testing.assert_close(normal.values(ro, 1), (plain.values(ro, 1) - 2.0) / 4.0)
    # OpenRLHF's flags: --remote_rm_url with a critic (gae) applies --normalize_reward; without a critic it is listed
    line = ["--pretrain", str(tiny_model_dir), "--remote_rm_url", "http://127.0.0.1:9/score", "--normalize_reward"]
    gae = F.parser().parse_args([*line, "--advantage_estimator", "gae"])
    assert "algorithm.reward_model_normalize=true" in K.overrides(gae, gpus=False, total_steps=5)
    assert not any("--normalize_reward" in x for x in K.unused_here(gae, gpus=False))
    group = F.parser().parse_args([*line, "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2"])
    assert "algorithm.reward_model_normalize=true" not in K.overrides(group, gpus=False, total_steps=5)
    assert any(x.startswith("--normalize_reward (not applied here: it normalizes a reward model's scores and a "
                            "critic's values, and this run has neither") for x in K.unused_here(group, gpus=False))
