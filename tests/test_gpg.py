"""GPG (Group Policy Gradient): verl's advantage (alpha-scaled group baseline) and loss (-A log pi); GMPO's
geometric-mean loss; runs of both in verl's spellings."""

import json

import pytest
import torch

from alignrl.config import load_config
from alignrl.core.advantages import ADVANTAGES, OutcomeInputs, gpg_advantages
from alignrl.core.losses import POLICY_LOSSES, gpg_loss

pytestmark = pytest.mark.timeout(240)


def test_gpg_advantages_are_verls_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 holds one sample
    alpha = 7 / 4  # the batch's size over its nonzero rewards
    expect = alpha * torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.5])  # a lone sample keeps its reward
    torch.testing.assert_close(gpg_advantages(rewards, group), expect)
    assert torch.equal(gpg_advantages(torch.zeros(4), torch.tensor([0, 0, 1, 1])), torch.zeros(4))  # no reward: 0
    # over ranks: alpha counts the whole batch (here a rank that sees its half and a sum doubling the counts)
    torch.testing.assert_close(gpg_advantages(rewards, group, sum_ranks=lambda t: 2 * t), expect)
    x = OutcomeInputs(rewards, rewards[:, None], torch.ones(7, 1), group)
    torch.testing.assert_close(ADVANTAGES["gpg"](x), expect)


def test_gpg_loss_is_minus_advantage_times_log_prob_with_no_ratio():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = logp.detach() + torch.tensor([[0.7, -0.4], [2.0, 0.0]])  # far from the policy: no clip applies
    adv, mask = torch.tensor([1.0, -2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = gpg_loss(logp, old, adv, mask)
    # token-mean of -A log pi over the 3 trained tokens
    assert loss.item() == pytest.approx(-(1.0 * -1.0 + 1.0 * -2.0 + -2.0 * -0.5) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -1.0], [2.0, 0.0]]) / 3)
    assert "actor/clipfrac" in metrics and metrics["actor/clipfrac"] == 0.0
    assert POLICY_LOSSES["gpg"] is gpg_loss


def test_verls_gpg_spellings_select_it_and_a_run_trains(tiny_model_dir, tmp_path, cli_in_process):
    """examples/gpg_trainer/run_qwen2-7b_math.sh's keys: adv_estimator=gpg and GPG's loss, by its old switch
    (use_gpg_loss) or its current one (policy_loss.loss_mode)."""
    from conftest import SMALL_GRPO, run_settings

    for switch in ("actor_rollout_ref.actor.use_gpg_loss=True", "actor_rollout_ref.actor.policy_loss.loss_mode=gpg"):
        cfg = load_config(None, ["algorithm.adv_estimator=gpg", switch])
        assert (cfg.algorithm.adv_estimator, cfg.actor.policy_loss) == ("gpg", "gpg")
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", "algorithm.adv_estimator=gpg",
                         "actor.policy_loss=gpg", *run_settings(tmp_path, "gpg", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "gpg" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r or "actor/grad_norm" in r] == [1, 2]
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", "actor.policy_loss=gmpo",
                         "actor.clip_ratio_low=0.4", "actor.clip_ratio_high=0.4", *run_settings(tmp_path, "gmpo", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]


def _gmpo_by_hand(logp, old, adv, mask, low, high):
    """verl's geo_mean loss written out one sequence at a time."""
    losses = []
    for i in range(logp.shape[0]):
        keep = mask[i].bool()
        lr, a = (logp[i] - old[i])[keep], adv[i][keep]
        clipped = lr.clamp(-low, high)
        pessimistic = torch.where(a >= 0, torch.minimum(lr, clipped), torch.maximum(lr, clipped))
        losses.append(-a.mean() * torch.exp(pessimistic.mean()))
    return torch.stack(losses).mean()


def test_gmpo_loss_is_verls_geometric_mean_loss_and_verls_spelling_selects_it():
    from alignrl.core.losses import gmpo_loss

    torch.manual_seed(0)
    logp = (-torch.rand(3, 5) * 2).requires_grad_()
    old = logp.detach() + torch.randn(3, 5) * 0.6  # some log-ratios beyond ±0.4: clipped on one side
    adv = torch.tensor([1.5, -0.7, 0.3])[:, None].expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    loss, metrics = gmpo_loss(logp, old, adv, mask, 0.4, 0.4, global_seqs=3.0)
    logp2 = logp.detach().clone().requires_grad_()
    expect = _gmpo_by_hand(logp2, old, adv, mask, 0.4, 0.4)
    torch.testing.assert_close(loss, expect)
    loss.backward()
    expect.backward()
    torch.testing.assert_close(logp.grad, logp2.grad)
    assert 0.0 < metrics["actor/clipfrac"] < 1.0
    assert POLICY_LOSSES["gmpo"] is gmpo_loss
    assert load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"]).actor.policy_loss == "gmpo"
