"""Every advantage estimator, policy-loss variant and safety/KL option of the runner on a tiny random model: each
trains a step (or a few) and logs finite metrics; the multipliers and KL coefficients follow their update rules."""

import json
import math
from pathlib import Path

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.config.schema import PAIR_ESTIMATORS
from alignrl.runner import train_grpo
from smallrun import overrides as _overrides


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"])
def test_other_estimators_run_a_step(estimator, tiny_model_dir, tmp_path):
    from alignrl.config import AlgorithmConfig
    from alignrl.core.advantages import ADVANTAGES

    choices = set(dict(AlgorithmConfig.__dataclass_fields__)["adv_estimator"].metadata["choices"])
    assert set(ADVANTAGES) == choices - {"gae", *PAIR_ESTIMATORS}  # gae takes the critic path, these their pairs
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, estimator, 1, 0)
                      + [f"algorithm.adv_estimator={estimator}"])
    assert train_grpo(cfg)["steps"] == 1
    row = [json.loads(x) for x in (tmp_path / estimator / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert all(math.isfinite(row[k]) for k in ("actor/grad_norm", "actor/clipfrac", "reward/mean"))


def test_outcome_token_rewards_sit_on_the_last_token():
    from alignrl.core.advantages import outcome_token_rewards

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).float()
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]]


def test_ppo_with_critic_checkpoints_and_resumes_the_critic(tiny_model_dir, tmp_path):
    over = _overrides(tiny_model_dir, tmp_path, "ppo", 2, 1) + ["algorithm.adv_estimator=gae", "critic.enable=true",
                                                                "critic.warmup_steps=1"]
    train_grpo(load_config(None, over))
    run = tmp_path / "ppo"
    rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert "critic/vf_loss" in rows[1] and "actor/grad_norm" not in rows[1]  # step 1: critic warm-up only
    assert "actor/grad_norm" in rows[2] and "critic/vf_loss" in rows[2]
    assert (run / "checkpoints" / "global_step_2" / "critic" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "global_step_2" / "critic_state" / "optim.pt").is_file()
    # one more step resumes actor and critic from step 2
    summary = train_grpo(load_config(None, over + ["trainer.total_training_steps=3"]))
    assert summary["steps"] == 3


def test_ppo_lagrangian_updates_the_multiplier(tiny_model_dir, tmp_path):
    cost = Path(__file__).parents[1] / "examples" / "length_cost.py"
    over = _overrides(tiny_model_dir, tmp_path, "safe", 2, 2) + [
        "algorithm.adv_estimator=gae", "critic.enable=true", f"safety.cost_fn={cost}:compute_score",
        "safety.cost_limit=0.0", "safety.lambda_lr=0.5"]
    train_grpo(load_config(None, over))
    rows = [json.loads(x) for x in (tmp_path / "safe" / "logs" / "metrics.jsonl").read_text().splitlines()]
    # log lambda += 0.5 * (J_c - 0) * lambda from 1, J_c the mean cost of every episode so far (the window holds
    # 128, the batches are equal): it follows the measured costs exactly
    log_lam, seen = 0.0, []
    for r in rows[1:]:
        seen.append(r["safety/cost_mean"])
        log_lam += 0.5 * (sum(seen) / len(seen)) * math.exp(log_lam)
        assert r["safety/lambda"] == pytest.approx(math.exp(log_lam))
        assert "cost_critic/vf_loss" in r
    state = torch.load(tmp_path / "safe" / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["lagrangian"]["log_value"] == pytest.approx(log_lam)


@pytest.mark.parametrize("extra", [
    ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.clip_ratio_low=3e-4",
     "actor.clip_ratio_high=4e-4"],
    ["actor.policy_loss=cispo"],
    ["actor.clip_ratio_c=3.0", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
    ["algorithm.dynamic_sampling=true", "algorithm.overlong_buffer_len=4", "algorithm.mask_truncated=true",
     "actor.recompute_old_logprobs=true", "algorithm.rollout_is=sequence", "algorithm.rollout_is_mode=mask"],
])
def test_policy_loss_variants_run_a_step(extra, tiny_model_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "v", 2, 0) + extra)
    assert train_grpo(cfg)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "v" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for r in rows for v in r.values())


def test_ppo_lagrangian_with_a_cost_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(
        tmp_path / "cost_model")
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "cost_model")
    over = _overrides(tiny_model_dir, tmp_path, "safe_model", 1, 0) + [
        "algorithm.adv_estimator=gae", "critic.enable=true", f"safety.cost_model={tmp_path / 'cost_model'}"]
    train_grpo(load_config(None, over))
    row = [json.loads(x) for x in (tmp_path / "safe_model" / "logs" / "metrics.jsonl").read_text().splitlines()][1]
    assert math.isfinite(row["safety/cost_mean"]) and row["safety/lambda"] >= 0.0


def test_remax_baseline_is_the_greedy_reward(tiny_model_dir, tmp_path):
    from alignrl.placements.local import place
    from alignrl.data.prompts import PromptData
    from alignrl.core.shaping import overlong_penalty
    from alignrl.data import synthetic
    from alignrl.interfaces import SamplingParams

    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path, "remax", 1, 0) + ["algorithm.adv_estimator=remax",
                                                                                  "rollout.repetition_penalty=2.0"])
    placed = place(cfg, str(tiny_model_dir))
    maker = placed.maker
    samples, prompts = PromptData(placed.tokenizer, synthetic.generate("train", 3, seed=0), 64)(range(3))
    # reward = 1 for responses whose text length is odd: greedy and sampled responses then differ in reward
    maker.rewards.reward_fn = lambda ds, text, gt, extra=None: float(len(text) % 2)
    # DAPO's overlong penalty past 4 tokens: the baseline is shaped like the rewards it is taken from
    maker.rewards.overlong_buffer_len, maker.rewards.max_new_tokens = 4, 8
    ro = maker.engine.generate(prompts, maker.sampling_params(1))
    scored = maker.score(ro, samples, prompts)
    # the greedy response under the rollouts' repetition penalty, which changes the likeliest tokens
    greedy = maker.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8,
                                                           repetition_penalty=2.0))
    plain = maker.engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    assert not torch.equal(plain.response_ids, greedy.response_ids)
    texts = placed.tokenizer.batch_decode(greedy.response_ids.masked_fill(~greedy.response_mask, 0),
                                          skip_special_tokens=True)
    penalty = overlong_penalty(greedy.response_lengths, 8, 4, 1.0)
    assert penalty.min() < 0  # some greedy response is long enough to be penalised
    expected = (torch.tensor([float(len(t) % 2) for t in texts]) + penalty)[ro.group]
    assert torch.equal(scored.baseline, expected)


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_kl_in_reward_with_adaptive_controller(estimator, tiny_model_dir, tmp_path):
    over = _overrides(tiny_model_dir, tmp_path, "klr", 3, 3) + [
        f"algorithm.adv_estimator={estimator}", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive",
        "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100", "actor.use_kl_loss=false"]
    train_grpo(load_config(None, over))
    rows = [json.loads(x) for x in (tmp_path / "klr" / "logs" / "metrics.jsonl").read_text().splitlines()][1:]
    coef = 0.1
    for r in rows:  # each step uses the current coefficient, then updates it from the measured KL
        assert r["actor/reward_kl_penalty_coeff"] == pytest.approx(coef)
        coef *= 1 + min(max(r["actor/reward_kl_penalty"] / 0.01 - 1, -0.2), 0.2) * 16 / 100
    state = torch.load(tmp_path / "klr" / "checkpoints" / "global_step_3" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["kl_ctrl"]["value"] == pytest.approx(coef)


def test_a_resume_may_turn_on_a_kl_penalty_but_not_change_the_placement(tiny_model_dir, tmp_path):
    """The KL controller of a run saved without one starts from its config; a checkpoint of the in-process loop
    resumed under pipeline.placement=zmq (whose data order is kept as leases) is one line, not a KeyError."""
    from alignrl.runtime.ports import free_ports

    train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "late", 2, 2)))
    on = _overrides(tiny_model_dir, tmp_path, "late", 3, 3) + [
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl_type=adaptive", "algorithm.kl_coef=0.1"]
    train_grpo(load_config(None, on))
    rows = [json.loads(x) for x in (tmp_path / "late" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[3]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    ports = free_ports(2)
    zmq = _overrides(tiny_model_dir, tmp_path, "late", 4, 4) + [
        "pipeline.placement=zmq", f"pipeline.data_port={ports[0]}", f"pipeline.sync_port={ports[1]}"]
    with pytest.raises(ConfigError, match="was written under another pipeline.placement") as e:
        train_grpo(load_config(None, zmq))
    assert "\n" not in str(e.value)


def test_reward_model_folder_is_the_reward(tiny_model_dir, tmp_path):
    """algorithm.reward_model=DIR (an `alignrl train rm` folder): its scores are the rewards the loop trains on."""
    from transformers import AutoModelForSequenceClassification

    from alignrl.models.value import ModelScorer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(tmp_path / "rm")
    train_grpo(load_config(None, _overrides(tiny_model_dir, tmp_path, "rm_run", 1, 1)
                           + [f"algorithm.reward_model={tmp_path / 'rm'}"]))
    row = [json.loads(x) for x in (tmp_path / "rm_run" / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["reward/accuracy"] == 0.0  # the random policy never answers correctly by the rule...
    assert row["reward/std"] > 0  # ...yet its rewards vary: they are the model's scores
    assert ModelScorer(str(tmp_path / "rm")).model.config.num_labels == 1
