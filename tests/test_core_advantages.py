"""Advantage estimators: hand-worked values, loop-vs-vectorised equivalence, groups of one."""

import math
import statistics
from dataclasses import replace

import pytest
import torch
from two_ranks import on_two_ranks

from alignrl.core.advantages import (ADVANTAGES, OutcomeInputs, gae_advantages, grpo_advantages, masked_whiten,
                                     outcome_token_rewards, shape_outcome, whiten_by,
                                     reinforce_pp_advantages, reinforce_pp_baseline_advantages, remax_advantages,
                                     rloo_advantages)


def _random_groups(seed: int):
    # unequal group sizes including a group of one, ids shuffled so groups are not contiguous
    g = torch.Generator().manual_seed(seed)
    sizes = [4, 1, 3, 2, 5, 1, 2]
    group = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    perm = torch.randperm(len(group), generator=g)
    return torch.rand(len(group), generator=g, dtype=torch.float64), group[perm]


def test_registry_keys():
    assert set(ADVANTAGES) == {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                               "gpg", "gdpo", "opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized",
                               "optimal_token_baseline", "tir_optimal_token_baseline"}
    # one signature: every estimator reads what it needs from the same inputs
    r, g = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    x = OutcomeInputs(r, torch.zeros(4, 3), torch.ones(4, 3), g, baseline=torch.zeros(4),
                      logprobs=torch.full((4, 3), -1.0), sum_pi_squared=torch.full((4, 3), 0.5))
    assert torch.equal(ADVANTAGES["grpo"](x), grpo_advantages(r, g))
    for name, fn in ADVANTAGES.items():
        assert torch.isfinite(fn(x)).all(), name


# ---------------------------------------------------------------- masked_whiten

def test_masked_whiten_hand_worked():
    # masked entries 1, 2, 3: mean 2, unbiased var ((1 + 0 + 1) / 2) = 1 -> -1, 0, 1; the unmasked 100 -> 0
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    out = masked_whiten(x, torch.tensor([1, 1, 1, 0]), eps=0.0)
    assert torch.allclose(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))


def test_masked_whiten_single_entry_or_constant_is_zero_not_nan():
    assert torch.equal(masked_whiten(torch.tensor([5.0, 7.0]), torch.tensor([1, 0])), torch.zeros(2))
    assert torch.equal(masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3)), torch.zeros(2, 3))
    assert torch.equal(masked_whiten(torch.ones(2, 2), torch.zeros(2, 2)), torch.zeros(2, 2))


# ---------------------------------------------------------------- GAE

def test_gae_gamma1_lam1_skips_masked_middle_token():
    # tokens 0 and 2 generated, token 1 a tool token (reward 7 and value 9 must be ignored).
    # t=2: delta = 1 + 1*0 - 0.2 = 0.8 -> A2 = 0.8; next value becomes V2 = 0.2
    # t=1: masked, carry A = 0.8 and next value 0.2
    # t=0: delta = 0 + 1*0.2 - 0.5 = -0.3 -> A0 = -0.3 + 1*1*0.8 = 0.5
    # returns = A + V: 0.5 + 0.5 = 1.0, 0.8 + 0.2 = 1.0; masked token -> 0
    r, v, m = torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.2]]), torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, 0.8]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 0.0, 1.0]]))


def test_gae_gamma_half_lam_half_skips_masked_middle_token():
    # t=2: delta = 1 + 0.5*0 - 0.2 = 0.8 -> A2 = 0.8
    # t=0: delta = 0 + 0.5*0.2 - 0.5 = -0.4 -> A0 = -0.4 + 0.5*0.5*0.8 = -0.2
    # returns: -0.2 + 0.5 = 0.3 and 0.8 + 0.2 = 1.0
    r, v, m = torch.tensor([[0.0, 7.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.2]]), torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[-0.2, 0.0, 0.8]]))
    assert torch.allclose(ret, torch.tensor([[0.3, 0.0, 1.0]]))


def test_gae_masked_tokens_equal_removing_them():
    # a response with tool tokens interleaved must give the same advantages as the response with
    # those tokens cut out (per-row loop reference on the compacted row)
    torch.manual_seed(0)
    B, T, gamma, lam = 5, 9, 0.9, 0.8
    r, v = torch.randn(B, T, dtype=torch.float64), torch.randn(B, T, dtype=torch.float64)
    m = (torch.rand(B, T) > 0.35).double()
    adv, ret = gae_advantages(r, v, m, gamma, lam)
    for i in range(B):
        keep = m[i].bool()
        rr, vv = r[i, keep].tolist(), v[i, keep].tolist()
        expect, last = [0.0] * len(rr), 0.0
        for t in reversed(range(len(rr))):
            nv = vv[t + 1] if t + 1 < len(rr) else 0.0
            last = rr[t] + gamma * nv - vv[t] + gamma * lam * last
            expect[t] = last
        assert torch.allclose(adv[i, keep], torch.tensor(expect, dtype=torch.float64))
        assert torch.allclose(ret[i, keep], torch.tensor(expect, dtype=torch.float64) + v[i, keep])
        assert torch.all(adv[i, ~keep] == 0) and torch.all(ret[i, ~keep] == 0)


def test_gae_whiten_keeps_returns():
    torch.manual_seed(1)
    r, v, m = torch.randn(3, 4), torch.randn(3, 4), (torch.rand(3, 4) > 0.3).float()
    adv, ret = gae_advantages(r, v, m, 0.99, 0.95)
    adv_w, ret_w = gae_advantages(r, v, m, 0.99, 0.95, whiten=True)
    assert torch.allclose(ret, ret_w) and torch.allclose(adv_w, masked_whiten(adv, m))


# ---------------------------------------------------------------- RLOO

def test_rloo_hand_worked():
    # group 0 = (1, 0, 0.5): baselines are means of the other two: 0.25, 0.75, 0.5
    #   -> 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0
    # group 1 = (3,): alone -> 0
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.5, 3.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.allclose(adv, torch.tensor([0.75, -0.75, 0.0, 0.0]))


def test_rloo_vectorised_matches_loop():
    r, g = _random_groups(0)
    adv = rloo_advantages(r, g)
    for i in range(len(r)):
        others = [r[j].item() for j in range(len(r)) if g[j] == g[i] and j != i]
        expect = r[i].item() - sum(others) / len(others) if others else 0.0
        assert adv[i].item() == pytest.approx(expect, abs=1e-12)


# ---------------------------------------------------------------- GRPO (loop equivalence with uneven groups)

@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_vectorised_matches_loop_uneven_groups(norm_by_std):
    r, g = _random_groups(1)
    adv = grpo_advantages(r, g, norm_by_std=norm_by_std)
    for i in range(len(r)):
        xs = [r[j].item() for j in range(len(r)) if g[j] == g[i]]
        if len(xs) < 2:
            expect = 0.0
        else:
            expect = r[i].item() - statistics.mean(xs)
            if norm_by_std:
                expect /= statistics.stdev(xs) + 1e-6
        assert adv[i].item() == pytest.approx(expect, abs=1e-9)


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_hand_worked():
    # gamma 0.5. Row 0 = (0, [masked, reward 5 ignored], 1): returns t2 = 1, t0 = 0 + 0.5*1 = 0.5
    # Row 1 = (0, 0, -1): returns -1, -0.5, -0.25 at t2, t1, t0
    # masked returns 0.5, 1, -0.25, -0.5, -1: mean -0.05, unbiased var
    #   (0.55^2 + 1.05^2 + 0.2^2 + 0.45^2 + 0.95^2) / 4 = 2.55 / 4 = 0.6375
    r = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1], [1, 1, 1]])
    adv = reinforce_pp_advantages(r, m, gamma=0.5, eps=0.0)
    sd = math.sqrt(0.6375)
    expect = torch.tensor([[0.55 / sd, 0.0, 1.05 / sd], [-0.2 / sd, -0.45 / sd, -0.95 / sd]], dtype=torch.float64)
    assert torch.allclose(adv, expect)


def test_reinforce_pp_baseline_hand_worked():
    # groups (1, 0), (3, 1), (5,): centred 0.5, -0.5 | 1, -1 | alone -> 0 and left out of the statistics
    # token lengths 2, 1, 1, 2, 3 -> token values 0.5, 0.5, -0.5, 1, -1, -1
    # mean -1/12, unbiased var sum((x + 1/12)^2) / 5 = 3.708333 / 5 = 0.7416667
    r = torch.tensor([1.0, 0.0, 3.0, 1.0, 5.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1, 2])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    adv = reinforce_pp_baseline_advantages(r, g, m, eps=0.0)
    mean, sd = -1 / 12, math.sqrt(3.708333333333333 / 5)
    row = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0], dtype=torch.float64)
    expect = ((row[:, None] - mean) / sd) * m * torch.tensor([1, 1, 1, 1, 0])[:, None]
    assert torch.allclose(adv, expect.double())


def test_reinforce_pp_baseline_vectorised_matches_loop():
    r, g = _random_groups(2)
    gen = torch.Generator().manual_seed(3)
    m = (torch.rand(len(r), 6, generator=gen) > 0.3).long()
    m[:, 0] = 1
    adv = reinforce_pp_baseline_advantages(r, g, m, eps=0.0)
    centred = {}
    for i in range(len(r)):
        xs = [r[j].item() for j in range(len(r)) if g[j] == g[i]]
        centred[i] = r[i].item() - statistics.mean(xs) if len(xs) > 1 else None
    tokens = [centred[i] for i in range(len(r)) if centred[i] is not None for _ in range(int(m[i].sum()))]
    mu, sd = statistics.mean(tokens), statistics.stdev(tokens)
    for i in range(len(r)):
        for t in range(m.shape[1]):
            expect = 0.0 if centred[i] is None or not m[i, t] else (centred[i] - mu) / sd
            assert adv[i, t].item() == pytest.approx(expect, abs=1e-9)


# ---------------------------------------------------------------- ReMax

def test_remax_hand_worked():
    # rows 0, 1 from prompt 0 (greedy reward 0.5), row 2 from prompt 1 (greedy reward 1); outcome on the last
    # response token (row 1 has 2 response tokens): every token gets reward - baseline
    tok = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = remax_advantages(tok, mask, torch.tensor([0.5, 0.5, 1.0]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]]))


def test_remax_keeps_a_kl_penalty_on_the_tokens_after_it():
    # verl's compute_remax_outcome_advantage: the return-to-go of each token minus the baseline. Outcome 1,
    # KL 0.1 * [.5, .2, .1, .4] taken from the token rewards, baseline 0.6
    tok = torch.tensor([[-0.05, -0.02, -0.01, 1.0 - 0.04]])
    adv = remax_advantages(tok, torch.ones(1, 4), torch.tensor([0.6]))
    assert torch.allclose(adv, torch.tensor([[0.28, 0.33, 0.35, 0.36]]), atol=1e-6)


# ---------------------------------------------------------------- groups of one

@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_of_one_is_zero_not_nan(name):
    r = torch.tensor([5.0, 1.0, 0.0, -2.0])
    g = torch.tensor([0, 1, 1, 2])  # samples 0 and 3 alone
    adv = ADVANTAGES[name](OutcomeInputs(r, torch.zeros(4, 3), torch.ones(4, 3), g))
    assert torch.isfinite(adv).all()
    assert torch.all(adv[0] == 0) and torch.all(adv[3] == 0)
    only_singles = ADVANTAGES[name](OutcomeInputs(r[:1], torch.zeros(1, 3), torch.ones(1, 3), g[:1]))
    assert torch.isfinite(only_singles).all() and torch.all(only_singles == 0)


def test_whitening_split_over_ranks_equals_whole_batch():
    """Two threads stand in for two ranks: each whitens its half with statistics summed over both
    (`sum_ranks`), and together they give the one-process result on the whole batch."""
    g = torch.Generator().manual_seed(0)
    x, values = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    cases = {
        "whiten": lambda xs, vs, ms, r: masked_whiten(xs, ms, sum_ranks=r),
        "reinforce_pp": lambda xs, vs, ms, r: reinforce_pp_advantages(xs, ms, 0.9, sum_ranks=r),
        "gae": lambda xs, vs, ms, r: gae_advantages(xs, vs, ms, 0.9, 0.8, whiten=True, sum_ranks=r)[0],
    }
    for name, fn in cases.items():
        whole = fn(x, values, mask, None)

        def half(rank, total, fn=fn):
            rows = slice(3 * rank, 3 * rank + 3)
            return fn(x[rows], values[rows], mask[rows], total)

        parts = on_two_ranks(half)
        torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=0, msg=name)
        assert not torch.allclose(parts[0], fn(x[:3], values[:3], mask[:3], None))  # local stats would differ


# ---------------------------------------------------------------- OpenRLHF's shaped REINFORCE++

def openrlhf_advantages(r, group_rows, kl, mask, kl_coef, shaping, whiten):
    """OpenRLHF's steps written out one by one, rows grouped n at a time: the group shapes the reward
    (process_experiences), the KL penalty goes on every token and the reward on the last (compute_reward),
    returns-to-go with gamma 1, then the batch whitening over action tokens with OpenRLHF's statistics (the
    variance over the token count, + 1e-8)."""
    n = group_rows
    g = r.reshape(-1, n)
    if shaping == "loo":
        g = g - (g.sum(-1, keepdim=True) - g) / (n - 1)
    elif shaping == "mean":
        g = g - g.mean(-1, keepdim=True)
    elif shaping == "mean_std":
        g = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)
    shaped = g.reshape(-1)
    tokens = -kl_coef * kl * mask
    for i in range(len(r)):
        last = int(mask[i].nonzero().max())
        tokens[i, last] += shaped[i]
    returns = torch.flip(torch.cumsum(torch.flip(tokens, [1]), 1), [1]) * mask
    if whiten == "none":
        return returns
    sel = returns[mask.bool()]
    out = (returns - sel.mean()) * mask
    return out * torch.rsqrt(((sel - sel.mean()) ** 2).mean() + 1e-8) if whiten == "std" else out


@pytest.mark.parametrize("shaping, whiten", [("loo", "std"), ("mean", "std"), ("mean_std", "none"), ("mean", "none"),
                                             ("loo", "center"), ("none", "std")])
def test_shaped_reinforce_pp_is_openrlhfs_estimator(shaping, whiten):
    torch.manual_seed(0)
    r = torch.randn(8)
    group = torch.arange(2).repeat_interleave(4)
    mask = torch.ones(8, 5)
    mask[1, 3:] = 0  # shorter responses: the reward sits on each one's own last token
    mask[6, 2:] = 0
    kl, kl_coef = torch.rand(8, 5) * mask, 0.1
    token_rewards = outcome_token_rewards(r, mask) - kl_coef * kl
    x = OutcomeInputs(token_rewards.sum(-1), token_rewards, mask, group, outcome=r, outcome_baseline=shaping,
                      whiten=whiten)
    want = openrlhf_advantages(r, 4, kl, mask, kl_coef, shaping, whiten)
    if whiten == "std":  # alignrl whitens with the unbiased variance (verl's masked_whiten): sqrt((n-1)/n) apart
        n = mask.sum()
        want = want * ((n - 1) / n).sqrt()
    torch.testing.assert_close(ADVANTAGES["reinforce_plus_plus"](x), want, atol=1e-5, rtol=0)


def test_the_group_shapes_the_outcome_not_the_kl_penalty():
    """With the KL penalty in the reward, the baseline comes from the outcomes alone (OpenRLHF): a sample's KL
    stays its own instead of being shared out over its group, as a baseline on the penalized sum would."""
    r = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    token_rewards = outcome_token_rewards(r, mask) - kl
    x = OutcomeInputs(token_rewards.sum(-1), token_rewards, mask, torch.zeros(2, dtype=torch.long), outcome=r,
                      outcome_baseline="mean", whiten="none")
    assert ADVANTAGES["reinforce_plus_plus"](x).tolist() == [[0.0, 0.0], [-2.0, -1.0]]
    assert shape_outcome(r, torch.zeros(2, dtype=torch.long), "loo").tolist() == [0.0, 0.0]
    assert shape_outcome(torch.tensor([3.0]), torch.zeros(1, dtype=torch.long), "mean").tolist() == [0.0]  # alone


def test_whiten_modes():
    x, m = torch.tensor([1.0, 2.0, 6.0, 9.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert whiten_by(x, m, "none").tolist() == [1.0, 2.0, 6.0, 0.0]
    assert whiten_by(x, m, "center").tolist() == [-2.0, -1.0, 3.0, 0.0]
    torch.testing.assert_close(whiten_by(x, m, "std"), masked_whiten(x, m))


def test_openrlhfs_reward_clip_clamps_the_group_shaped_reward():
    """OpenRLHF's compute_reward clamps the reward its estimator shaped with the group: scores 12 and 18 of one
    prompt are -3 and +3 after the mean baseline, inside (-10, 10), so they stay apart (clamping the raw scores
    first would make both 10, and both advantages 0)."""
    r, g, mask = torch.tensor([12.0, 18.0]), torch.tensor([0, 0]), torch.ones(2, 1)
    x = OutcomeInputs(r, outcome_token_rewards(r, mask), mask, g, outcome=r, outcome_baseline="mean",
                      whiten="none", outcome_clip=(-10.0, 10.0))
    assert torch.equal(ADVANTAGES["reinforce_plus_plus"](x), torch.tensor([[-3.0], [3.0]]))
    wide = replace(x, rewards=r * 10, token_rewards=outcome_token_rewards(r * 10, mask), outcome=r * 10)
    assert torch.equal(ADVANTAGES["reinforce_plus_plus"](wide), torch.tensor([[-10.0], [10.0]]))  # ±30 clamped
