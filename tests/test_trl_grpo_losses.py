"""TRL's GRPO loss options in alignrl's math, on tiny hand-worked tensors: the batch-wide std of the advantages
(--scale_rewards batch), two-sided clipping (--delta), the ratio-weighted KL (--use_bias_correction_kl) and the
high-entropy token mask (--top_entropy_quantile); and the actor's loss with all three against TRL's formula."""

from __future__ import annotations

import math

import pytest
import torch
from two_ranks import on_two_ranks

from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import ADVANTAGES, BATCH_STD_EPS, OutcomeInputs, grpo_advantages
from alignrl.core.entropy import high_entropy_mask, linear_quantile
from alignrl.core.losses import gspo_loss, kl_k3, ppo_clip_loss, ratio_weighted_kl


def test_batch_std_divides_the_group_centred_rewards_by_the_whole_batchs_std():
    rewards, group = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])
    # group means 0.5 and 0: centred [0.5, -0.5, 0, 0]; the batch's mean 0.25, its unbiased variance
    # (0.75^2 + 3 x 0.25^2) / 3 = 0.25: std 0.5, and TRL's 1e-4 beside it
    batch = grpo_advantages(rewards, group, std_scope="batch")
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (0.5 + 1e-4))
    assert BATCH_STD_EPS == 1e-4
    # the group's own std, sqrt(0.5), as before: the default is unchanged
    torch.testing.assert_close(grpo_advantages(rewards, group), torch.tensor([0.5, -0.5, 0, 0]) / (0.5**0.5 + 1e-6))
    unscaled = grpo_advantages(rewards, group, norm_by_std=False, std_scope="batch")
    torch.testing.assert_close(unscaled, torch.tensor([0.5, -0.5, 0.0, 0.0]))  # no std: the scope changes nothing
    x = OutcomeInputs(rewards, torch.zeros(4, 2), torch.ones(4, 2), group, std_scope="batch")
    torch.testing.assert_close(ADVANTAGES["grpo"](x), batch)


def test_batch_std_over_two_ranks_is_the_global_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    whole = grpo_advantages(rewards, group, std_scope="batch")
    # each rank holds whole groups (as alignrl's ranks do), with group ids of its own
    shares = [(rewards[:2], torch.tensor([0, 0])), (rewards[2:], torch.tensor([0, 0, 1, 1]))]
    parts = on_two_ranks(lambda rank, total: grpo_advantages(*shares[rank], std_scope="batch", sum_ranks=total))
    torch.testing.assert_close(torch.cat(parts), whole)
    local = grpo_advantages(*shares[0], std_scope="batch")
    assert not torch.allclose(parts[0], local)  # the rank's own std would differ


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_a_group_of_one_still_gets_zero(scope):
    adv = grpo_advantages(torch.tensor([2.0, 1.0, 0.0]), torch.tensor([0, 1, 1]), std_scope=scope)
    assert adv[0] == 0 and torch.isfinite(adv).all()


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.grpo_std_scope=batch", "algorithm.adv_estimator=remax"], "scales GRPO's or RLOO's"),
    (["algorithm.grpo_std_scope=batch", "algorithm.norm_adv_by_std_in_grpo=false"], "divides by none"),
    (["actor.clip_ratio_delta=3", "actor.policy_loss=cispo"], "clip_ratio_delta caps the unclipped ratio term"),
    (["actor.clip_ratio_delta=1.1"], r"must be above 1 \+ actor.clip_ratio_high \(1.2\)"),
    (["actor.clip_ratio_delta=1.0"], "out of range"),
    (["actor.kl_loss_ratio_weighted=true", "actor.use_kl_loss=false"], "weighs the KL loss term"),
    (["actor.top_entropy_quantile=0.2", "actor.policy_loss=gmpo"], "geometric mean over each sequence"),
    (["actor.top_entropy_quantile=1.5"], "out of range"),
])
def test_options_without_effect_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)


def _loss_and_grad(ratios, adv, **kw):
    old = torch.zeros(1, len(ratios))
    logp = torch.tensor([ratios]).log().requires_grad_()
    loss, _ = ppo_clip_loss(logp, old, torch.tensor([adv]), torch.ones(1, len(ratios)), 0.2, 0.2, **kw)
    loss.backward()
    return float(loss.detach()), logp.grad[0]


def test_delta_caps_the_unclipped_ratio_of_negative_advantages():
    ratios = [0.5, 1.1, 2.0, 4.0]
    # A = -1: per token max(r, clip(r, 0.8, 1.2)) = [0.8, 1.1, 2, 4]; its gradient r where the ratio term counts
    loss, grad = _loss_and_grad(ratios, -1.0)
    assert loss == pytest.approx(7.9 / 4)
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.1, 2.0, 4.0]) / 4)
    # delta 3: the last token's ratio term is 3, a constant: its loss 3 and no gradient
    loss, grad = _loss_and_grad(ratios, -1.0, delta=3.0)
    assert loss == pytest.approx(6.9 / 4)
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.1, 2.0, 0.0]) / 4)
    # positive advantages: the clip at 1 + 0.2 binds first, delta changes nothing
    assert _loss_and_grad(ratios, 1.0, delta=3.0)[0] == _loss_and_grad(ratios, 1.0)[0]
    with pytest.raises(ValueError, match="delta must be > 1"):
        _loss_and_grad(ratios, -1.0, delta=1.0)


def test_delta_caps_gspos_sequence_ratio():
    logp = torch.tensor([[math.log(4.0), math.log(4.0)]], requires_grad=True)
    old, mask, adv = torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([-1.0])
    loss, _ = gspo_loss(logp, old, adv, mask, 0.2, 0.2, delta=3.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(3.0) and torch.all(logp.grad == 0)  # the sequence ratio 4, capped at 3
    free, _ = gspo_loss(logp.detach(), old, adv, mask, 0.2, 0.2)
    assert float(free) == pytest.approx(4.0)


def test_ratio_weighted_kl_is_k3_times_the_ratio_with_its_gradient():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    old, ref = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.25)]])
    k3 = 0.5 + math.log(2) - 1  # exp(ref - logp) - (ref - logp) - 1
    weighted = ratio_weighted_kl(kl_k3(logp, ref), logp, old)
    assert float(weighted.detach()) == pytest.approx(2 * k3)  # ratio 0.5 / 0.25
    weighted.sum().backward()
    # d/dlogp (k3 r) = r (1 - exp(ref - logp)) + k3 r = 2 x 0.5 + 2 k3
    assert float(logp.grad) == pytest.approx(1.0 + 2 * k3)


ENTROPY = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])


def test_high_entropy_mask_keeps_the_top_share_of_the_masked_tokens():
    # ten masked entropies 0.1 .. 1.0: the 0.8 quantile is 0.8 + 0.2 x 0.1 = 0.82, so 0.9 and 1.0 stay (the two 5.0
    # are padding, neither counted nor kept)
    kept = high_entropy_mask(ENTROPY, MASK, 0.2)
    assert kept.nonzero().tolist() == [[2, 0], [2, 1]]
    assert torch.equal(high_entropy_mask(ENTROPY, MASK, 1.0), MASK.bool())  # the 0 quantile: every masked token
    assert high_entropy_mask(ENTROPY, MASK, 0.0).nonzero().tolist() == [[2, 1]]  # the largest alone
    assert not high_entropy_mask(ENTROPY, torch.zeros_like(MASK), 0.5).any()
    x = torch.rand(101, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.37, 0.8, 1.0):
        torch.testing.assert_close(linear_quantile(x, q), torch.quantile(x, q))


def test_high_entropy_mask_takes_the_threshold_over_every_rank():
    # rank 0 holds the low entropies, rank 1 the high ones: alone, each would keep its own top
    parts = on_two_ranks(lambda rank, gather: high_entropy_mask(ENTROPY[rank * 2:rank * 2 + 2 - rank],
                                                              MASK[rank * 2:rank * 2 + 2 - rank], 0.2, gather),
                         combine=lambda first, second: torch.cat([first, second]))
    assert not parts[0].any() and parts[1].nonzero().tolist() == [[0, 0], [0, 1]]


def test_the_actors_loss_with_the_three_options_is_trls():
    from alignrl.data.records import Experience
    from alignrl.rl.trainer import policy_loss_spec
    from alignrl.train.actor import policy_loss

    cfg = load_config(None, ["actor.clip_ratio_delta=1.3", "actor.kl_loss_ratio_weighted=true",
                             "actor.top_entropy_quantile=0.5", "actor.kl_loss_coef=0.1",
                             "actor.loss_agg_mode=token-mean"])
    spec = policy_loss_spec(cfg)
    assert (spec.delta, spec.kl_ratio_weighted, spec.top_entropy, spec.kl_coef) == (1.3, True, 0.5, 0.1)
    g = torch.Generator().manual_seed(3)
    old, ref = -torch.rand(3, 4, generator=g) * 2, -torch.rand(3, 4, generator=g) * 2
    logp = (old + torch.randn(3, 4, generator=g) * 0.6).clamp(max=-0.01).requires_grad_()
    entropy, adv = torch.rand(3, 4, generator=g), torch.tensor([1.0, -1.0, -0.5])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    exp = Experience(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                     torch.zeros(3, 4, dtype=torch.long), mask, old, ref, adv)
    loss, metrics = policy_loss(logp, entropy, exp, spec, float(mask.sum()), 3.0)
    # TRL's _compute_loss, one process, loss_type dapo: the masked entropies' 0.5 quantile is the threshold
    r, a, m = (logp - old).exp(), adv[:, None], mask.float()
    kept = (entropy >= torch.quantile(entropy[mask], 0.5)) & mask
    surrogate = -torch.min(r.clamp(max=1.3) * a, r.clamp(0.8, 1.2) * a) * kept
    kl = (torch.exp(ref - logp) - (ref - logp) - 1) * r
    trl = ((surrogate + 0.1 * kl) * m).sum() / m.sum()
    torch.testing.assert_close(loss, trl)
    mine = torch.autograd.grad(loss, logp)[0]
    torch.testing.assert_close(mine, torch.autograd.grad(trl, logp)[0])
    assert metrics["actor/entropy_kept_frac"] == pytest.approx(float(kept.sum()) / 9)
    # the defaults change nothing: TRL's plain surrogate and k3
    plain, _ = policy_loss(logp, entropy, exp, policy_loss_spec(load_config(None, ["actor.kl_loss_coef=0.1",
                                                                                  "actor.loss_agg_mode=token-mean"])),
                           float(mask.sum()), 3.0)
    base = -torch.min(r * a, r.clamp(0.8, 1.2) * a) + 0.1 * (torch.exp(ref - logp) - (ref - logp) - 1)
    torch.testing.assert_close(plain, (base * m).sum() / m.sum())
