"""Safe-MM-DPO's loss and λ update against a re-derivation in plain Python floats."""

import math

import pytest
import torch

from alignrl.core.safe_mm_dpo import (LagrangeState, dynamic_beta, expected_cost, lambda_step,
                                      safe_mm_dpo_loss)


def _beta(b0, w, k, d):
    return min(max(b0 * (1 + w * (1 - math.exp(-k * abs(d)))), b0), (1 + w) * b0)


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_dynamic_beta_grows_with_the_margin_and_stays_in_its_band():
    d = torch.tensor([0.0, 0.3, -0.3, 2.0, 1e6, -1e6])
    got = dynamic_beta(0.1, 0.5, 0.5, d)
    want = [_beta(0.1, 0.5, 0.5, float(x)) for x in d]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    assert got[0] == pytest.approx(0.1) and got[-1] == pytest.approx(0.15)  # β_ori at δ=0, (1+w)β_ori at |δ|→∞
    assert got[1] == got[2]  # |δ|: a noisy label (δ<0) is as confident as its mirror
    # w < 0 (a band upside down) still clamps into [ (1+w)β, β ]
    assert dynamic_beta(0.1, -0.5, 1.0, torch.tensor([10.0])).item() == pytest.approx(0.1 * (1 - 0.5 * (1 - math.exp(-10))))
    d = torch.tensor([1.0], requires_grad=True)
    assert not dynamic_beta(0.1, 0.5, 0.5, d).requires_grad  # a constant of the loss


def test_loss_matches_the_hand_derivation():
    pc, pr = [-3.0, -5.0], [-4.0, -4.5]
    rc, rr = [-3.5, -5.0], [-3.8, -4.0]
    hc, hr = [1.0, 0.2], [0.0, 0.9]
    sc, sr = [0.5, -1.0], [-0.5, 1.0]
    kl = [0.3, 0.1]
    b0, w, k, lam, klc = 0.1, 0.5, 0.5, 2.0, 0.1
    lh = ls = 0.0
    for i in range(2):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        lh += -_logsig(_beta(b0, w, k, hc[i] - hr[i]) * h)
        ls += -_logsig(_beta(b0, w, k, sc[i] - sr[i]) * h)
    gp = 4.0  # a global batch of 4 pairs of which these are 2
    want = lh / gp / (1 + lam) + lam * ls / gp / (1 + lam) + klc * sum(kl) / gp
    t = lambda v: torch.tensor(v, requires_grad=False)  # noqa: E731
    policy_c = torch.tensor(pc, requires_grad=True)
    loss, m = safe_mm_dpo_loss(policy_c, t(pr), t(rc), t(rr), b0, gp, help_chosen=t(hc), help_rejected=t(hr),
                               safety_chosen=t(sc), safety_rejected=t(sr), safety_lambda=lam, w=w, k=k, kl=t(kl),
                               kl_coeff=klc)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    assert m["loss_helpful"] == pytest.approx(lh / 2, rel=1e-6) and m["loss_safety"] == pytest.approx(ls / 2, rel=1e-6)
    assert m["loss_total"] == pytest.approx(want * 2, rel=1e-6) and m["lambda"] == 2.0
    assert m["delta_helpful_mean"] == pytest.approx(0.15) and m["delta_safety_mean"] == pytest.approx(-0.5)
    assert m["reward_safety_mean"] == pytest.approx(0.0) and m["kl_divergence"] == pytest.approx(0.2)
    assert m["beta_safety_mean"] == pytest.approx((_beta(b0, w, k, 1.0) + _beta(b0, w, k, -2.0)) / 2, rel=1e-6)
    loss.backward()
    # d/d pc_i of -log σ(β h) is -β·σ(-β h); mixed by 1/(1+λ), λ/(1+λ) and scaled by 1/gp
    h0 = (pc[0] - rc[0]) - (pr[0] - rr[0])
    bh, bs = _beta(b0, w, k, 1.0), _beta(b0, w, k, 1.0)
    g0 = (-bh * (1 - math.exp(_logsig(bh * h0))) / (1 + lam) - lam * bs * (1 - math.exp(_logsig(bs * h0))) / (1 + lam)) / gp
    assert policy_c.grad[0].item() == pytest.approx(g0, rel=1e-5)


def test_lambda_zero_is_helpful_dpo_and_large_lambda_is_safety_dpo():
    z = torch.zeros(3)
    pc, pr = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-2.0, -1.0, -3.5])
    kw = dict(help_chosen=torch.tensor([1.0, 0.0, 2.0]), help_rejected=z, safety_chosen=z,
              safety_rejected=torch.tensor([3.0, 0.0, 0.0]))
    l0, m0 = safe_mm_dpo_loss(pc, pr, z, z, 0.1, safety_lambda=0.0, **kw)
    assert float(l0) == pytest.approx(m0["loss_helpful"])
    l1, m1 = safe_mm_dpo_loss(pc, pr, z, z, 0.1, safety_lambda=1e9, **kw)
    assert float(l1) == pytest.approx(m1["loss_safety"], rel=1e-6)
    with pytest.raises(ValueError, match="kl_coeff > 0 needs"):
        safe_mm_dpo_loss(pc, pr, z, z, 0.1, safety_lambda=1.0, kl_coeff=0.1, **kw)


def test_expected_cost_weights_costs_by_the_policys_choice():
    s, n = expected_cost(torch.tensor([0.0, -1.0]), torch.tensor([0.0, -3.0]), torch.tensor([2.0, -1.0]),
                         torch.tensor([4.0, 5.0]))
    p = 1 / (1 + math.exp(-2.0))  # softmax(-1, -3) of the chosen one
    assert n == 2 and s == pytest.approx(0.5 * 2 + 0.5 * 4 + p * -1 + (1 - p) * 5, rel=1e-6)


def test_lambda_update_is_safe_rlhf_eq31_with_an_ema():
    lam, ema = 1.0, None
    trace = []
    for cost in (0.4, -1.0, 0.2):
        j = cost + 0.1  # cost_threshold d
        ema = j if ema is None else 0.95 * ema + 0.05 * j
        lam = min(max(math.exp(math.log(lam) + 0.5 * lam * ema), 1e-6), 10.0)
        trace.append((lam, ema))
    state = LagrangeState(1.0)
    for cost, (want_lam, want_ema) in zip((0.4, -1.0, 0.2), trace):
        state.step(cost, 0.5, 0.1)
        assert state.value == pytest.approx(want_lam, rel=1e-12) and state.cost_ema == pytest.approx(want_ema)
    assert state.updates == 3 and state.value > 1.0  # costs above the threshold on average: λ rose
    # λ falls for a safe policy, and stays inside [1e-6, 10]
    assert lambda_step(1.0, None, -0.5, 0.1, 0.0)[0] == pytest.approx(math.exp(-0.05))
    assert lambda_step(9.0, 10.0, 10.0, 1.0, 0.0)[0] == 10.0
    assert lambda_step(1e-6, -10.0, -10.0, 1.0, 0.0)[0] == 1e-6
    assert lambda_step(2.0, 0.3, float("nan"), 1.0, 0.0) == (2.0, 0.3)
    # checkpoint round trip
    again = LagrangeState(5.0)
    again.load_state_dict(state.state_dict())
    assert again == state
