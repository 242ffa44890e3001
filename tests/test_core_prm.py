"""`core.prm`: the process-reward loss and step accuracy worked by hand (hard labels, soft labels, the positions
that count and those that do not, the global step count)."""

import math

import pytest
import torch

from alignrl.core.prm import positive_probs, prm_loss, reward_log_probs, step_terms

PLUS, MINUS = 3, 5  # reward token ids in a vocabulary of 6


def _logits(rows: list[list[dict[int, float]]]) -> torch.Tensor:
    """(B, T, 6) logits, zero except the entries given per position."""
    out = torch.zeros(len(rows), len(rows[0]), 6)
    for b, row in enumerate(rows):
        for t, entries in enumerate(row):
            for v, x in entries.items():
                out[b, t, v] = x
    return out


def _ce(pos: float, neg: float, target_pos: float) -> float:
    """-(p log q+ + (1 - p) log q-) with q the softmax of the two logits."""
    lse = math.log(math.exp(pos) + math.exp(neg))
    return -(target_pos * (pos - lse) + (1 - target_pos) * (neg - lse))


def test_hard_labels_read_only_the_reward_tokens_logits_at_the_placeholders():
    # row 0: steps at t=1 (label +) and t=3 (label -); row 1: one step at t=2 (label -); the other tokens' logits
    # (here a large logit on token 0) change nothing: the softmax is over the two reward tokens alone
    logits = _logits([[{}, {PLUS: 2.0, MINUS: 0.5, 0: 9.0}, {}, {PLUS: 1.0, MINUS: 0.0}],
                      [{}, {}, {PLUS: -1.0, MINUS: 1.0, 1: 7.0}, {}]])
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 1] = mask[0, 3] = mask[1, 2] = True
    targets = torch.zeros(2, 4, 2)
    targets[0, 1] = torch.tensor([1.0, 0.0])
    targets[0, 3] = torch.tensor([0.0, 1.0])
    targets[1, 2] = torch.tensor([0.0, 1.0])
    loss, m = prm_loss(logits, mask, targets, [PLUS, MINUS])
    ces = [_ce(2.0, 0.5, 1.0), _ce(1.0, 0.0, 0.0), _ce(-1.0, 1.0, 0.0)]
    assert loss.item() == pytest.approx(sum(ces) / 3, abs=1e-6) and m["prm/loss"] == pytest.approx(sum(ces) / 3)
    # argmax right at steps 1 (+ over -) and 3 of row 1 (- over +), wrong at row 0's second step
    assert (m["acc_sum"], m["acc_count"]) == (2.0, 3.0)
    # the same loss as torch's cross-entropy over the reward tokens' logits (OpenRLHF's PRMLoss with hard labels)
    picked = logits[mask][:, [PLUS, MINUS]]
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(picked, torch.tensor([0, 1, 1])).item())


def test_soft_labels_are_the_probability_of_the_first_reward_token():
    logits = _logits([[{PLUS: 0.3, MINUS: -0.2}, {PLUS: -1.0, MINUS: 0.4}]])
    mask = torch.tensor([[True, True]])
    targets = torch.tensor([[[0.8, 0.2], [0.3, 0.7]]])
    loss, m = prm_loss(logits, mask, targets, [PLUS, MINUS])
    assert loss.item() == pytest.approx((_ce(0.3, -0.2, 0.8) + _ce(-1.0, 0.4, 0.3)) / 2, abs=1e-6)
    assert m["acc_sum"] == 2.0  # the target's argmax: + for 0.8, - for 0.3; the model agrees on both
    # with p = 1 and 0 a soft label is the hard one
    hard, _ = prm_loss(logits, mask, torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), [PLUS, MINUS])
    assert hard.item() == pytest.approx((_ce(0.3, -0.2, 1.0) + _ce(-1.0, 0.4, 0.0)) / 2, abs=1e-6)
    assert positive_probs(logits, mask, [PLUS, MINUS]).tolist() == pytest.approx(
        [1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(1.4))], abs=1e-6)


def test_unmarked_positions_count_for_nothing_whatever_they_hold():
    logits = torch.randn(2, 5, 6, requires_grad=True)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 2] = mask[1, 4] = True
    targets = torch.rand(2, 5, 2)
    targets[mask] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    loss, _ = prm_loss(logits, mask, targets, [PLUS, MINUS])
    changed = logits.detach().clone()
    changed[~mask] = 100 * torch.randn_like(changed[~mask])
    noisy = targets.clone()
    noisy[~mask] = 7.0
    again, _ = prm_loss(changed, mask, noisy, [PLUS, MINUS])
    assert again.item() == pytest.approx(loss.item(), abs=1e-6)
    loss.backward()
    grad = logits.grad
    assert grad[~mask].abs().sum() == 0 and grad[mask][:, [0, 1, 2, 4]].abs().sum() == 0  # reward tokens alone
    assert grad[mask][:, [PLUS, MINUS]].abs().sum() > 0
    empty, m = prm_loss(logits, torch.zeros(2, 5, dtype=torch.bool), targets, [PLUS, MINUS])
    assert empty.item() == 0.0 and empty.requires_grad and m["acc_count"] == 0.0


def test_a_split_batch_adds_up_to_the_whole_ones_step_mean_and_three_reward_tokens():
    logits = torch.randn(3, 4, 6)
    mask = torch.tensor([[True, False, True, False], [False, False, False, True], [True, True, True, False]])
    targets = torch.nn.functional.one_hot(torch.randint(0, 3, (3, 4)), 3).float()
    whole, _ = prm_loss(logits, mask, targets, [PLUS, MINUS, 0])
    parts = [prm_loss(logits[s], mask[s], targets[s], [PLUS, MINUS, 0], total_steps=6)[0]
             for s in (slice(0, 1), slice(1, 3))]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)
    ce, correct = step_terms(logits, mask, targets, [PLUS, MINUS, 0])
    lp = reward_log_probs(logits[mask], [PLUS, MINUS, 0])
    assert ce.tolist() == pytest.approx((-lp[targets[mask].bool()]).tolist(), abs=1e-6)
    assert correct.tolist() == (lp.argmax(-1) == targets[mask].argmax(-1)).tolist()
