"""TRL's newest GRPO loss options in alignrl's math, each against TRL's formula written out on tiny tensors: the
off-policy sequence mask (--off_policy_mask_threshold), LUSPO (--loss_type luspo) and VESPO (--loss_type vespo);
the actor's loss with them, one trainer step reading the rollout engine's log-probs, and the refusals."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from alignrl.config import ConfigError, load_config
from alignrl.core.losses import POLICY_LOSSES, luspo_loss
from alignrl.core.sequence_weights import gamma_weights, masked_share, off_policy_keep, sampling_gap, vespo_loss
from alignrl.data.records import Experience
from alignrl.rl.trainer import policy_loss_spec
from alignrl.train.actor import policy_loss

G = torch.Generator().manual_seed(5)
OLD = -torch.rand(3, 4, generator=G) * 2
LOGP = (OLD + torch.randn(3, 4, generator=G) * 0.3).clamp(max=-0.01)
REF = -torch.rand(3, 4, generator=G) * 2
ENTROPY = torch.rand(3, 4, generator=G)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
ADV = torch.tensor([-1.0, -0.5, 1.0])


def _trl_off_policy_mask(adv, logp, sampling, m, threshold):  # TRL's get_off_policy_mask
    seq_kl = ((sampling - logp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (seq_kl <= threshold)).to(m.dtype)


def _trl_gamma(adv, log_ratio, m, is_ratio=None, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    seq = (log_ratio.clamp(-20, 20) * m).sum(-1, keepdim=True)  # TRL's get_gamma_weights
    if is_ratio is not None:
        seq = seq + (is_ratio.log().clamp(math.log(1e-8), 20) * m).sum(-1, keepdim=True)
    log_w = seq.clamp(math.log(1e-8), 20)
    k = torch.where(adv >= 0, k_pos, k_neg)
    lam = torch.where(adv >= 0, lam_pos, lam_neg)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).detach()


def test_off_policy_mask_is_trls_with_the_rollout_engines_log_probs():
    m = MASK.float()
    sampling = OLD + torch.tensor([[0.5], [0.9], [2.0]])  # the engine's log-probs: old_lp plus a gap per row
    gap = sampling_gap(sampling, OLD, MASK)
    torch.testing.assert_close(gap, torch.tensor([0.5, 0.9, 2.0]))
    for threshold in (0.0, 0.6, 1.0, 5.0):
        keep = off_policy_keep(LOGP, OLD, ADV, MASK, threshold, gap)
        torch.testing.assert_close(keep, _trl_off_policy_mask(ADV[:, None], LOGP, sampling, m, threshold))
        assert keep[2, 0] == 1  # a positive advantage always stays
    keep = off_policy_keep(LOGP, OLD, ADV, MASK, 0.6, gap)
    seq_kl = ((sampling - LOGP) * m).sum(1) / m.sum(1)
    assert keep[:, 0].tolist() == [float(seq_kl[0] <= 0.6), float(seq_kl[1] <= 0.6), 1.0]
    # without the engine's log-probs the old ones are the sampler's, as TRL's fallback
    torch.testing.assert_close(off_policy_keep(LOGP, OLD, ADV, MASK, 0.0),
                               _trl_off_policy_mask(ADV[:, None], LOGP, OLD, m, 0.0))
    assert masked_share(torch.tensor([[0.0], [1.0], [0.0]]), MASK) == pytest.approx(2 / 3)
    assert masked_share(torch.tensor([[0.0], [1.0], [0.0]]), MASK * torch.tensor([[1], [1], [0]])) == 0.5


def test_luspo_is_trls_sequence_level_loss_and_gradient():
    for delta in (None, 1.05):
        logp = LOGP.clone().requires_grad_()
        loss, _ = luspo_loss(logp, OLD, ADV, MASK.float(), 0.02, 0.03, delta=delta, loss_agg="token-mean")
        # TRL: coef_1 exp(masked mean log-ratio), (B, 1); (per_token_loss * mask.sum(-1, keepdim=True)).mean()
        lg = logp.clone().detach().requires_grad_()
        m = MASK.float()
        coef_1 = (((lg - OLD) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)).exp()
        coef_2 = coef_1.clamp(1 - 0.02, 1 + 0.03)
        capped = coef_1 if delta is None else coef_1.clamp(max=delta)
        trl = (-torch.min(capped * ADV[:, None], coef_2 * ADV[:, None]) * m.sum(-1, keepdim=True)).mean()
        torch.testing.assert_close(loss, trl)
        torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(trl, lg)[0])
    assert POLICY_LOSSES["luspo"] is luspo_loss and POLICY_LOSSES["vespo"] is vespo_loss


def test_vespo_weight_and_loss_are_trls():
    m, lr = MASK.float(), LOGP - OLD
    adv = ADV[:, None]
    torch.testing.assert_close(gamma_weights(lr, adv, m), _trl_gamma(adv, lr, m))
    assert float(gamma_weights(torch.zeros(1, 2), torch.ones(1, 1), torch.ones(1, 2))) == pytest.approx(1.0)  # phi(1)
    is_ratio = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    torch.testing.assert_close(gamma_weights(lr, adv, m, (1.5, 2.5, 2.0, 1.0), is_ratio),
                               _trl_gamma(adv, lr, m, is_ratio, 1.5, 2.5, 2.0, 1.0))
    logp = LOGP.clone().requires_grad_()
    loss, metrics = vespo_loss(logp, OLD, ADV, m, sampling_weight=is_ratio)
    phi = _trl_gamma(adv, lr, m, is_ratio)
    trl = (-phi * adv * logp * m).sum() / m.sum()  # dapo's normalisation; the IS ratio inside phi only
    torch.testing.assert_close(loss, trl)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], (-phi * adv * m / m.sum()))
    assert metrics["actor/vespo_phi_mean"] == pytest.approx(float(phi.mean()))
    # a sequence far off the old policy gets a vanishing weight, never a NaN
    far = gamma_weights(torch.full((1, 3), 15.0), torch.ones(1, 1), torch.ones(1, 3))
    assert float(far) == 0.0


def _exp(is_weight=None):
    return Experience(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                      torch.zeros(3, 4, dtype=torch.long), MASK, OLD, REF, ADV, is_weight)


def test_the_actors_vespo_loss_with_the_masks_is_trls():
    cfg = load_config(None, ["actor.policy_loss=vespo", "actor.off_policy_mask_threshold=0.05",
                             "actor.top_entropy_quantile=0.5", "actor.kl_loss_coef=0.1", "actor.vespo_k_neg=2.5",
                             "algorithm.rollout_is=token"])
    spec = policy_loss_spec(cfg)
    assert (spec.name, spec.loss_agg, spec.off_policy, spec.vespo) == ("vespo", "token-mean", 0.05, (2, 3, 2.5, 2))
    is_ratio = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) + 0.5
    gap = torch.tensor([0.1, -0.2, 0.3])
    logp = LOGP.clone().requires_grad_()
    loss, metrics = policy_loss(logp, ENTROPY, _exp(is_ratio), spec, float(MASK.sum()), 3.0, gap=gap)
    # TRL's _compute_loss: phi with the IS ratio folded in, times the off-policy and entropy masks, plus beta k3
    m, adv = MASK.float(), ADV[:, None]
    sampling = OLD + gap[:, None]
    opsm = _trl_off_policy_mask(adv, logp, sampling, m, 0.05)
    kept = (ENTROPY >= torch.quantile(ENTROPY[MASK], 0.5)) & MASK
    phi = _trl_gamma(adv, LOGP - OLD, m, is_ratio, k_neg=2.5)
    kl = torch.exp(REF - logp) - (REF - logp) - 1
    trl = (((-phi * adv * logp) * opsm * kept + 0.1 * kl) * m).sum() / m.sum()
    torch.testing.assert_close(loss, trl)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(trl, logp)[0])
    assert metrics["actor/off_policy_masked_frac"] == pytest.approx(float((opsm[:, 0] == 0).float().mean()))
    assert 0 < metrics["actor/off_policy_masked_frac"] < 1  # the case masks some and keeps some


def test_the_actors_ppo_loss_with_the_mask_and_rollout_weights_is_trls():
    spec = policy_loss_spec(load_config(None, ["actor.off_policy_mask_threshold=0.0", "actor.use_kl_loss=false",
                                               "actor.loss_agg_mode=token-mean"]))
    is_ratio = torch.rand(3, 4, generator=torch.Generator().manual_seed(4)) + 0.5
    logp = LOGP.clone().requires_grad_()
    loss, _ = policy_loss(logp, None, _exp(is_ratio), spec, float(MASK.sum()), 3.0)
    m, adv, r = MASK.float(), ADV[:, None], (logp - OLD).exp()
    opsm = _trl_off_policy_mask(adv, logp, OLD, m, 0.0)
    trl = ((-torch.min(r * adv, r.clamp(0.8, 1.2) * adv) * opsm * is_ratio) * m).sum() / m.sum()
    torch.testing.assert_close(loss, trl)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(trl, logp)[0])


def test_luspos_spec_sums_each_sequence_and_averages_them():
    spec = policy_loss_spec(load_config(None, ["actor.policy_loss=luspo", "actor.use_kl_loss=false",
                                               "actor.clip_ratio_delta=1.5"]))
    assert (spec.policy_agg, spec.loss_agg, spec.delta) == ("seq-mean-token-sum", "seq-mean-token-sum", 1.5)
    loss, _ = policy_loss(LOGP, None, _exp(), spec, float(MASK.sum()), 3.0)
    torch.testing.assert_close(loss, luspo_loss(LOGP, OLD, ADV, MASK.float(), 0.2, 0.2, delta=1.5)[0])


@pytest.mark.parametrize("overrides, words", [
    (["actor.policy_loss=vespo", "algorithm.rollout_is=sequence"], "set algorithm.rollout_is=token"),
    (["actor.policy_loss=vespo", "actor.clip_ratio_delta=3"], "clip_ratio_delta caps the unclipped ratio term"),
    (["actor.policy_loss=vespo", "actor.vespo_lambda_pos=-1"], "out of range"),
    (["actor.policy_loss=luspo", "actor.clip_ratio_c=3"], "clip_ratio_c"),
])
def test_bad_combinations_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)


def test_one_trainer_step_masks_by_the_rollout_engines_log_probs(tiny_model):
    from alignrl.data.records import ScoredBatch, Scores
    from alignrl.rl.trainer import PolicyTrainer
    from alignrl.runtime.env import SINGLE
    from alignrl.train.actor import Actor
    from alignrl.train.engines import OptimSpec, build_engine
    from test_guards_skipped_steps import _Sink, _experience

    cfg = load_config(None, ["rollout.n=4", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=4",
                             "actor.use_kl_loss=false", "data.train_batch_size=1", "actor.policy_loss=vespo",
                             "actor.off_policy_mask_threshold=0.5"])
    model = copy.deepcopy(tiny_model[0])
    trainer = PolicyTrainer(cfg, Actor(build_engine("single", model, OptimSpec(lr=1e-6, total_steps=10), SINGLE)),
                            _Sink())
    _, ro = _experience(model, tiny_model[1], [1.0, 0.0, 0.0, 1.0])
    scores = Scores(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.bool))

    def step(rollout):
        batch = ScoredBatch(rollout, scores, rollout.response_mask.clone(), None, torch.zeros(4, dtype=torch.long))
        return trainer.train(1, batch)

    # the engine's own log-probs: the recomputed ones agree, no sequence is off-policy
    assert step(ro)["actor/off_policy_masked_frac"] == 0.0
    # an engine one nat more confident than the trainer on every token: both negative-advantage rows leave
    metrics = step(dataclasses.replace(ro, logprobs=ro.logprobs + 1.0))
    assert metrics["actor/off_policy_masked_frac"] == 0.5 and metrics["actor/vespo_phi_mean"] > 0


def test_the_mask_and_vespo_refuse_what_would_change_them_unsaid():
    from alignrl.config import ConfigError, load_config

    for over, words in ((["actor.policy_loss=vespo", "algorithm.rollout_is=token", "algorithm.rollout_is_mode=mask"],
                         "algorithm.rollout_is_mode=mask takes rejected tokens out"),
                        (["actor.policy_loss=vespo", "algorithm.rollout_rs=token"], "algorithm.rollout_rs=token"),
                        (["actor.off_policy_mask_threshold=0.5", "actor.policy_loss=gmpo"], "gmpo's geometric mean"),
                        (["actor.off_policy_mask_threshold=0.5", "algorithm.adv_estimator=gae", "critic.enable=true"],
                         "a critic's per-token advantages")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, over)
    assert load_config(None, ["actor.policy_loss=vespo", "actor.vespo_lambda_pos=0"]).actor.vespo_lambda_pos == 0.0
