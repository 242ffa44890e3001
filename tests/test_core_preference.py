"""Preference losses: hand-worked values, split invariance, gradient direction, safe-DPO reductions."""

import math

import pytest
import torch

from alignrl.core.preference import (BATCH_SORTED_LOSSES, DPO_LOSSES, bradley_terry_loss, dpo_ipo_loss,
                                     dpo_sigmoid_loss, odpo_loss, reward_accuracy, safe_odpo_loss,
                                     safe_preference_offset, safe_rlhf_cost_loss, slic_hinge_loss)


def nls(x: float) -> float:
    """-log σ(x) = log(1 + e^-x)."""
    return math.log1p(math.exp(-x))


T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731

# two pairs; h = (pc - rc) - (pr - rr) = [(-1+2) - (-3+2), 0 - 0] = [2, 0]
PC, PR, RC, RR, BETA = T(-1.0, -2.0), T(-3.0, -2.0), T(-2.0, -2.0), T(-2.0, -2.0), 0.5


def test_reward_accuracy_counts_ties_half():
    assert reward_accuracy(T(1, 0, -1), T(0, 0, 0)).tolist() == [1.0, 0.5, 0.0]


def test_bradley_terry_hand_worked():
    loss, m = bradley_terry_loss(T(1.0, 0.0), T(0.0, 0.0))
    assert loss.item() == pytest.approx((nls(1) + nls(0)) / 2)  # (0.3133 + 0.6931) / 2
    assert m["rm/accuracy"] == 0.75 and m["rm/score_margin"] == pytest.approx(0.5)
    # Llama-2 margin: the first pair must win by 1, so its logit is 1 - 0 - 1 = 0
    loss, _ = bradley_terry_loss(T(1.0, 0.0), T(0.0, 0.0), margin=T(1.0, 0.0))
    assert loss.item() == pytest.approx(math.log(2))
    # the sum is divided by the global pair count, not the local one
    loss, _ = bradley_terry_loss(T(1.0, 0.0), T(0.0, 0.0), global_pairs=4)
    assert loss.item() == pytest.approx((nls(1) + nls(0)) / 4)


def test_safe_rlhf_cost_loss_hand_worked():
    # chosen (safer) costs -1 (safe) and 0.5 (unsafe); rejected 2 and 1 (both unsafe)
    loss, m = safe_rlhf_cost_loss(T(-1.0, 0.5), T(2.0, 1.0), T(0, 1), T(1, 1))
    pair = nls(2 - (-1)) + nls(1 - 0.5)
    # sign terms -log σ(s·c), s = +1 unsafe / -1 safe: row 0: s=-1,c=-1 and s=+1,c=2; row 1: +0.5, +1
    sign = nls(1) + nls(2) + nls(0.5) + nls(1)
    assert loss.item() == pytest.approx((pair + sign) / 2, rel=1e-5)
    assert m["cost/accuracy"] == 1.0 and m["cost/sign_accuracy"] == 1.0
    # a safe response with a positive cost is a sign error and costs more
    worse, m2 = safe_rlhf_cost_loss(T(1.0, 0.5), T(2.0, 1.0), T(0, 1), T(1, 1))
    assert worse.item() > loss.item() and m2["cost/sign_accuracy"] == 0.75
    # classification_loss_weight scales the sign (classification) term alone
    for weight in (0.0, 2.5):
        weighted, _ = safe_rlhf_cost_loss(T(-1.0, 0.5), T(2.0, 1.0), T(0, 1), T(1, 1), sign_weight=weight)
        assert weighted.item() == pytest.approx((pair + weight * sign) / 2, rel=1e-5)


def test_dpo_family_hand_worked():
    loss, m = dpo_sigmoid_loss(PC, PR, RC, RR, BETA)
    assert loss.item() == pytest.approx((nls(1.0) + nls(0.0)) / 2)  # β·h = [1, 0]
    assert m["rewards/chosen"] == pytest.approx(0.25)  # β(pc - rc) = [0.5, 0]
    assert m["rewards/rejected"] == pytest.approx(-0.25)  # β(pr - rr) = [-0.5, 0]
    assert m["rewards/accuracy"] == 0.75 and m["rewards/margin"] == pytest.approx(0.5)
    # IPO: (h - 1/(2β))² = (2 - 1)², (0 - 1)²
    assert dpo_ipo_loss(PC, PR, RC, RR, BETA)[0].item() == pytest.approx(1.0)
    # label smoothing ε = 0.1 is conservative DPO, as TRL's sigmoid loss: 0.9·nls(z) + 0.1·nls(-z) per pair
    expect = ((0.9 * nls(1) + 0.1 * nls(-1)) + (0.9 * nls(0) + 0.1 * nls(0))) / 2
    for name in ("sigmoid", "cdpo"):
        assert DPO_LOSSES[name](PC, PR, RC, RR, BETA, label_smoothing=0.1)[0].item() == pytest.approx(expect)
    # hinge: relu(1 - β·h) = [0, 1]
    assert slic_hinge_loss(PC, PR, RC, RR, BETA)[0].item() == pytest.approx(0.5)
    # ODPO: an offset of 1 on the first pair cancels its β·h = 1
    assert odpo_loss(PC, PR, RC, RR, BETA, offset=T(1.0, 0.0))[0].item() == pytest.approx(math.log(2))


def test_safe_preference_offset_and_loss_hand_worked():
    # u = r - λc: pair 0: u_c = 1, u_r = 0 (kept, gap 1); pair 1: u_c = 0 - 2 = -2, u_r = 0 (swapped, gap 2)
    hc, hr, cc, cr = T(1.0, 0.0), T(0.0, 0.0), T(0.0, 2.0), T(0.0, 0.0)
    swap, offset = safe_preference_offset(hc, hr, cc, cr, safety_lambda=1.0, offset_alpha=1.0)
    assert swap.tolist() == [False, True]
    assert offset.tolist() == pytest.approx([math.log(2), math.log(3)])
    loss, m = safe_odpo_loss(PC, PR, RC, RR, BETA, help_chosen=hc, help_rejected=hr, cost_chosen=cc,
                             cost_rejected=cr, safety_lambda=1.0, offset_alpha=1.0)
    # pair 0: β·h - Δ = 1 - log 2; pair 1 swapped: β·(-h) - Δ = 0 - log 3
    assert loss.item() == pytest.approx((nls(1 - math.log(2)) + nls(-math.log(3))) / 2, rel=1e-5)
    assert m["safe/swapped_frac"] == 0.5
    assert m["rewards/accuracy"] == 0.75  # reported on the labelled order
    # λ = 0 ignores the cost model: no swap, pair 1 has no gap and no offset
    swap0, off0 = safe_preference_offset(hc, hr, cc, cr, safety_lambda=0.0, offset_alpha=1.0)
    assert swap0.tolist() == [False, False] and off0.tolist() == pytest.approx([math.log(2), 0.0])


def test_safe_loss_with_equal_scores_is_dpo():
    z = torch.zeros(2)
    safe, _ = safe_odpo_loss(PC, PR, RC, RR, BETA, help_chosen=z, help_rejected=z, cost_chosen=z, cost_rejected=z)
    assert safe.item() == pytest.approx(dpo_sigmoid_loss(PC, PR, RC, RR, BETA)[0].item())


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_trls_other_pairwise_losses_hand_worked():
    """TRL's formulas on the two pairs above: log-ratios a = pc - rc = [1, 0], b = pr - rr = [-1, 0], β = 0.5."""
    def loss(name, **kw):
        return DPO_LOSSES[name](PC, PR, RC, RR, BETA, **kw)[0].item()

    ls = 0.1
    assert loss("robust", label_smoothing=ls) == pytest.approx(
        ((0.9 * nls(1) - 0.1 * nls(-1)) / 0.8 + math.log(2)) / 2, rel=1e-6)
    exo = [sig(z) * (-nls(z) - math.log(0.9)) + sig(-z) * (-nls(-z) - math.log(0.1)) for z in (1.0, 0.0)]
    assert loss("exo_pair", label_smoothing=ls) == pytest.approx(sum(exo) / 2, rel=1e-6)
    assert loss("nca_pair") == pytest.approx((nls(0.5) + 0.5 * nls(-0.5) + 0.5 * nls(0.5) + 2 * math.log(2)) / 2)
    assert loss("sppo_hard") == pytest.approx((0.0 + 2.0) / 2)  # (a - 1)² + (b + 1)²
    assert loss("apo_zero") == pytest.approx((1 - sig(0.5) + sig(-0.5) + 1.0) / 2, rel=1e-6)
    assert loss("apo_down") == pytest.approx((sig(0.5) + 1 - sig(1.0) + 1.0) / 2, rel=1e-6)
    disco = [nls(z) * (1 - sig(z / 0.05)) + math.exp(-z) * sig(z / 0.05) for z in (1.0, 0.0)]
    assert loss("discopop") == pytest.approx(sum(disco) / 2, rel=1e-6)
    assert loss("discopop", discopop_tau=1.0) != pytest.approx(loss("discopop"))
    # aot_pair: sorted a = [0, 1] against sorted b = [-1, 0]: both gaps 1
    assert loss("aot_pair") == pytest.approx(nls(0.5))
    # aot sorts the policy's gaps pc - pr = [0, 2] and the reference's rc - rr = [1, -1] -> [-1, 1] apart: [1, 1],
    # where the unsorted pairs would be [-1, 3]
    aot, _ = DPO_LOSSES["aot"](T(0.0, 2.0), T(0.0, 0.0), T(1.0, -1.0), T(0.0, 0.0), BETA)
    assert aot.item() == pytest.approx(nls(0.5))


def test_reference_free_losses_hand_worked():
    """Token-mean log-probs ā_c = [-0.5, -1], ā_r = [-1, -1] (the reference terms are zeros)."""
    c, r, zero = T(-0.5, -1.0), T(-1.0, -1.0), T(0.0, 0.0)
    simpo, _ = DPO_LOSSES["simpo"](c, r, zero, zero, 2.0, simpo_gamma=0.5)
    assert simpo.item() == pytest.approx((nls(2.0 * 0.5 - 0.5) + nls(-0.5)) / 2)
    cpo, _ = DPO_LOSSES["cpo"](c, r, zero, zero, 2.0)
    assert cpo.item() == pytest.approx((nls(1.0) + nls(0.0)) / 2)
    nll = T(0.5, 1.0)
    orpo, m = DPO_LOSSES["orpo"](c, r, zero, zero, 0.1, nll=nll)
    odds = lambda a: a - math.log1p(-math.exp(a))  # noqa: E731  log(p / (1 - p)) of p = e^a
    expect = [n - 0.1 * -nls(odds(a) - odds(b)) for n, a, b in ((0.5, -0.5, -1.0), (1.0, -1.0, -1.0))]
    assert orpo.item() == pytest.approx(sum(expect) / 2, rel=1e-6)
    assert m["orpo/log_odds_chosen"] == pytest.approx((odds(-0.5) - odds(-1.0)) / 2, rel=1e-6)


@pytest.mark.parametrize("name", sorted(set(DPO_LOSSES) - set(BATCH_SORTED_LOSSES)))
def test_losses_sum_over_splits(name):
    """Micro-batches (or ranks) each dividing by the global pair count add up to the full-batch loss."""
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g) * 3 for _ in range(4))
    extra, fixed = {}, {}
    if name in ("safe", "safe_odpo"):
        extra = {k: torch.randn(8, generator=g) for k in ("help_chosen", "help_rejected", "cost_chosen", "cost_rejected")}
    if name == "orpo":
        extra = {"nll": torch.rand(8, generator=g)}
    if name == "safe_mm_dpo":
        extra = {k: torch.randn(8, generator=g) for k in ("help_chosen", "help_rejected", "safety_chosen",
                                                          "safety_rejected", "kl")}
        fixed = {"safety_lambda": 0.7, "kl_coeff": 0.1}
    full, _ = DPO_LOSSES[name](pc, pr, rc, rr, 0.1, label_smoothing=0.2, **extra, **fixed)
    parts = sum(DPO_LOSSES[name](pc[i:i + 3], pr[i:i + 3], rc[i:i + 3], rr[i:i + 3], 0.1, 8, label_smoothing=0.2,
                                 **{k: v[i:i + 3] for k, v in extra.items()}, **fixed)[0] for i in (0, 3, 6))
    assert parts.item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.parametrize("name", ["sigmoid", "cdpo", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "sppo_hard",
                                  "apo_zero", "aot", "aot_pair"])  # discopop's blend pushes back at h = 0
def test_dpo_gradients_raise_chosen_and_lower_rejected(name):
    pc, pr = T(-2.0, -3.0).requires_grad_(), T(-2.0, -3.0).requires_grad_()
    loss, _ = DPO_LOSSES[name](pc, pr, T(-2.0, -3.0), T(-2.0, -3.0), 0.1, label_smoothing=0.1)
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises log π(chosen), lowers log π(rejected)


def test_reward_and_cost_gradients():
    c, r = T(0.0).requires_grad_(), T(0.0).requires_grad_()
    bradley_terry_loss(c, r)[0].backward()
    assert c.grad.item() < 0 < r.grad.item()
    c, r = T(0.0).requires_grad_(), T(0.0).requires_grad_()
    safe_rlhf_cost_loss(c, r, T(0), T(1))[0].backward()
    assert r.grad.item() < 0 < c.grad.item()  # descent raises the harmful response's cost, lowers the safe one's


def test_bco_pair_hand_worked_and_its_running_mean():
    """TRL's bco_pair: -log σ(r_c - δ) - log σ(-(r_r - δ)), r = β·(log π - log π_ref), δ the running mean of the
    micro-batches' mean rewards (TRL's RunningMoments: count-weighted, starting at 0 with a count of 1e-24)."""
    from alignrl.core.preference import RewardMean, bco_pair_loss

    # rewards β·(pc - rc) = 0.5·[1, 0] = [0.5, 0], β·(pr - rr) = 0.5·[-1, 0] = [-0.5, 0]; δ = 0.25
    loss, m = bco_pair_loss(PC, PR, RC, RR, BETA, bco_delta=0.25)
    expect = (nls(0.5 - 0.25) + nls(0.5 + 0.25)) + (nls(-0.25) + nls(0.25))  # -log σ(-(r_r - δ)) = nls(δ - r_r)
    assert loss.item() == pytest.approx(expect / 2, rel=1e-6) and m["bco/delta"] == 0.25
    assert DPO_LOSSES["bco_pair"](PC, PR, RC, RR, BETA)[0].item() == pytest.approx(
        (nls(0.5) + nls(0.0) + nls(0.5) + nls(0.0)) / 2, rel=1e-6)  # δ = 0: plain per-response BCE
    running = RewardMean()
    assert running.update(2.0) == pytest.approx(2.0, abs=1e-12)  # the first batch sets it
    assert running.update(-1.0) == pytest.approx(0.5) and running.update(0.5, count=2.0) == pytest.approx(0.5)
    assert running.update(4.5, count=4.0) == pytest.approx((2.0 - 1.0 + 2 * 0.5 + 4 * 4.5) / 8)
    again = RewardMean()
    again.load_state_dict(running.state_dict())
    assert again.update(1.0) == running.update(1.0)
    kept = running.mean  # a non-finite micro-batch (its step skipped) leaves δ as it was
    assert running.update(float("nan")) == kept and running.update(float("inf")) == kept


def test_bco_pair_descent_raises_chosen_and_lowers_rejected():
    from alignrl.core.preference import bco_pair_loss

    pc, pr = T(-2.0, -3.0).requires_grad_(), T(-2.0, -3.0).requires_grad_()
    bco_pair_loss(pc, pr, T(-2.0, -3.0), T(-2.0, -3.0), 0.1, bco_delta=0.3)[0].backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()
