"""Clip-Cov and KL-Cov (verl's policy_loss.loss_mode=clip_cov / kl_cov): the losses against verl's procedure written
out token by token, their draws, and runs in alignrl's and verl's spellings."""

import json

import pytest
import torch

from alignrl.config import load_config
from alignrl.core.covariance_losses import clip_cov_loss, covariance, kl_cov_loss
from alignrl.core.losses import POLICY_LOSSES

pytestmark = pytest.mark.timeout(240)


def _problem(seed=0, rows=4, cols=6):
    torch.manual_seed(seed)
    logp = (-torch.rand(rows, cols, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(rows, cols, dtype=torch.float64)
    adv = torch.randn(rows, dtype=torch.float64)[:, None].expand(rows, cols) * 3
    mask = torch.ones(rows, cols, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return logp, old, adv, mask


def _covariances_by_hand(adv, logp, mask):
    """(A - mean A) * (log pi - mean log pi), the means over the counted tokens, one token at a time."""
    keep = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] > 0]
    mean_a = sum(float(adv[i, j]) for i, j in keep) / len(keep)
    mean_lp = sum(float(logp[i, j].detach()) for i, j in keep) / len(keep)
    return {(i, j): (float(adv[i, j]) - mean_a) * (float(logp[i, j].detach()) - mean_lp) for i, j in keep}


def _clip_cov_by_hand(logp, old, adv, mask, restrained, low=0.2, high=0.2):
    """PPO's clipped token losses, those of `restrained` tokens set to 0, token-mean: verl's compute_policy_loss_
    clip_cov once its tokens are drawn."""
    total = 0
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if mask[i, j] > 0 and (i, j) not in restrained:
                r = torch.exp(logp[i, j] - old[i, j])
                total = total + torch.maximum(-adv[i, j] * r, -adv[i, j] * r.clamp(1 - low, 1 + high))
    return total / mask.sum()


def test_covariance_is_the_papers_per_token_term():
    logp, _, adv, mask = _problem()
    got = covariance(adv, logp, mask)
    for (i, j), want in _covariances_by_hand(adv, logp, mask).items():
        assert got[i, j].item() == pytest.approx(want, rel=1e-12)


def test_clip_cov_removes_the_gradient_of_its_drawn_tokens_only():
    logp, old, adv, mask = _problem()
    cov = _covariances_by_hand(adv, logp.detach(), mask)
    lb, ub = sorted(cov.values())[-8], 1e9  # eight candidates above lb (less any PPO has clipped)
    loss, metrics = clip_cov_loss(logp, old, adv, mask, cov_ratio=0.1, cov_lb=lb - 1e-9, cov_ub=ub,
                                  generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad(loss, logp)
    (ppo_grad,) = torch.autograd.grad(POLICY_LOSSES["ppo_clip"](logp, old, adv, mask)[0], logp)
    # the tokens PPO trains and clip_cov does not (PPO's clip has already cut the others' gradient)
    restrained = {(i, j) for i in range(4) for j in range(6) if ppo_grad[i, j] != 0 and grad[i, j] == 0}
    assert len(restrained) == max(int(0.1 * mask.sum()), 1) == 1
    assert metrics["actor/cov_frac"] == pytest.approx(1 / 18)
    (i, j), = restrained
    assert cov[(i, j)] >= lb
    logp2 = logp.detach().clone().requires_grad_()
    expect = _clip_cov_by_hand(logp2, old, adv, mask, restrained)
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(expect, logp2)[0], rtol=1e-12, atol=0)
    again, _ = clip_cov_loss(logp, old, adv, mask, cov_ratio=0.1, cov_lb=lb - 1e-9, cov_ub=ub,
                             generator=torch.Generator().manual_seed(3))
    assert again.item() == loss.item()  # the same generator draws the same tokens


def test_clip_cov_with_every_candidate_drawn_and_with_none_is_ppo_less_those():
    logp, old, adv, mask = _problem(seed=1)
    cov = _covariances_by_hand(adv, logp.detach(), mask)
    lb, ub = -0.5, 0.5
    log_ratio = (logp.detach() - old)
    cut = {(i, j) for (i, j) in cov if (-adv[i, j] * log_ratio[i, j].exp().clamp(0.8, 1.2)
                                        > -adv[i, j] * log_ratio[i, j].exp())}
    candidates = {k for k, c in cov.items() if lb < c < ub and k not in cut}
    assert 0 < len(candidates) < len(cov)
    loss, metrics = clip_cov_loss(logp, old, adv, mask, cov_ratio=1.0, cov_lb=lb, cov_ub=ub)
    torch.testing.assert_close(loss, _clip_cov_by_hand(logp, old, adv, mask, candidates), rtol=1e-12, atol=0)
    assert metrics["actor/cov_frac"] == pytest.approx(len(candidates) / len(cov))
    none, _ = clip_cov_loss(logp, old, adv, mask, cov_lb=1e8, cov_ub=1e9)
    ppo, _ = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask)
    torch.testing.assert_close(none, ppo, rtol=1e-12, atol=0)


def _kl_cov_by_hand(logp, old, adv, mask, ratio, coef):
    """verl's compute_policy_loss_kl_cov token by token: -A r on every token, + coef |log r| on the top
    max(1, int(ratio * counted)) tokens by covariance; token-mean."""
    cov = _covariances_by_hand(adv, logp.detach(), mask)
    top = sorted(cov, key=cov.get, reverse=True)[:max(1, int(ratio * len(cov)))]
    total = 0
    for i, j in cov:
        lr = logp[i, j] - old[i, j]
        total = total - adv[i, j] * torch.exp(lr) + (coef * lr.abs() if (i, j) in top else 0)
    return total / mask.sum(), top


@pytest.mark.parametrize("ratio", [2e-4, 0.25])
def test_kl_cov_penalises_the_tokens_of_largest_covariance(ratio):
    logp, old, adv, mask = _problem(seed=2)
    loss, metrics = kl_cov_loss(logp, old, adv, mask, cov_ratio=ratio, kl_coef=0.7)
    logp2 = logp.detach().clone().requires_grad_()
    expect, top = _kl_cov_by_hand(logp2, old, adv, mask, ratio, 0.7)
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(expect, logp2)[0],
                               rtol=1e-12, atol=0)
    assert metrics["actor/cov_frac"] == pytest.approx(len(top) / mask.sum().item())
    assert metrics["actor/clipfrac"] == 0.0  # no clip


def test_a_batch_without_counted_tokens_is_zero():
    logp, old, adv, _ = _problem()
    for fn in (clip_cov_loss, kl_cov_loss):
        loss, metrics = fn(logp, old, adv, torch.zeros_like(logp))
        assert loss.item() == 0.0 and metrics["actor/cov_frac"] == 0.0


def test_runs_train_in_alignrls_and_verls_spellings(tiny_model_dir, tmp_path, cli_in_process):
    """`actor.policy_loss=clip_cov` / `kl_cov`, and verl's `policy_loss.loss_mode` with its tuning keys, select them
    and a run trains, logging the restrained tokens' share."""
    from conftest import SMALL_GRPO, run_settings

    verl = "actor_rollout_ref.actor.policy_loss."
    cfg = load_config(None, [f"{verl}loss_mode=clip_cov", f"{verl}clip_cov_ratio=0.01", f"{verl}clip_cov_lb=0.5",
                             f"{verl}clip_cov_ub=4"])
    assert (cfg.actor.policy_loss, cfg.actor.clip_cov_ratio, cfg.actor.clip_cov_lb, cfg.actor.clip_cov_ub,
            cfg.actor.clip_ratio_c) == ("clip_cov", 0.01, 0.5, 4.0, 0.0)  # verl's clip_cov reads no dual clip
    assert load_config(None, [f"{verl}loss_mode=kl_cov"]).actor.ppo_kl_coef == 0.1  # verl's actor.yaml default
    for mode in ("kl_cov", "geo_mean"):  # nor do its other losses, where a script gives one
        given = load_config(None, [f"{verl}loss_mode={mode}", "actor_rollout_ref.actor.clip_ratio_c=3.0"])
        assert given.actor.clip_ratio_c == 0.0
    for loss, extra in (("clip_cov", ["actor.clip_cov_ratio=0.05", "actor.clip_cov_lb=-10", "actor.clip_cov_ub=10"]),
                        ("kl_cov", ["actor.kl_cov_ratio=0.05"])):
        got = cli_in_process("train", "grpo", *SMALL_GRPO, f"model.path={tiny_model_dir}", f"actor.policy_loss={loss}",
                             *extra, *run_settings(tmp_path, loss, 2))
        assert got.returncode == 0, got.stderr[-3000:] + got.stdout[-3000:]
        rows = [json.loads(x) for x in (tmp_path / loss / "logs" / "metrics.jsonl").read_text().splitlines()]
        shares = [r["actor/cov_frac"] for r in rows if "actor/cov_frac" in r]
        assert len(shares) == 2 and all(s > 0 for s in shares), shares


def test_bounds_that_leave_no_room_are_one_line():
    from alignrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"actor.clip_cov_lb=5.0 must be below actor.clip_cov_ub=1.0") as e:
        load_config(None, ["actor.policy_loss=clip_cov", "actor.clip_cov_lb=5", "actor.clip_cov_ub=1"])
    assert "\n" not in str(e.value)


def test_the_same_rows_draw_afresh_in_a_later_epoch_and_alike_in_a_rerun():
    from alignrl.train.actor import token_draws

    def draws_of(seed: int) -> list[list[int]]:
        draw = token_draws(torch.Generator().manual_seed(seed))
        rows = [torch.tensor([0, 1, 2]), torch.tensor([3, 4]), torch.tensor([0, 1, 2])]  # epoch 2 meets rows 0-2 again
        return [torch.randperm(1000, generator=draw(r))[:8].tolist() for r in rows]

    first, again = draws_of(5), draws_of(5)
    assert first == again  # a rerun (or a resumed run) draws the same tokens
    assert first[0] != first[2] and first[0] != first[1]  # the same rows in a later epoch draw other tokens
