"""PPO-Lagrangian pieces with hand-worked values."""

import math

import pytest
import torch

from alignrl.core.advantages import gae_advantages
from alignrl.core.lagrangian import LagrangeMultiplier, safe_advantages, safe_gae_advantages


def test_safe_advantage_hand_worked():
    # lambda = 1: (A_r - A_c) / 2 -> (1 - 3) / 2 = -1 and (2 - 0) / 2 = 1
    out = safe_advantages(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), 1.0)
    assert out.tolist() == [-1.0, 1.0]
    # lambda = 0 leaves the reward advantage unchanged
    assert safe_advantages(torch.tensor([0.5]), torch.tensor([9.0]), 0.0).item() == 0.5


def test_multiplier_steps_in_log_space_on_the_window_mean_as_safe_rlhf():
    # log lambda += lr * (J_c - d) * lambda, J_c the mean of the window's episode costs
    lam = LagrangeMultiplier(init=1.0, lr=0.05, threshold=0.0, window=4)
    log = 0.0
    for step, costs in enumerate([[2.0], [2.0, 2.0], [-1.0]], start=1):
        got = lam.update(step, costs)
        window = [2.0, 2.0, 2.0] if step == 2 else [2.0, 2.0, 2.0, -1.0] if step == 3 else [2.0]
        log += 0.05 * (sum(window) / len(window)) * math.exp(log)
        assert got == pytest.approx(math.exp(log))
    assert lam.update(4, [-9.0]) == pytest.approx(math.exp(log + 0.05 * (-3.0 / 2) * math.exp(log)))  # 2, 2, -1, -9
    assert lam.value > 0  # never negative, and never 0: a log


def test_a_violation_that_lasts_grows_lambda_to_its_cap_not_past_a_float():
    """The step grows with lambda: 5 over the limit went 1.6, 3.8, 24.6, 5.5e6, then exp overflowed and the run
    ended in a traceback. Capped at lambda_max (100 by default), or at e^50 without one."""
    for cap, top in ((100.0, 100.0), (None, math.exp(LagrangeMultiplier.LOG_CAP))):
        lam = LagrangeMultiplier(init=1.0, lr=0.1, max_value=cap)
        values = [lam.update(step, [5.0]) for step in range(1, 40)]
        assert values[-1] == pytest.approx(top) and all(math.isfinite(v) for v in values)


def test_multiplier_waits_its_delay_and_stays_under_its_cap():
    lam = LagrangeMultiplier(init=1.0, lr=1.0, max_value=2.0, delay_steps=2)
    assert lam.update(1, [5.0]) == 1.0 and lam.update(2, [5.0]) == 1.0  # the costs still fill the window
    assert lam.update(3, [5.0]) == pytest.approx(2.0)  # exp(0 + 5) capped at 2
    saved = lam.state_dict()
    assert saved == {"log_value": pytest.approx(math.log(2.0)), "costs": [5.0, 5.0, 5.0]}
    again = LagrangeMultiplier(init=1.0, lr=1.0, max_value=2.0)
    again.load_state_dict(saved)
    assert again.value == pytest.approx(2.0) and list(again.costs) == [5.0, 5.0, 5.0]
    again.load_state_dict({"value": 3.0})  # a checkpoint of the earlier linear multiplier
    assert again.value == pytest.approx(3.0) and not again.costs
    again.load_state_dict({"value": 0.0})  # its inactive 0: from lambda_init (a log of 1e-8 never moved again)
    assert again.value == pytest.approx(1.0)
    with pytest.raises(ValueError, match="init must be > 0"):
        LagrangeMultiplier(init=0.0)


def test_the_kl_penalty_weighs_beta_in_the_combined_advantage_whatever_lambda():
    """The penalty in the reward alone was divided by 1 + lambda (10x weaker at lambda 9); taken out of the
    cost too, the combined advantage moves by exactly the penalty's change."""
    mask = torch.ones(2, 4)
    rewards, costs = torch.zeros(2, 4), torch.zeros(2, 4)
    values, cost_values = torch.zeros(2, 4), torch.zeros(2, 4)
    kl = torch.zeros(2, 4)
    kl_more = kl.clone()
    kl_more[0, 2] = -0.1  # -beta KL with beta 0.1 and one more nat of KL at one token
    for lam in (0.0, 1.0, 9.0):
        base, *_ = safe_gae_advantages(rewards + kl, costs, kl, values, cost_values, mask, lam, whiten=False)
        more, *_ = safe_gae_advantages(rewards + kl_more, costs, kl_more, values, cost_values, mask, lam, whiten=False)
        # gamma = lam_gae = 1: tokens 0-2 of row 0 see the penalty; nothing else moves
        expected = torch.tensor([[-0.1, -0.1, -0.1, 0.0], [0.0] * 4])
        torch.testing.assert_close(more - base, expected, atol=1e-7, rtol=0, msg=f"lambda {lam}")


def test_cost_critic_noise_is_not_whitened_up_when_every_row_is_safe():
    """Whitening the cost advantage alone blew critic noise of 1e-4 up to unit scale; whitened once after
    combining, the advantage is the reward's own."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 6)
    rewards = torch.zeros(8, 6)
    rewards[:, -1] = torch.randn(8, generator=g)
    values = 0.1 * torch.randn(8, 6, generator=g)
    cost_values = 1e-4 * torch.randn(8, 6, generator=g)
    adv, returns, cost_returns = safe_gae_advantages(rewards, torch.zeros(8, 6), None, values, cost_values, mask, 1.0)
    reward_only, reward_returns = gae_advantages(rewards, values, mask, whiten=True)
    assert float((adv - reward_only).abs().max()) < 1e-3
    torch.testing.assert_close(returns, reward_returns)
    assert float(cost_returns.abs().max()) < 1e-3  # the cost critic's targets are the (zero) costs
