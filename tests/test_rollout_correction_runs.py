"""verl 0.7's rollout correction in the trainer (IS, its batch normalisation over ranks, rejection sampling and the
veto in verl's order), alignrl's checks of its keys, and runs with it and with verl's bypass mode."""

from __future__ import annotations

import json
import math

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.rollout_correction import truncated_is_weights
from alignrl.rl.trainer import PolicyTrainer
from test_rollout_rejection import MASK, ROLLOUT, TRAINER, verl_rs


def _trainer(*overrides: str) -> PolicyTrainer:
    return PolicyTrainer(load_config(None, ["model.path=demo", *overrides]), None, None)


def test_the_trainer_applies_is_normalisation_rs_and_veto_in_verls_order(monkeypatch):
    """Decoupled mode: IS weights normalised by the mean over every rank's units (here this rank's and another's
    [sum 6, count 2]), then rejection and the veto decided on the mask given, whatever the other rejected: row 1's
    catastrophic token fails token RS too, and the veto still drops the rest of its sequence."""
    import alignrl.rl.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "all_reduce_sum", lambda env, values: [values[0] + 6.0, values[1] + 2.0])
    t = _trainer("algorithm.rollout_is=token", "algorithm.rollout_is_threshold=3",
                 "algorithm.rollout_is_batch_normalize=true", "algorithm.rollout_rs=token",
                 "algorithm.rollout_rs_threshold=1.6", "algorithm.rollout_token_veto_threshold=0.01")
    weights, keep, metrics = t.rollout_correction(TRAINER, ROLLOUT, MASK)
    raw, _, _ = truncated_is_weights(TRAINER, ROLLOUT, MASK, "token", 3.0)
    mean = (float(raw.sum()) + 6.0) / (6 + 2)
    assert keep.tolist() == [[True, True, False, True], [False] * 4, [False] * 4]
    torch.testing.assert_close(weights, raw / mean * keep, rtol=1e-12, atol=0)
    assert metrics["rollout/is_batch_norm_factor"] == pytest.approx(mean, rel=1e-12)
    assert (metrics["rollout/veto_frac"], metrics["rollout/rs_masked_frac"]) == pytest.approx((1 / 3, 2 / 6))


def test_rejection_without_is_trains_unweighted():
    weights, keep, metrics = _trainer("algorithm.rollout_rs=geometric", "algorithm.rollout_rs_threshold=1.1"
                                      ).rollout_correction(TRAINER, ROLLOUT, MASK)
    assert weights is None and keep.tolist() == verl_rs("geometric", 1.1, None)[0]
    assert "rollout/is_weight_mean" not in metrics


@pytest.mark.parametrize("given, error", [
    (["algorithm.rollout_rs=token", "actor.recompute_old_logprobs=false"],
     "algorithm.rollout_rs=token needs actor.recompute_old_logprobs=true"),
    (["algorithm.rollout_token_veto_threshold=1e-4", "actor.recompute_old_logprobs=false"],
     "algorithm.rollout_token_veto_threshold=0.0001 needs actor.recompute_old_logprobs=true"),
    (["algorithm.rollout_token_veto_threshold=0"], "algorithm.rollout_token_veto_threshold=0.0 is out of range"),
    (["algorithm.rollout_is_batch_normalize=true"], "set algorithm.rollout_is=token"),
    (["algorithm.rollout_rs=turn"], "algorithm.rollout_rs=turn: give none, token, sequence or geometric"),
    (["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold=0.5"],
     "algorithm.rollout_rs_threshold_lower=default 1/upper exceeds the upper bound 0.5"),
    (["algorithm.rollout_rs=token", "algorithm.rollout_rs_threshold_lower=3"],
     "algorithm.rollout_rs_threshold_lower=3.0 exceeds the upper bound 2.0"),
])
def test_bad_settings_are_one_line(given, error):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=demo", *given])
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_run_with_the_veto_rejection_and_normalisation_trains_and_logs_them(tiny_model_dir, tmp_path,
                                                                               cli_in_process):
    from conftest import SMALL_GRPO, run_settings

    rc = "algorithm.rollout_correction."
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", rc + "rollout_is=token",
                         rc + "rollout_is_batch_normalize=true", rc + "rollout_rs=geometric",
                         rc + "rollout_rs_threshold=1.001", rc + "rollout_token_veto_threshold=1e-4",
                         *run_settings(tmp_path, "veto", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "veto" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert len(steps) == 2
    for key in ("rollout/veto_frac", "rollout/veto_token_frac", "rollout/rs_masked_frac",
                "rollout/is_batch_norm_factor"):
        assert all(math.isfinite(r[key]) for r in steps), key


def test_a_bypass_run_trains_with_the_rollouts_logprobs(tiny_model_dir, tmp_path, cli_in_process):
    from conftest import SMALL_GRPO, run_settings

    rc = "algorithm.rollout_correction."
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", rc + "bypass_mode=true",
                         rc + "loss_type=reinforce", rc + "rollout_is=token", *run_settings(tmp_path, "bypass", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "bypass" / "logs" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r]
    assert len(norms) == 2 and all(math.isfinite(n) for n in norms)
