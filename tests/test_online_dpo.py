"""Online DPO (algorithm.adv_estimator=online_dpo): the update is the gradient of TRL's online DPO loss, pairs are
chosen as TRL chooses them, the keys it cannot go with are one line, and a run trains and logs the loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from alignrl.config import ConfigError, load_config
from alignrl.config.ref_checks import needs_reference
from alignrl.core.online_dpo import PairInputs, chosen_rejected, online_dpo_advantages, pair_rows
from alignrl.core.shaping import missing_eos_penalty
from alignrl.data.records import Experience
from alignrl.rl.trainer import policy_loss_spec
from alignrl.train.actor import policy_loss

ONLINE = ["model.path=demo", "algorithm.adv_estimator=online_dpo", "rollout.n=2", "data.train_batch_size=4",
          "actor.ppo_mini_batch_size=4", "actor.use_kl_loss=false"]


def trl_loss(logp, ref, mask, rewards, beta: float, loss_type: str) -> torch.Tensor:
    """TRL's OnlineDPOTrainer.training_step loss, written on its own: the first answers of the prompts against the
    second ones, the first chosen when its reward is at least the second's."""
    first, second = torch.arange(0, len(logp), 2), torch.arange(1, len(logp), 2)
    s, r = (logp * mask).sum(1), (ref * mask).sum(1)
    first_wins = rewards[first] >= rewards[second]
    c, j = torch.where(first_wins, first, second), torch.where(first_wins, second, first)
    logits = (s[c] - s[j]) - (r[c] - r[j])
    losses = -F.logsigmoid(beta * logits) if loss_type == "sigmoid" else (logits - 1 / (2 * beta)) ** 2
    return losses.mean()


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, width = 8, 7
    logp = -torch.rand(rows, width, generator=gen) * 3
    ref = logp + 0.3 * torch.randn(rows, width, generator=gen)
    lengths = torch.tensor([7, 3, 5, 1, 6, 6, 2, 4])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, -1.0, 2.0])  # the third pair ties: the first is chosen
    return logp, ref, mask, rewards, torch.arange(rows) // 2


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 2.0), ("ipo", 0.5)])
def test_the_policy_update_is_the_gradient_of_trls_online_dpo_loss(loss_type, beta):
    logp, ref, mask, rewards, group = _batch()
    leaf = logp.clone().requires_grad_(True)
    trl_loss(leaf, ref, mask, rewards, beta, loss_type).backward()
    expected = leaf.grad
    cfg = load_config(None, [*ONLINE, f"algorithm.dpo_beta={beta}", f"algorithm.dpo_loss_type={loss_type}"])
    spec = policy_loss_spec(cfg)
    assert (spec.name, spec.loss_agg) == ("gpg", "seq-mean-token-sum")
    adv, metrics = online_dpo_advantages(PairInputs(rewards, group, (logp * mask).sum(1), (ref * mask).sum(1)),
                                         beta, loss_type)
    ones = torch.ones(len(logp), 2, dtype=torch.long)
    exp = Experience(ones, ones.bool(), ones, mask.bool(), logp, ref, adv)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(leaf, None, exp, spec, float(mask.sum()), float(len(logp)))
    loss.backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-5, atol=1e-7)
    assert float(leaf.grad.abs().sum()) > 0
    assert metrics["dpo/loss"] == pytest.approx(float(trl_loss(logp, ref, mask, rewards, beta, loss_type)), rel=1e-5)


def test_an_answer_with_no_trained_token_leaves_the_pairs_mean_as_it_is():
    """The loss averages over the answers with a trained token; the trainer scales the advantages so the update is
    still the mean over all the pairs."""
    from alignrl.core.aggregation import n_sequences
    from alignrl.rl.trainer import PolicyTrainer

    logp, ref, mask, rewards, group = _batch(1)
    mask[3] = 0.0  # an answer whose every token left the loss
    leaf = logp.clone().requires_grad_(True)
    trl_loss(leaf, ref, mask, rewards, 0.1, "sigmoid").backward()
    expected = leaf.grad
    cfg = load_config(None, ONLINE)
    adv, _ = PolicyTrainer(cfg, None, None).pair_advantages(rewards, group, logp, ref, mask)
    ones = torch.ones(len(logp), 2, dtype=torch.long)
    exp = Experience(ones, ones.bool(), ones, mask.bool(), logp, ref, adv)
    leaf = logp.clone().requires_grad_(True)
    policy_loss(leaf, None, exp, policy_loss_spec(cfg), float(mask.sum()), n_sequences(mask))[0].backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-5, atol=1e-7)


def test_pairs_follow_trls_choice_and_a_group_of_three_is_one_line():
    _, _, _, rewards, group = _batch()
    chosen, rejected = chosen_rejected(PairInputs(rewards, group, torch.zeros(8), torch.zeros(8)))
    assert chosen.tolist() == [0, 3, 4, 7] and rejected.tolist() == [1, 2, 5, 6]
    first, second = pair_rows(torch.tensor([5, 9, 5, 9]))  # rows of a prompt need not be next to each other
    assert first.tolist() == [0, 1] and second.tolist() == [2, 3]
    with pytest.raises(ValueError, match="prompt 2 has 3: set rollout.n=2"):
        pair_rows(torch.tensor([1, 1, 2, 2, 2]))


def test_the_missing_eos_penalty_lowers_only_answers_cut_at_the_cap():
    got = missing_eos_penalty(torch.tensor([1.0, 0.5, -1.0]), torch.tensor([False, True, True]), 2.0)
    assert got.tolist() == [1.0, -1.5, -3.0]


def test_online_dpo_reads_a_reference_and_takes_log_probs_at_temperature_one():
    """TRL's online DPO samples at its temperature and takes every log-prob of the loss from the plain softmax."""
    cfg = load_config(None, [*ONLINE, "rollout.temperature=0.7"])
    assert needs_reference(cfg) and cfg.logprob_temperature == 1.0 and policy_loss_spec(cfg).temperature == 1.0
    grpo = load_config(None, ["model.path=demo", "rollout.temperature=0.7"])
    assert grpo.logprob_temperature == policy_loss_spec(grpo).temperature == 0.7


@pytest.mark.parametrize("given,error", [
    (["rollout.n=4"], "set rollout.n=2 (got 4)"),
    (["actor.ppo_epochs=2"], "takes one optimizer step per batch"),
    (["actor.ppo_mini_batch_size=2"], "2 mini-batches"),
    (["algorithm.use_kl_in_reward=true"], "set actor.use_kl_loss=false and algorithm.use_kl_in_reward=false"),
    (["actor.use_kl_loss=true"], "as TRL's has no other: set actor.use_kl_loss=false"),
    (["algorithm.reward_clip=[-1,1]"], "could make a tie: drop it"),
    (["pipeline.replay_buffer_size=4"], "set pipeline.replay_buffer_size=0"),
    (["actor.entropy_coeff=0.01"], "actor.entropy_coeff adds a term of its own: drop it"),
    (["ptx.data=texts.jsonl"], "ptx.data adds a term of its own: drop it"),
    (["actor.policy_loss=gspo"], "leave both at their defaults"),
    (["actor.loss_agg_mode=token-mean"], "leave both at their defaults"),
    (["algorithm.mask_truncated=true"], "algorithm.mask_truncated weighs or drops some of them"),
    (["actor.recompute_old_logprobs=false"], "set actor.recompute_old_logprobs=true"),
])
def test_keys_online_dpo_cannot_go_with_are_one_line(given, error):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*ONLINE, *given])
    assert error in str(e.value) and "\n" not in str(e.value)


def test_the_dpo_keys_without_online_dpo_are_one_line():
    with pytest.raises(ConfigError, match="algorithm.dpo_beta sets the online DPO loss, read with"):
        load_config(None, ["model.path=demo", "algorithm.dpo_beta=0.2"])


def _without_chat_template(model_dir, tmp_path):
    """A copy of the model whose tokenizer has no chat template (a base model's, as TRL's TL;DR examples use)."""
    import shutil

    out = tmp_path / "plain"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("chat_template.jinja"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": f"Q: {i} + 1 =", "data_source": "openai/gsm8k", "ground_truth": str(i + 1)} for i in range(16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, tmp_path / "rows.jsonl"


def test_a_run_trains_on_the_pairs_and_logs_the_dpo_loss(tiny_model_dir, tmp_path, cli_in_process):
    """Plain-text prompts of a model without a chat template (data.apply_chat_template=false), as TRL reads string
    prompts."""
    from conftest import SMALL_GRPO, run_settings

    plain, rows = _without_chat_template(tiny_model_dir, tmp_path)
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={plain}", f"data.train_files={rows}",
                         f"data.val_files={rows}", "data.apply_chat_template=false", "data.prompt_key=prompt",
                         "algorithm.adv_estimator=online_dpo", "algorithm.missing_eos_penalty=1.0",
                         "actor.use_kl_loss=false", "actor.entropy_coeff=0", *run_settings(tmp_path, "odpo", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "odpo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2
    for key in ("dpo/loss", "rewards/chosen", "rewards/margin", "online_dpo/kl", "online_dpo/scores_margin"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at the first step
    assert all(r["online_dpo/scores_margin"] >= 0 for r in steps)
