"""`core.prm`: the process-reward loss and step accuracy worked by hand (hard labels, soft labels, the positions
that count and those that do not, the global step count), and the whole-vocabulary loss against torch's
cross-entropy over the full logits."""

import math

import pytest
import torch

from alignrl.core.prm import (label_token_ids, positive_probs, prm_loss, prm_vocab_loss, reward_log_probs, step_terms,
                              vocab_step_terms)

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


def _openrlhf_labels(mask: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's labels: the label token's id at each placeholder, -100 (ignored) elsewhere."""
    return torch.where(mask, label_ids, torch.full_like(label_ids, -100))


def test_the_whole_vocabulary_loss_is_torchs_cross_entropy_over_the_full_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 6, requires_grad=True)
    mask = torch.tensor([[False, True, False, True, False], [False] * 5, [True, False, False, False, True]])
    label_ids = torch.randint(0, 6, (3, 5))
    loss, m = prm_vocab_loss(logits, mask, label_ids)
    flat = _openrlhf_labels(mask, label_ids).view(-1)
    expected = torch.nn.functional.cross_entropy(logits.detach().view(-1, 6), flat, ignore_index=-100)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6) and m["prm/loss"] == pytest.approx(expected.item())
    right = (logits.detach().argmax(-1) == label_ids)[mask]  # the vocabulary's arg-max is the label token
    assert (m["acc_sum"], m["acc_count"]) == (float(right.sum()), 4.0)
    loss.backward()  # only the marked positions' logits, but every vocabulary entry of them, get a gradient
    assert logits.grad[~mask].abs().sum() == 0 and bool((logits.grad[mask] != 0).all())
    # the sum over total_steps: the rows of a split batch add up to the whole batch's step mean
    parts = [prm_vocab_loss(logits.detach()[s], mask[s], label_ids[s], total_steps=4)[0]
             for s in (slice(0, 1), slice(1, 3))]
    assert (parts[0] + parts[1]).item() == pytest.approx(expected.item(), abs=1e-6)
    summed = torch.nn.functional.cross_entropy(logits.detach().view(-1, 6), flat, ignore_index=-100, reduction="sum")
    assert prm_vocab_loss(logits.detach(), mask, label_ids, total_steps=10)[0].item() == pytest.approx(
        summed.item() / 10, abs=1e-6)
    ce, correct = vocab_step_terms(logits.detach(), mask, label_ids)
    assert ce.tolist() == pytest.approx(torch.nn.functional.cross_entropy(
        logits.detach()[mask], label_ids[mask], reduction="none").tolist(), abs=1e-6) and correct.tolist() == \
        right.tolist()


def test_a_batch_with_no_marked_step_gives_a_zero_vocabulary_loss_that_reaches_the_parameters():
    weight = torch.nn.Parameter(torch.randn(4, 6))
    logits = (torch.randn(2, 3, 4) @ weight)
    loss, m = prm_vocab_loss(logits, torch.zeros(2, 3, dtype=torch.bool), torch.randint(0, 6, (2, 3)))
    assert loss.item() == 0.0 and m == {"prm/loss": 0.0, "acc_sum": 0.0, "acc_count": 0.0}
    loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum() == 0


def test_label_token_ids_read_each_one_hot_target_as_its_token():
    targets = torch.zeros(1, 3, 2)
    targets[0, 0] = torch.tensor([0.0, 1.0])
    targets[0, 2] = torch.tensor([1.0, 0.0])
    assert label_token_ids(targets, [PLUS, MINUS]).tolist() == [[MINUS, PLUS, PLUS]]  # t=1 unmarked: read as first
    # with those ids the vocabulary loss at a step whose label token dominates is small, elsewhere large
    logits = _logits([[{MINUS: 8.0}, {}, {MINUS: 8.0}]])
    mask = torch.tensor([[True, False, True]])
    ce, correct = vocab_step_terms(logits, mask, label_token_ids(targets, [PLUS, MINUS]))
    assert ce[0] < 0.01 < 7.0 < ce[1] and correct.tolist() == [True, False]
