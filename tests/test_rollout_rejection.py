"""verl 0.7's rollout correction beyond truncated IS (verl/trainer/ppo/rollout_corr_helper.py, core_algos.py): rejection
sampling at a token, sequence or geometric level, the catastrophic-token veto, the IS weights' batch normalisation and
bypass mode's REINFORCE loss, each against a by-hand walk through verl's procedure in float64. The trainer, the checks
and runs: test_rollout_correction_runs.py."""

from __future__ import annotations

import math

import pytest
import torch

from alignrl.core.losses import POLICY_LOSSES
from alignrl.core.rollout_correction import truncated_is_weights
from alignrl.core.rollout_rejection import batch_normalized, rejection_mask, token_veto, weight_sums

# three sequences, float64: row 0 four tokens, row 1 two (then padding holding junk), row 2 none
TRAINER = torch.tensor([[-0.5, -1.0, -2.0, -0.1], [-0.3, -9.0, 7.0, 7.0], [-1.0, -1.0, -1.0, -1.0]],
                       dtype=torch.float64)
ROLLOUT = torch.tensor([[-0.7, -0.9, -2.5, -0.1], [-0.35, -2.0, -50.0, 3.0], [0.0, 0.0, 0.0, 0.0]],
                       dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)


def counted(row: int) -> list[int]:
    return [t for t in range(4) if MASK[row, t]]


def log_ratio(row: int, t: int) -> float:
    return float(TRAINER[row, t] - ROLLOUT[row, t])


def verl_rs(level: str, upper: float, lower: float | None) -> tuple[list[list[bool]], float, float]:
    """verl's compute_rollout_rejection_mask by hand: the kept mask, the token and the sequence rejection shares."""
    low = 1 / upper if lower is None else lower
    keep, rejected_tokens, rejected_rows = [], 0, 0
    for row in range(3):
        toks = counted(row)
        if level == "token":
            w = {t: math.exp(max(-20.0, min(20.0, log_ratio(row, t)))) for t in toks}
        else:
            s = sum(log_ratio(row, t) for t in toks)
            if level == "geometric":
                s = s / len(toks) if toks else 0.0
            w = {t: math.exp(max(-20.0, min(20.0, s))) for t in toks}
        kept = [t in toks and low <= w[t] <= upper for t in range(4)]
        keep.append(kept)
        out = sum(1 for t in toks if not kept[t])
        rejected_tokens += out
        rejected_rows += out > 0
    return keep, rejected_tokens / 6, rejected_rows / 3


@pytest.mark.parametrize("level, upper, lower", [("token", 1.2, None), ("token", 2.0, 0.5), ("sequence", 1.5, None),
                                                 ("sequence", 2.0, 0.9), ("geometric", 1.001, None),
                                                 ("geometric", 1.2, 0.95)])
def test_rejection_sampling_is_verls(level, upper, lower):
    keep, metrics = rejection_mask(TRAINER, ROLLOUT, MASK, level, upper, lower)
    want, token_share, seq_share = verl_rs(level, upper, lower)
    assert keep.tolist() == want
    assert metrics == pytest.approx({"rollout/rs_masked_frac": token_share, "rollout/rs_seq_masked_frac": seq_share},
                                    rel=1e-12)


def test_the_levels_hand_worked():
    """Row 0's log-ratios 0.2, -0.1, 0.5, 0: its product e^0.6 = 1.82 passes a sequence bound of 2 and fails 1.5;
    its geometric mean e^0.15 = 1.16 fails 1.1; its token e^0.5 = 1.65 alone fails a token bound of 1.5."""
    row0 = [[True] * 4, [False] * 4, [False] * 4]
    assert rejection_mask(TRAINER, ROLLOUT, MASK, "sequence", 2.0, 0.0)[0][0].tolist() == row0[0]
    assert rejection_mask(TRAINER, ROLLOUT, MASK, "sequence", 1.5, 0.0)[0][0].tolist() == row0[1]
    assert rejection_mask(TRAINER, ROLLOUT, MASK, "geometric", 1.1, 0.0)[0][0].tolist() == row0[2]
    assert rejection_mask(TRAINER, ROLLOUT, MASK, "token", 1.5, 0.0)[0][0].tolist() == [True, True, False, True]
    with pytest.raises(ValueError):
        rejection_mask(TRAINER, ROLLOUT, MASK, "turn")


@pytest.mark.parametrize("threshold", [1e-4, 0.5, 0.95, 2.0])
def test_the_veto_is_verls(threshold):
    """verl's veto by hand: a counted token's unbounded log-ratio below log(threshold) drops its sequence; the
    shares are of the batch's sequences and of its counted tokens. Row 1's -7 log-ratio (1e-3) is caught by 0.5,
    not by 1e-4; padding (row 1's junk -57 and +4) never counts."""
    keep, metrics = token_veto(TRAINER, ROLLOUT, MASK, threshold)
    bad = [[t for t in counted(row) if log_ratio(row, t) < math.log(threshold)] for row in range(3)]
    want = [[t in counted(row) and not bad[row] for t in range(4)] for row in range(3)]
    assert keep.tolist() == want
    assert metrics == pytest.approx({"rollout/veto_frac": sum(1 for b in bad if b) / 3,
                                     "rollout/veto_token_frac": sum(map(len, bad)) / 6}, rel=1e-12)
    with pytest.raises(ValueError):
        token_veto(TRAINER, ROLLOUT, MASK, 0.0)


def test_veto_catches_row_one_at_one_half_only():
    assert token_veto(TRAINER, ROLLOUT, MASK, 1e-4)[0][1].tolist() == [True, True, False, False]  # e^-7 > 1e-4
    assert not token_veto(TRAINER, ROLLOUT, MASK, 0.5)[0][1].any()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalisation_is_verls(level):
    """verl's rollout_is_batch_normalize by hand: the truncated weights over the counted tokens (token level) or the
    sequences with a token, each its weight (sequence level); their mean divides them all."""
    weights, keep, _ = truncated_is_weights(TRAINER, ROLLOUT, MASK, level, 1.5)
    total, count = weight_sums(weights, keep, level)
    if level == "token":
        units = [min(math.exp(log_ratio(r, t)), 1.5) for r in range(3) for t in counted(r)]
    else:
        units = [min(math.exp(sum(log_ratio(r, t) for t in counted(r))), 1.5) for r in range(3) if counted(r)]
    assert (total, count) == pytest.approx((sum(units), len(units)), rel=1e-12)
    out, metrics = batch_normalized(weights, total, count)
    mean = sum(units) / len(units)
    torch.testing.assert_close(out, weights / mean, rtol=1e-12, atol=0)
    assert metrics == pytest.approx({"rollout/is_batch_norm_factor": mean}, rel=1e-12)
    assert batch_normalized(weights, 0.0, 0.0)[1] == {"rollout/is_batch_norm_factor": 1.0}


def test_bypass_reinforce_with_token_is_is_cispo_unbounded_below():
    """verl's bypass mode, loss_type=reinforce, rollout_is=token: -A * log pi * min(pi / pi_rollout, C) with the
    weight from the policy being trained, detached; alignrl's CISPO with old = rollout, clip_ratio_low=1 (no lower
    bound) and clip_ratio_high = C - 1 is the same loss and gradient, per token."""
    logp = TRAINER.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    m = MASK.to(torch.float64)
    loss, _ = POLICY_LOSSES["cispo"](logp, ROLLOUT, adv, m, 1.0, 2.0 - 1, loss_agg="token-mean")
    terms = [-float(adv[r]) * float(TRAINER[r, t]) * min(math.exp(log_ratio(r, t)), 2.0)
             for r in range(3) for t in counted(r)]
    assert float(loss.detach()) == pytest.approx(sum(terms) / 6, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    want = torch.zeros_like(TRAINER)
    for r in range(3):
        for t in counted(r):
            want[r, t] = -float(adv[r]) * min(math.exp(log_ratio(r, t)), 2.0) / 6
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
