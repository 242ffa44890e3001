"""DPPO (verl's policy_loss.loss_mode=dppo_tv / dppo_kl): the losses against their bounds written out token by token,
the truncation of the ratio, and verl's spelling of a run (which keeps verl's clip_ratio_c, the truncation)."""

import json
import math

import pytest
import torch

from alignrl.config import load_config
from alignrl.core.losses import POLICY_LOSSES

pytestmark = pytest.mark.timeout(240)


def _inside(kind, lp, old_lp, a, low, high):
    p, q = math.exp(lp), math.exp(old_lp)
    if kind == "dppo_tv":
        return p - q <= high if a > 0 else q - p <= low
    kl = q * (old_lp - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)


def _by_hand(kind, logp, old, adv, mask, low, high, cap):
    """-A * min(r, cap) (a constant) * log pi on the tokens inside the bound; token-mean."""
    total, inside = 0, 0
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j] == 0:
                continue
            a, lp, olp = float(adv[i, j]), float(logp[i, j].detach()), float(old[i, j])
            if _inside(kind, lp, olp, a, low, high):
                total = total - a * min(math.exp(lp - olp), cap) * logp[i, j]
                inside += 1
    return total / mask.sum(), inside


@pytest.mark.parametrize("kind", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_dppo_keeps_the_gradient_of_the_tokens_inside_its_bound(kind, cap):
    torch.manual_seed(1)
    logp = torch.log(torch.rand(4, 6, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    old = torch.log((logp.detach().exp() + 0.25 * torch.randn(4, 6, dtype=torch.float64)).clamp(0.02, 0.98))
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:, None].expand(4, 6)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[2, 3:] = 0
    low, high = 0.1, 0.15
    loss, metrics = POLICY_LOSSES[kind](logp, old, adv, mask, low, high, clip_c=cap)
    logp2 = logp.detach().clone().requires_grad_()
    expect, inside = _by_hand(kind, logp2, old, adv, mask, low, high, 20.0 if cap is None else cap)
    assert 0 < inside < mask.sum()  # the bound binds on some tokens and not others
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp2)[0],
                               rtol=1e-12, atol=0)
    assert metrics["actor/clipfrac"] == pytest.approx(1 - inside / mask.sum().item())


def test_verls_dppo_keys_keep_the_truncation_and_a_run_trains(tiny_model_dir, tmp_path, cli_in_process):
    """verl's DPPO reads clip_ratio_c (3.0 in verl's defaults) as the truncation of its ratio, where its other
    non-PPO losses read none; alignrl's own spelling without it truncates at 20."""
    from conftest import SMALL_GRPO, run_settings

    for mode in ("dppo_tv", "dppo_kl"):
        cfg = load_config(None, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
        assert (cfg.actor.policy_loss, cfg.actor.clip_ratio_c) == (mode, 3.0)
        assert load_config(None, [f"actor.policy_loss={mode}", "actor.clip_ratio_c=10"]).actor.clip_ratio_c == 10
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", "actor.policy_loss=dppo_kl",
                         *run_settings(tmp_path, "dppo", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "dppo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r]
    assert len(norms) == 2 and all(math.isfinite(n) for n in norms)
