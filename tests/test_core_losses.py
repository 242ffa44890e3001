"""Policy losses, value loss and loss aggregation: hand-worked values, micro-batch invariance, finiteness."""

import math

import pytest
import torch

from alignrl.core.aggregation import n_sequences
from alignrl.core.losses import (KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, aggregate_loss, cispo_loss,
                                 gspo_loss, kl_abs, kl_k3, ppo_clip_loss, value_loss)

# ---------------------------------------------------------------- aggregation

# row 0: tokens 1, 2; row 1: token 3; row 2: no tokens (its 5s must never count)
LOSS = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_aggregations_hand_worked():
    # token-mean: (1 + 2 + 3) / 3 tokens = 2
    # seq-mean-token-sum: (3 + 3) / 2 non-empty sequences = 3
    # seq-mean-token-mean: (1.5 + 3) / 2 = 2.25
    # seq-mean-token-sum-norm, max_len 4: (3 + 3) / (2 * 4) = 0.75; default max_len T = 3: 6 / 6 = 1
    assert LOSS_AGGREGATIONS["token-mean"](LOSS, MASK).item() == pytest.approx(2.0)
    assert LOSS_AGGREGATIONS["seq-mean-token-sum"](LOSS, MASK).item() == pytest.approx(3.0)
    assert LOSS_AGGREGATIONS["seq-mean-token-mean"](LOSS, MASK).item() == pytest.approx(2.25)
    assert LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](LOSS, MASK, None, 4).item() == pytest.approx(0.75)
    assert LOSS_AGGREGATIONS["seq-mean-token-sum-norm"](LOSS, MASK).item() == pytest.approx(1.0)
    assert n_sequences(MASK) == 2.0


def test_aggregations_with_global_counts_hand_worked():
    # the third positional argument is the global count each mode divides by: 6 tokens, 4 sequences
    assert LOSS_AGGREGATIONS["token-mean"](LOSS, MASK, 6).item() == pytest.approx(1.0)
    assert LOSS_AGGREGATIONS["seq-mean-token-sum"](LOSS, MASK, 4).item() == pytest.approx(1.5)
    assert LOSS_AGGREGATIONS["seq-mean-token-mean"](LOSS, MASK, 4).item() == pytest.approx(1.125)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_seqs=4, max_len=4).item() == pytest.approx(
        6 / 16)
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, "nope")


def _micro_batches(n_rows: int, splits: int, mask: torch.Tensor):
    # interleaved rows, each micro-batch trimmed to its own longest response as the actor does
    for i in range(splits):
        rows = torch.arange(i, n_rows, splits)
        width = int(mask[rows].sum(-1).max().clamp(min=1))
        yield rows, width


def _split_problem():
    torch.manual_seed(0)
    B, T = 8, 7
    lengths = torch.tensor([7, 3, 0, 5, 1, 6, 2, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return B, T, mask


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_every_aggregation_invariant_to_micro_batch_split(mode, splits):
    B, T, mask = _split_problem()
    x = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    kw = dict(global_tokens=float(mask.sum()), global_seqs=n_sequences(mask), max_len=T)
    full = aggregate_loss(x**2, mask, mode, **kw)
    (g_full,) = torch.autograd.grad(full, x)
    parts = sum(aggregate_loss(x[rows, :w] ** 2, mask[rows, :w], mode, **kw)
                for rows, w in _micro_batches(B, splits, mask))
    (g_parts,) = torch.autograd.grad(parts, x)
    assert full.item() == pytest.approx(parts.item(), rel=1e-12)
    assert torch.allclose(g_full, g_parts, rtol=0, atol=1e-14)


# Clip-Cov and KL-Cov pick their tokens by this micro-batch's covariances and counts, as verl's do: not split-free
@pytest.mark.parametrize("name", sorted(set(POLICY_LOSSES) - {"clip_cov", "kl_cov"}))
@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("splits", [2, 4])
def test_policy_losses_invariant_to_micro_batch_split(name, mode, splits):
    B, T, mask = _split_problem()
    logp = (-torch.rand(B, T, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    kw = dict(loss_agg=mode, global_seqs=n_sequences(mask), max_len=T)
    full, _ = POLICY_LOSSES[name](logp, old, adv, mask, 0.2, 0.2, float(mask.sum()), **kw)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = sum(POLICY_LOSSES[name](logp[r, :w], old[r, :w], adv[r], mask[r, :w], 0.2, 0.2, float(mask.sum()), **kw)[0]
                for r, w in _micro_batches(B, splits, mask))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert full.item() == pytest.approx(parts.item(), rel=1e-12)
    assert torch.allclose(g_full, g_parts, rtol=0, atol=1e-14)


# ---------------------------------------------------------------- KL abs

def test_kl_abs_hand_worked():
    # |log 0.5 - log 0.25| = log 2, either way round
    p, q = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_abs(p, q).item() == pytest.approx(math.log(2)) and kl_abs(q, p).item() == pytest.approx(math.log(2))
    assert KL_ESTIMATORS["abs"] is kl_abs


def test_kl_k3_clamped_to_ten_as_verl():
    # d = ref - logp. d = 2: e^2 - 2 - 1 = 4.389056 (below the bound, unchanged);
    # d = 5: e^5 - 6 = 142.41 -> 10; d = -20: e^-20 + 20 - 1 = 19.0 -> 10 (large on either side)
    logp = torch.zeros(3, requires_grad=True)
    ref = torch.tensor([2.0, 5.0, -20.0])
    k3 = kl_k3(logp, ref)
    assert k3.tolist() == pytest.approx([math.exp(2) - 3, 10.0, 10.0])
    assert KL_ESTIMATORS["low_var_kl"](logp, ref).tolist() == pytest.approx(k3.tolist())
    # a clamped token has no gradient (verl's torch.clamp); dk3/dlogp = 1 - e^d on the free one
    k3.sum().backward()
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(2), 0.0, 0.0])


# ---------------------------------------------------------------- PPO clip: dual clip and IS weight

def test_ppo_dual_clip_hand_worked():
    # ratio 4, A = -1: unclipped -A*r = 4, clipped -A*1.2 = 1.2 -> PPO takes max = 4
    # dual clip c = 3 caps it at -A*c = 3 (and the capped token has no gradient)
    logp = torch.tensor([[math.log(4.0)]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([-1.0])
    plain, _ = ppo_clip_loss(logp, old, adv, mask)
    dual, m = ppo_clip_loss(logp, old, adv, mask, clip_c=3.0)
    assert plain.item() == pytest.approx(4.0) and dual.item() == pytest.approx(3.0)
    assert m["actor/dualclip_frac"] == 1.0
    (g,) = torch.autograd.grad(dual, logp)
    assert g.item() == 0.0
    # A = +1, ratio 4: clipped to -1.2, dual clip only applies to negative advantages
    pos, _ = ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, clip_c=3.0)
    assert pos.item() == pytest.approx(-1.2)
    # A = -1, ratio 2: max(2, 1.2) = 2 < 3 -> untouched
    two, m2 = ppo_clip_loss(torch.tensor([[math.log(2.0)]]), old, adv, mask, clip_c=3.0)
    assert two.item() == pytest.approx(2.0) and m2["actor/dualclip_frac"] == 0.0
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, old, adv, mask, clip_c=1.0)


def test_ppo_default_metrics_keys_unchanged():
    _, m = ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2))
    assert set(m) == {"actor/clipfrac", "actor/ratio_mean", "actor/approx_kl"}


def test_ppo_is_weight_hand_worked():
    # ratio 1, A = 1 -> per-token loss -1; weights 0.5 and 2 -> (-0.5 - 2) / 2 tokens = -1.25
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                            is_weight=torch.tensor([[0.5, 2.0]], requires_grad=True))
    assert loss.item() == pytest.approx(-1.25)
    (g,) = torch.autograd.grad(loss, logp)  # d/dlogp of -w * exp(logp) / 2 = -w / 2
    assert torch.allclose(g, torch.tensor([[-0.25, -1.0]]))


# ---------------------------------------------------------------- GSPO

def test_gspo_hand_worked():
    # token log-ratios 0.2, 0.4 (third token is padding with a wild log-prob that must not count)
    # s = exp(mean(0.2, 0.4)) = exp(0.3) = 1.349859 for every token
    logp = torch.tensor([[0.2, 0.4, 50.0]], requires_grad=True)
    old, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    s = math.exp(0.3)
    # A = +1: clip to 1 + 4e-4 -> max(-1.349859, -1.0004) = -1.0004 per token, no gradient
    loss, m = gspo_loss(logp, old, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.0004, abs=1e-6)
    assert m["actor/clipfrac"] == 1.0 and m["actor/ratio_mean"] == pytest.approx(s, rel=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.all(g == 0)
    # A = -1: max(s, 1.0004) = s per token; seq-mean-token-mean -> loss s;
    # gradient per token = -A * s / |y| = 1.349859 / 2 (the GSPO-token form sg[s] * pi / sg[pi])
    loss, _ = gspo_loss(logp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(s, rel=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.tensor([[s / 2, s / 2, 0.0]]))


@pytest.mark.parametrize("clip", [10.0, 0.05])
def test_gspo_gradient_equals_sequence_objective(clip):
    # GSPO's sequence objective, written directly: -mean_i min(s_i A_i, clip(s_i) A_i)
    torch.manual_seed(0)
    B, T = 6, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 2, 3, 1, 4, 5])[:, None]).double()
    logp = (-torch.rand(B, T, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    loss, _ = gspo_loss(logp, old, adv, mask, clip, clip)
    (g,) = torch.autograd.grad(loss, logp)
    s = (((logp - old) * mask).sum(-1) / mask.sum(-1)).exp()
    ref = -torch.minimum(s * adv, s.clamp(1 - clip, 1 + clip) * adv).mean()
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(g, g_ref, atol=1e-14)


# ---------------------------------------------------------------- CISPO

def test_cispo_hand_worked():
    # log-ratios 0.5, 0: r = 1.6487 -> weight clipped to 1 + 0.28 = 1.28; r = 1 -> weight 1
    # A = 2: per token -w * A * logp = -1.28 * 2 * (-1) = 2.56 and -1 * 2 * (-2) = 4; token mean 3.28
    # gradient -w * A / 2 tokens = -1.28 and -1.0: the clipped token still gets a gradient
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = cispo_loss(logp, torch.tensor([[-1.5, -2.0]]), torch.tensor([2.0]), torch.ones(1, 2), 1.0, 0.28)
    assert loss.item() == pytest.approx(3.28, rel=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.tensor([[-1.28, -1.0]]))
    assert m["actor/clipfrac"] == pytest.approx(0.5)
    # verl's CISPO scripts give clip_ratio_low=10: no lower bound, as 1.0 (a weight far below 1 stays as it is)
    args = (torch.tensor([[-1.0, -4.0]]), torch.tensor([[-1.5, -2.0]]), torch.tensor([2.0]), torch.ones(1, 2))
    assert cispo_loss(*args, 10.0, 0.28)[0].item() == cispo_loss(*args, 1.0, 0.28)[0].item()
    from alignrl.config import load_config

    assert load_config(None, ["actor.policy_loss=cispo", "actor.clip_ratio_low=10"]).actor.clip_ratio_low == 10.0


# ---------------------------------------------------------------- finiteness

@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_losses_finite_for_huge_log_ratios(name, sign):
    logp = torch.tensor([[500.0, -500.0, 0.0], [1e4, -1e4, 3.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    kw = {"clip_c": 3.0} if name == "ppo_clip" else {}
    loss, m = POLICY_LOSSES[name](logp, old, torch.tensor([sign, -sign]), torch.ones(2, 3),
                                  is_weight=torch.ones(2, 3), **kw)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------- value loss

def test_value_loss_hand_worked():
    # old V = 0, new V = 1, clip 0.2 -> clipped V = 0.2
    # token 0, R = 0.5: unclipped (1 - 0.5)^2 = 0.25, clipped (0.2 - 0.5)^2 = 0.09 -> max 0.25 -> 0.5 * 0.25 = 0.125
    # token 1, R = 2: unclipped (1 - 2)^2 = 1, clipped (0.2 - 2)^2 = 3.24 -> max 3.24 -> 1.62 (clip active)
    # token mean (0.125 + 1.62) / 2 = 0.8725, clipfrac 1/2
    v = torch.ones(1, 2, requires_grad=True)
    loss, m = value_loss(v, torch.zeros(1, 2), torch.tensor([[0.5, 2.0]]), torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx(0.8725)
    assert m["critic/vf_clipfrac"] == pytest.approx(0.5) and m["critic/vf_loss"] == pytest.approx(0.8725)
    (g,) = torch.autograd.grad(loss, v)  # token 0: 0.5 * 2 * (1 - 0.5) / 2 = 0.25; token 1: clipped branch -> 0
    assert torch.allclose(g, torch.tensor([[0.25, 0.0]]))
    # no clip: 0.5 * (0.25 + 1) / 2 = 0.3125
    plain, m = value_loss(v, torch.zeros(1, 2), torch.tensor([[0.5, 2.0]]), torch.ones(1, 2), None)
    assert plain.item() == pytest.approx(0.3125) and m["critic/vf_clipfrac"] == 0.0
