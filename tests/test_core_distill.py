"""core.distill on hand-worked values: the teacher's cross-entropy against the student, a one-hot teacher giving the
data's cross-entropy, the mask, OpenRLHF's inf mask, temperature, padded vocabularies and the mixed objective."""

import math

import pytest
import torch

from alignrl.core.distill import (distill_mean, distill_per_token, distill_sum, generalized_jsd_per_token,
                                  match_vocab, mix)


def test_hand_worked_two_token_values():
    # student uniform over 2, teacher (3/4, 1/4): -(3/4 log 1/2 + 1/4 log 1/2) = log 2
    student = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    teacher = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])
    got = distill_per_token(student, teacher)
    # second row: student (1/4, 3/4): -(3/4 log 1/4 + 1/4 log 3/4)
    want = torch.tensor([math.log(2.0), 0.75 * math.log(4.0) + 0.25 * math.log(4.0 / 3.0)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(distill_sum(student, teacher), want.sum(), rtol=0, atol=1e-6)


def test_a_one_hot_teacher_gives_the_cross_entropy_of_the_data():
    torch.manual_seed(0)
    student = torch.randn(5, 7, requires_grad=True)
    labels = torch.tensor([0, 3, 6, 2, 2])
    teacher = torch.full((5, 7), float("-inf")).scatter(1, labels[:, None], 0.0)  # softmax exactly one-hot
    kd = distill_sum(student, teacher)
    ce = torch.nn.functional.cross_entropy(student, labels, reduction="sum")
    torch.testing.assert_close(kd, ce, rtol=0, atol=1e-5)
    g_kd, = torch.autograd.grad(kd, student)
    g_ce, = torch.autograd.grad(ce, student)
    torch.testing.assert_close(g_kd, g_ce, rtol=0, atol=1e-6)


def test_it_is_the_kl_to_the_teacher_plus_the_teachers_entropy():
    torch.manual_seed(1)
    student, teacher = torch.randn(4, 9), torch.randn(4, 9)
    p, log_q = torch.softmax(teacher, -1), torch.log_softmax(student, -1)
    kl = (p * (p.log() - log_q)).sum(-1)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(distill_per_token(student, teacher), kl + entropy, rtol=0, atol=1e-5)
    assert torch.all(distill_per_token(teacher, teacher) <= distill_per_token(student, teacher))  # min at p itself


def test_the_mask_picks_the_positions_and_nothing_else_enters():
    student = torch.zeros(2, 3, 2)
    teacher = torch.zeros(2, 3, 2)
    teacher[0, 1] = torch.tensor([math.log(3.0), 0.0])  # a trained position: log 2 against a uniform student
    student[1, 2] = float("nan")  # an untrained one (padding): never read
    teacher[1, 2] = float("nan")
    mask = torch.tensor([[False, True, True], [False, False, False]])
    # two trained positions, each log 2 (the teacher's (3/4, 1/4) and (1/2, 1/2) against a uniform student)
    assert distill_mean(student, teacher, mask).item() == pytest.approx(math.log(2.0), abs=1e-6)
    assert distill_mean(student, teacher, torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0


def test_an_infinite_student_logit_adds_nothing_as_openrlhfs_inf_mask():
    student = torch.tensor([[0.0, 0.0, float("-inf")]])
    teacher = torch.tensor([[0.0, 0.0, 0.0]])  # a third of its mass on the entry the student masks out
    got = distill_per_token(student, teacher)
    assert torch.isfinite(got).all() and got.item() == pytest.approx(2 / 3 * math.log(2.0), abs=1e-6)


def test_temperature_divides_both_sides():
    torch.manual_seed(2)
    student, teacher = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(distill_per_token(student, teacher, 2.0), distill_per_token(student / 2, teacher / 2))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        distill_per_token(student, teacher, 0.0)


def test_a_vocabulary_mismatch_is_one_line_and_a_padded_head_is_matched():
    with pytest.raises(ValueError, match=r"^distillation: the student's vocabulary has 5 entries and the teacher's 6: "
                                         r"the two must share a tokenizer$"):
        distill_sum(torch.zeros(2, 5), torch.zeros(2, 6))
    teacher = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    assert match_vocab(teacher, 4) is teacher
    torch.testing.assert_close(match_vocab(teacher, 3), teacher[:, :3])  # a wider teacher: its extra entries dropped
    padded = match_vocab(teacher, 6)  # a narrower one: the student's extra entries get probability 0
    assert padded.shape == (1, 6) and torch.isinf(padded[0, 4:]).all()
    student = torch.tensor([[0.5, -1.0, 0.0, 2.0, 7.0, -3.0]])
    p = torch.softmax(teacher, -1)
    want = -(p * torch.log_softmax(student, -1)[:, :4]).sum()
    torch.testing.assert_close(distill_sum(student, padded), want)


def test_mix_is_openrlhfs_weighting_and_its_ends_are_each_loss_itself():
    gpt, distil = torch.tensor(2.0), torch.tensor(5.0)
    assert mix(gpt, distil, 0.4).item() == pytest.approx(0.6 * 2.0 + 0.4 * 5.0)
    nan = torch.tensor(float("nan"))
    assert mix(gpt, nan, 0.0) is gpt and mix(nan, distil, 1.0) is distil
    with pytest.raises(ValueError, match=r"kd_coef must be in \[0, 1\], got 1.5"):
        mix(gpt, distil, 1.5)


def test_gkd_generalized_jsd_by_hand_and_at_its_ends():
    """β·KL(p ‖ m) + (1 - β)·KL(q ‖ m), m = β·p + (1 - β)·q, p the teacher's and q the student's distributions
    (TRL's generalized_jsd_loss); β = 1 is KL(q ‖ p); the gradient reaches the student only."""
    p, q = torch.tensor([0.75, 0.25]), torch.tensor([0.5, 0.5])
    teacher, student = p.log().unsqueeze(0), q.log().unsqueeze(0).requires_grad_(True)
    m = 0.5 * p + 0.5 * q  # (0.625, 0.375)
    want = 0.5 * float((p * (p / m).log()).sum()) + 0.5 * float((q * (q / m).log()).sum())
    got = generalized_jsd_per_token(student, teacher, 0.5)
    torch.testing.assert_close(got, torch.tensor([want]), rtol=0, atol=1e-6)
    reverse = float((q * (q / p).log()).sum())
    torch.testing.assert_close(generalized_jsd_per_token(student, teacher, 1.0), torch.tensor([reverse]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(distill_sum(student, teacher, beta=0.5), got.sum())  # the trainer's entry
    got.sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    same = torch.randn(3, 5)  # equal distributions: no divergence, at any β
    for beta in (0.1, 0.5, 1.0):
        assert float(generalized_jsd_per_token(same, same, beta).abs().max()) < 1e-6
    torch.manual_seed(2)  # a teacher that gives an entry probability 0 adds nothing there (no nan)
    masked = torch.randn(2, 4)
    masked[:, 0] = float("-inf")
    assert torch.isfinite(generalized_jsd_per_token(torch.randn(2, 4), masked, 0.5)).all()
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd_per_token(same, same, 0.0)


def test_the_reverse_kl_leaves_out_what_a_narrower_teacher_head_never_gives():
    """β = 1 against a teacher head padded to the student's size with -inf (`match_vocab`): finite, with finite
    gradients, and equal to the reverse KL over the shared entries (the student renormalised over them)."""
    torch.manual_seed(3)
    student, narrow = torch.randn(2, 10, requires_grad=True), torch.randn(2, 8)
    got = distill_sum(student, match_vocab(narrow, 10), beta=1.0)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(student.grad).all()
    shared = distill_sum(student.detach()[:, :8], narrow, beta=1.0)
    torch.testing.assert_close(got.detach(), shared, rtol=0, atol=1e-6)
