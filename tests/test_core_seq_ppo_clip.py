"""The sequence likelihood ratio's clipped loss (actor.policy_loss=seq_ppo_clip) and RLOO's batch normalisation
(algorithm.grpo_std_scope=batch with adv_estimator=rloo), each against TRL's RLOOTrainer formula written out."""

from __future__ import annotations

import threading

import torch

from alignrl.core.advantages import ADVANTAGES, OutcomeInputs, rloo_advantages
from alignrl.core.losses import POLICY_LOSSES, seq_ppo_clip_loss

G = torch.Generator().manual_seed(3)
OLD = -torch.rand(4, 5, generator=G) * 2
LOGP = (OLD + torch.randn(4, 5, generator=G) * 0.15).clamp(max=-0.01)  # ratios of 1 +- a few tenths
# the last row has no counted token (a truncated answer masked out): it leaves the mean's count
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
ADV = torch.tensor([-1.0, 0.5, 1.0, 2.0])


def _trl(logp, old, adv, m, low, high, rows):
    """TRL's _compute_loss: logps summed over the completion mask, the clip on exp of their difference, the mean
    over the sequences (here those with a counted token, `rows`)."""
    ratio = ((logp * m).sum(1) - (old * m).sum(1)).exp()
    per_seq = -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    return per_seq[rows].mean()


def test_loss_and_gradient_are_trls_for_ratios_away_from_one():
    rows = MASK.sum(1) > 0
    ratio = ((LOGP - OLD) * MASK).sum(1).exp()
    assert ((ratio[rows] - 1).abs() > 0.05).all()  # the old log-probs differ: every counted ratio is off 1
    logp = LOGP.clone().requires_grad_()
    loss, metrics = seq_ppo_clip_loss(logp, OLD, ADV, MASK, 0.1, 0.15, loss_agg="token-mean")
    lg = LOGP.clone().requires_grad_()
    trl = _trl(lg, OLD, ADV, MASK, 0.1, 0.15, rows)
    torch.testing.assert_close(loss, trl)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(trl, lg)[0])
    clipped = ((ratio < 0.9) & (ADV < 0)) | ((ratio > 1.15) & (ADV > 0))  # TRL's clip_ratio/region
    assert 0 < metrics["actor/clipfrac"] < 1 and metrics["actor/clipfrac"] == float(clipped[rows].float().mean())
    assert POLICY_LOSSES["seq_ppo_clip"] is seq_ppo_clip_loss


def test_at_ratio_one_the_gradient_is_minus_a_times_the_sequences_log_likelihood_gradient():
    logp = OLD.clone().requires_grad_()
    loss, _ = seq_ppo_clip_loss(logp, OLD, ADV, MASK)
    grad = torch.autograd.grad(loss, logp)[0]
    torch.testing.assert_close(grad, -ADV[:, None] * MASK / 3)  # three sequences with a counted token


def test_micro_batches_add_up_to_the_mini_batch():
    full = LOGP.clone().requires_grad_()
    loss, _ = seq_ppo_clip_loss(full, OLD, ADV, MASK, 0.1, 0.15, global_seqs=3.0)
    whole = torch.autograd.grad(loss, full)[0]
    parts, total = LOGP.clone().requires_grad_(), 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part, _ = seq_ppo_clip_loss(parts[rows], OLD[rows], ADV[rows], MASK[rows], 0.1, 0.15, global_seqs=3.0)
        total = total + part
    torch.testing.assert_close(total, loss)
    torch.testing.assert_close(torch.autograd.grad(total, parts)[0], whole)


def test_a_per_token_advantage_reads_as_its_sequences_value_and_a_sequence_weight_scales_it():
    adv_tokens = ADV[:, None].expand(4, 5).clone()
    weight = torch.tensor([0.5, 1.0, 2.0, 1.0])[:, None].expand(4, 5)
    plain, _ = seq_ppo_clip_loss(LOGP, OLD, ADV, MASK)
    tokens, _ = seq_ppo_clip_loss(LOGP, OLD, adv_tokens, MASK)
    weighted, _ = seq_ppo_clip_loss(LOGP, OLD, ADV, MASK, is_weight=weight)
    torch.testing.assert_close(tokens, plain)
    rows = MASK.sum(1) > 0
    ratio = ((LOGP - OLD) * MASK).sum(1).exp()
    per_seq = -torch.min(ratio * ADV, ratio.clamp(0.8, 1.2) * ADV) * weight[:, 0]
    torch.testing.assert_close(weighted, per_seq[rows].mean())


REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.3, 0.9])
GROUP = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def _trl_rloo(rewards, n, normalize):
    grouped = rewards.view(-1, n)
    adv = rewards - ((grouped.sum(1, keepdim=True) - grouped) / (n - 1)).view(-1)
    return (adv - adv.mean()) / (adv.std() + 1e-4) if normalize else adv


def test_rloo_batch_normalisation_is_trls_normalize_advantages():
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUP), _trl_rloo(REWARDS, 2, False))
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUP, batch_norm=True), _trl_rloo(REWARDS, 2, True))
    x = OutcomeInputs(REWARDS, torch.zeros(8, 1), torch.ones(8, 1), GROUP, std_scope="batch")
    torch.testing.assert_close(ADVANTAGES["rloo"](x), _trl_rloo(REWARDS, 2, True))
    x = OutcomeInputs(REWARDS, torch.zeros(8, 1), torch.ones(8, 1), GROUP)
    torch.testing.assert_close(ADVANTAGES["rloo"](x), _trl_rloo(REWARDS, 2, False))  # group: left as they are


def test_rloo_batch_normalisation_over_two_ranks_is_the_whole_batchs():
    """Two ranks, each with two prompt groups, sum their statistics (an all-reduce written with a barrier)."""
    barrier, slots, out = threading.Barrier(2), [[None, None] for _ in range(4)], [None, None]

    def rank(r: int) -> None:
        calls = iter(range(10))

        def sum_ranks(t: torch.Tensor) -> torch.Tensor:
            i = next(calls)
            slots[i][r] = t
            barrier.wait()
            total = slots[i][0] + slots[i][1]
            barrier.wait()
            return total

        rows = slice(4 * r, 4 * r + 4)
        out[r] = rloo_advantages(REWARDS[rows], GROUP[rows] - 2 * r, batch_norm=True, sum_ranks=sum_ranks)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out), _trl_rloo(REWARDS, 2, True))
