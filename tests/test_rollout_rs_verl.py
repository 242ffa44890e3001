"""Current verl's rejection sampling options (rollout_rs=token_k1, seq_sum_k1, seq_mean_k1, seq_max_k2, token_k3,
binary_kl, ..., comma-separated, with its lower_upper threshold spec) against a by-hand walk through verl's
compute_rollout_rejection_mask in float64; their parsing, one-line mistakes, the trainer's use of them, and verl's
keys (algorithm.rollout_correction.*) with IcePop's lower_upper IS threshold."""

from __future__ import annotations

import math

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.config.rollout_rs import rs_options
from alignrl.core.rollout_rejection import divergence_rejection_mask
from test_rollout_rejection import MASK, ROLLOUT, TRAINER, counted, log_ratio


def _k(kind: str, row: int, t: int) -> float:
    lr = max(-20.0, min(20.0, log_ratio(row, t)))
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr * lr
    if kind == "k3":
        return math.exp(lr) - 1 - lr
    p, q = (min(max(math.exp(float(x[row, t])), 1e-6), 1 - 1e-6) for x in (TRAINER, ROLLOUT))

    def kl(a, b):
        return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))
    return max(kl(p, q), kl(q, p))


def verl_keep(options) -> list[list[bool]]:
    """verl's procedure by hand: each option's statistic per token or per sequence, all options must pass."""
    out = []
    for row in range(3):
        toks, keep = counted(row), [True] * 4
        for name, lower, upper in options:
            kind = "binary_kl" if name == "binary_kl" else name[-2:]
            values = {t: _k(kind, row, t) for t in toks}
            if name.startswith("seq_sum"):
                values = dict.fromkeys(toks, sum(values.values()))
            elif name.startswith("seq_mean"):
                values = dict.fromkeys(toks, sum(values.values()) / len(toks) if toks else 0.0)
            elif name.startswith("seq_max"):
                values = dict.fromkeys(toks, max(values.values()) if toks else 0.0)
            for t in toks:
                ok = (math.log(lower) <= values[t] <= math.log(upper)) if kind == "k1" else values[t] <= upper
                keep[t] = keep[t] and ok
        out.append([bool(MASK[row, t]) and keep[t] for t in range(4)])
    return out


@pytest.mark.parametrize("options", [
    [("token_k1", 0.6, 1.3)], [("seq_sum_k1", 0.5, 2.0)], [("seq_mean_k1", 0.9, 1.2)], [("token_k2", None, 0.02)],
    [("seq_mean_k3", None, 0.05)], [("seq_max_k2", None, 0.03)], [("binary_kl", None, 0.01)],
    [("token_k1", 0.6, 1.3), ("seq_max_k3", None, 1.0)]])
def test_each_option_is_verls(options):
    keep, metrics = divergence_rejection_mask(TRAINER, ROLLOUT, MASK, options)
    expected = verl_keep(options)
    assert keep.tolist() == expected
    rejected = sum(bool(MASK[r, t]) and not expected[r][t] for r in range(3) for t in range(4))
    assert metrics["rollout/rs_masked_frac"] == pytest.approx(rejected / int(MASK.sum()))


def test_the_options_cut_something_and_keep_something():
    """The bands above are not vacuous: each test case rejects some counted tokens and keeps others."""
    keep, _ = divergence_rejection_mask(TRAINER, ROLLOUT, MASK, [("token_k1", 0.6, 1.3)])
    assert 0 < int((keep & MASK).sum()) < int(MASK.sum())


def test_threshold_specs_read_as_verls():
    assert rs_options("seq_mean_k1", "0.99_1.01") == [("seq_mean_k1", 0.99, 1.01)]
    assert rs_options("token_k1", 2.0) == [("token_k1", 0.5, 2.0)]  # lower 1/upper
    assert rs_options("token_k1,seq_max_k2", "0.9_1.1,0.01") == [("token_k1", 0.9, 1.1), ("seq_max_k2", None, 0.01)]
    assert rs_options("seq_sum_k3,token_k2", "0.3") == [("seq_sum_k3", None, 0.3), ("token_k2", None, 0.3)]
    assert rs_options("geometric", 1.1) is None and rs_options("none", None) is None


@pytest.mark.parametrize("rs, spec, words", [
    ("seq_max_k2", "0.5_0.9", "takes one upper bound"), ("token_k1", None, "needs algorithm.rollout_rs_threshold"),
    ("token_k1,seq_max_k2", "1,2,3", "one bound for all"), ("token_k1", "2_1", "lower bound 2.0 is above"),
    ("seq_mean_k4", 1.0, "give none, token, sequence or geometric"), ("token_k2", "x", "is not a number")])
def test_bad_specs_are_one_line(rs, spec, words):
    with pytest.raises(ConfigError, match=words):
        rs_options(rs, spec)


def test_the_trainer_rejects_with_verls_options():
    from alignrl.rl.trainer import PolicyTrainer

    t = PolicyTrainer(load_config(None, ["model.path=demo", "algorithm.rollout_rs=token_k1",
                                         "algorithm.rollout_rs_threshold=0.6_1.3"]), None, None)
    weights, keep, metrics = t.rollout_correction(TRAINER, ROLLOUT, MASK)
    assert weights is None and keep.tolist() == verl_keep([("token_k1", 0.6, 1.3)])
    assert "rollout/rs_masked_frac" in metrics


def test_verls_rollout_correction_keys_with_icepop_and_divergence_rs():
    rc = "algorithm.rollout_correction."
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6", rc + "rollout_is=token",
                             rc + "rollout_is_threshold=0.5_5.0", rc + "rollout_rs=seq_mean_k1",
                             rc + "rollout_rs_threshold=0.99_1.01"])
    a = cfg.algorithm
    assert (a.rollout_is, a.rollout_is_mode, a.rollout_is_threshold, a.rollout_is_threshold_lower) == (
        "token", "zero", 5.0, 0.5)  # IcePop: weights outside the band are zeroed, the tokens stay
    assert (a.rollout_rs, a.rollout_rs_threshold) == ("seq_mean_k1", "0.99_1.01")
    with pytest.raises(ConfigError, match="takes one upper bound"):
        load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6", rc + "rollout_rs=seq_max_k2",
                           rc + "rollout_rs_threshold=0.9_1.1"])


def test_icepop_zeroes_the_weights_and_keeps_every_token():
    """verl's IcePop keeps the response mask (the zeroed tokens still count in the loss's denominators) and zeroes
    the weights outside [lower, upper], bounds included in the band; mask mode drops those tokens instead."""
    from alignrl.core.rollout_correction import truncated_is_weights

    weights, keep, metrics = truncated_is_weights(TRAINER, ROLLOUT, MASK, "token", 1.3, "zero", 0.6)
    assert keep.tolist() == MASK.tolist()
    for r in range(3):
        for t in range(4):
            w = math.exp(max(-20.0, min(20.0, log_ratio(r, t))))
            expected = w if MASK[r, t] and 0.6 <= w <= 1.3 else 0.0
            assert float(weights[r, t]) == pytest.approx(expected, rel=1e-12)
    assert 0 < metrics["rollout/is_zeroed_frac"] < 1


def test_icepop_in_bypass_mode_is_named_as_missing(capsys, monkeypatch):
    monkeypatch.setenv("ALIGNRL_VERL_KEYS_LISTED", "")  # once per process: listed again here, restored after
    monkeypatch.delenv("ALIGNRL_VERL_KEYS_LISTED")
    rc = "algorithm.rollout_correction."
    load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6", rc + "rollout_is=token", rc + "bypass_mode=true",
                       rc + "loss_type=reinforce", rc + "rollout_is_threshold=0.5_2.0"])
    assert "IcePop's lower_upper rollout_is_threshold in bypass mode" in capsys.readouterr().err
