"""SAPO (verl's policy_loss.loss_mode=sapo): the soft gate against its formula token by token, its gradient where the
policy has not moved, and verl's spelling of a run."""

import json
import math

import pytest
import torch

from alignrl.config import load_config
from alignrl.core.losses import POLICY_LOSSES, sapo_loss
from alignrl.rl.trainer import policy_loss_spec

pytestmark = pytest.mark.timeout(240)


def _sapo_by_hand(logp, old, adv, mask, tau_pos, tau_neg):
    """-(4 / tau) * sigmoid(tau * (r - 1)) * A per token, tau by the advantage's sign; seq-mean-token-mean."""
    per_seq = []
    for i in range(mask.shape[0]):
        terms = []
        for j in range(mask.shape[1]):
            if mask[i, j] > 0:
                tau = tau_pos if adv[i, j] > 0 else tau_neg
                r = torch.exp(logp[i, j] - old[i, j])
                terms.append(-(4 / tau) * torch.sigmoid(tau * (r - 1)) * adv[i, j])
        per_seq.append(sum(terms) / len(terms))
    return sum(per_seq) / len(per_seq)


def test_sapo_is_the_soft_gate_of_the_paper():
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.5 * torch.randn(3, 5, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.8, 0.0], dtype=torch.float64)[:, None].expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float64)
    loss, metrics = sapo_loss(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05, global_seqs=3.0)
    logp2 = logp.detach().clone().requires_grad_()
    expect = _sapo_by_hand(logp2, old, adv, mask, 1.0, 1.05)
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp2)[0],
                               rtol=1e-12, atol=0)
    assert metrics["actor/clipfrac"] == 0.0 and POLICY_LOSSES["sapo"] is sapo_loss


def test_where_the_policy_has_not_moved_sapo_steps_as_ppo():
    """At r = 1 the gate's slope is 1 whatever tau: the gradient is PPO's, A * grad log pi (token-mean here)."""
    logp = (-torch.rand(2, 4, dtype=torch.float64)).requires_grad_()
    adv, mask = torch.tensor([0.7, -1.3], dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
    kw = dict(loss_agg="token-mean")
    (soft,) = torch.autograd.grad(sapo_loss(logp, logp.detach(), adv, mask, tau_pos=0.3, tau_neg=3.0, **kw)[0], logp)
    (ppo,) = torch.autograd.grad(POLICY_LOSSES["ppo_clip"](logp, logp.detach(), adv, mask, **kw)[0], logp)
    torch.testing.assert_close(soft, ppo, rtol=1e-12, atol=0)


def test_verls_sapo_keys_select_it_and_a_run_trains(tiny_model_dir, tmp_path, cli_in_process):
    """examples/sapo_trainer's keys: policy_loss.loss_mode=sapo with actor.tau_pos / tau_neg; verl's SAPO loss
    averages sequences whatever loss_agg_mode says, which aggregates the KL and entropy terms alone (token-mean, verl's
    default)."""
    from conftest import SMALL_GRPO, run_settings

    actor = "actor_rollout_ref.actor."
    cfg = load_config(None, [f"{actor}policy_loss.loss_mode=sapo", f"{actor}tau_pos=0.9", f"{actor}tau_neg=1.2"])
    a = cfg.actor
    assert (a.policy_loss, a.tau_pos, a.tau_neg, a.clip_ratio_c) == ("sapo", 0.9, 1.2, 0)
    spec = policy_loss_spec(cfg)
    assert (spec.policy_agg, spec.loss_agg, spec.sapo) == ("seq-mean-token-mean", "token-mean", (0.9, 1.2))
    got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", "actor.policy_loss=sapo",
                         *run_settings(tmp_path, "sapo", 2))
    assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "sapo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    norms = [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r]
    assert len(norms) == 2 and all(math.isfinite(n) for n in norms)
