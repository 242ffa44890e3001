"""Hand-worked values for the advantage, KL and policy-loss functions."""

import math

import pytest
import torch

from alignrl.core.advantages import grpo_advantages
from alignrl.core.losses import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, ppo_clip_loss, token_mean


def test_grpo_advantages_hand_worked():
    # group 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5) = 0.7071 -> +-0.7071
    # group 1: rewards 1, 1, 1 -> all equal -> 0
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 1, 1, 1])
    adv = grpo_advantages(r, g, norm_by_std=True, eps=0.0 + 1e-12)
    assert torch.allclose(adv, torch.tensor([0.7071, -0.7071, 0.0, 0.0, 0.0]), atol=1e-4)


def test_dr_grpo_has_no_std_division():
    # mean of (3, 1) is 2 -> advantages (1, -1) regardless of the spread
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]))


def test_group_of_one_gets_zero_not_nan():
    adv = grpo_advantages(torch.tensor([5.0, 1.0, 0.0]), torch.tensor([0, 1, 1]))
    assert adv[0] == 0.0 and torch.isfinite(adv).all()


def test_grpo_vectorised_matches_loop():
    torch.manual_seed(0)
    r = torch.rand(24)
    g = torch.arange(6).repeat_interleave(4)
    adv = grpo_advantages(r, g, norm_by_std=True)
    for k in range(6):
        x = r[g == k]
        expect = (x - x.mean()) / (x.std() + 1e-6)
        assert torch.allclose(adv[g == k], expect, atol=1e-6)


def test_kl_estimators_hand_worked():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(0.25) - math.log(0.5)  # log q - log p = -log 2
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(math.exp(d) - d - 1)  # 0.5 - (-0.693) - 1 = 0.1931
    assert KL_ESTIMATORS["low_var_kl"] is kl_k3 and KL_ESTIMATORS["mse"] is kl_k2


def test_ppo_clip_hand_worked():
    # ratio e^0.5 = 1.6487 with A=+1: clipped at 1.2 -> loss -1.2 (clip active)
    # ratio e^-0.5 = 0.6065 with A=+1: unclipped -0.6065 is larger than clipped -0.8 -> -0.6065
    logp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    loss, m = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    assert loss.item() == pytest.approx((-1.2 - math.exp(-0.5)) / 2, abs=1e-5)
    assert m["actor/clipfrac"] == pytest.approx(0.5)


def test_clip_higher_is_asymmetric():
    logp, old = torch.tensor([[0.25]]), torch.zeros(1, 1)  # ratio 1.284
    low, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    high, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert low.item() == pytest.approx(-1.2) and high.item() == pytest.approx(-1.28)


def test_ratio_is_finite_for_huge_log_ratio():
    loss, _ = ppo_clip_loss(torch.tensor([[500.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_token_mean_invariant_to_micro_batch_split(splits):
    torch.manual_seed(0)
    x = torch.randn(8, 5, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.3).float()
    full = token_mean(x**2, mask)
    (g_full,) = torch.autograd.grad(full, x)
    total = float(mask.sum())
    parts = sum(token_mean(x[i::splits] ** 2, mask[i::splits], total) for i in range(splits))
    (g_parts,) = torch.autograd.grad(parts, x)
    assert torch.allclose(full, parts, atol=1e-6) and torch.allclose(g_full, g_parts, atol=1e-7)


def test_lr_schedules_after_warm_up():
    """Linear warm-up, then constant, cosine (verl's, OpenRLHF's) or linear (TRL's) decay down to min_lr_ratio."""
    from alignrl.core.optim import lr_lambda

    linear = lr_lambda(2, 10, "linear", 0.0)
    assert [linear(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert linear(6) == pytest.approx(0.5) and linear(10) == 0.0 and linear(12) == 0.0
    floored = lr_lambda(0, 4, "linear", 0.1)
    assert floored(2) == pytest.approx(0.55) and floored(4) == pytest.approx(0.1)
    cosine = lr_lambda(0, 4, "cosine", 0.1)
    assert cosine(1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))) and cosine(4) == pytest.approx(0.1)
    assert lr_lambda(1, 4, "constant", 0.1)(3) == 1.0
