"""TRL's GRPO loss options in alignrl's math, on tiny hand-worked tensors: the batch-wide std of the advantages
(--scale_rewards batch)."""

from __future__ import annotations

import threading

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.advantages import ADVANTAGES, BATCH_STD_EPS, OutcomeInputs, grpo_advantages


def _two_ranks(fn):
    """fn(rank, sum_ranks) run on two threads standing in for two ranks, `sum_ranks` an all-reduce between them."""
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def make_sum(rank):
        def total(t):
            slots[rank] = t.clone()
            barrier.wait()
            summed = slots[0] + slots[1]
            barrier.wait()  # both read before either writes the next round
            return summed
        return total

    def run(rank):
        out[rank] = fn(rank, make_sum(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    return out


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
    parts = _two_ranks(lambda rank, total: grpo_advantages(*shares[rank], std_scope="batch", sum_ranks=total))
    torch.testing.assert_close(torch.cat(parts), whole)
    local = grpo_advantages(*shares[0], std_scope="batch")
    assert not torch.allclose(parts[0], local)  # the rank's own std would differ


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_a_group_of_one_still_gets_zero(scope):
    adv = grpo_advantages(torch.tensor([2.0, 1.0, 0.0]), torch.tensor([0, 1, 1]), std_scope=scope)
    assert adv[0] == 0 and torch.isfinite(adv).all()


@pytest.mark.parametrize("overrides, words", [
    (["algorithm.grpo_std_scope=batch", "algorithm.adv_estimator=rloo"], "grpo_std_scope=batch scales GRPO's"),
    (["algorithm.grpo_std_scope=batch", "algorithm.norm_adv_by_std_in_grpo=false"], "divides by none"),
])
def test_options_without_effect_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)
