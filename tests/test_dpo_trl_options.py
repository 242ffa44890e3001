"""TRL DPOTrainer's reference_free, f_divergence_type (+ f_alpha_divergence_coef), ld_alpha (LD-DPO) and
use_weighting (WPO) in `alignrl train dpo`: hand-worked values of each on tiny tensors, the pair weights in every loss
of TRL's DPOTrainer, one training loss of the tiny model against the same loss built by hand, and mistakes as one
line."""

import math

import pytest
import torch

from alignrl.config import ConfigError

from alignrl.core.dpo_options import (capped_exp, exp_cap, f_divergence_logits, length_desensitised_logps,
                                      wpo_weights)
from alignrl.core.preference import BATCH_SORTED_LOSSES, DPO_LOSSES, dpo_sigmoid_loss, sft_loss
from alignrl.preference.cli import dpo_main, parse_dpo
from alignrl.preference.configs import TRL_DPO_LOSSES

T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


def test_f_divergence_logits_hand_worked():
    # one pair: log u_c = -1 - (-2) = 1, log u_r = -3 - (-2) = -1, so DPO's h = 2
    pc, pr, rc, rr = T(-1.0), T(-3.0), T(-2.0), T(-2.0)
    assert f_divergence_logits(pc, pr, rc, rr, "reverse_kl").item() == pytest.approx(2.0)
    # JS: h - (softplus(1) - softplus(-1)) = 2 - 1, as softplus(x) - softplus(-x) = x
    assert f_divergence_logits(pc, pr, rc, rr, "js_divergence").item() == pytest.approx(1.0)
    # α-divergence: (u_r^-α - u_c^-α)/α = (e^α - e^-α)/α
    assert f_divergence_logits(pc, pr, rc, rr, "alpha_divergence").item() == pytest.approx(math.e - 1 / math.e)
    assert f_divergence_logits(pc, pr, rc, rr, "alpha_divergence", 0.5).item() == pytest.approx(
        (math.exp(0.5) - math.exp(-0.5)) / 0.5, rel=1e-6)
    # reference_free: the reference's zeros; a huge ratio stays finite under the cap (88.7228 in float32)
    assert exp_cap(torch.float32) == pytest.approx(88.7228)
    far = f_divergence_logits(T(0.0), T(-500.0), T(0.0), T(0.0), "alpha_divergence")
    assert torch.isfinite(far).all() and far.item() == pytest.approx(capped_exp(T(500.0)).item() - 1.0, rel=1e-6)
    # the losses of h read the given logits: sigmoid on h = 1 at β = 0.5 is -log σ(0.5)
    loss, _ = dpo_sigmoid_loss(pc, pr, rc, rr, 0.5, h=T(1.0))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5)))


def test_ld_dpo_weighs_the_tokens_past_the_shorter_response():
    # chosen rows 0-1 have 3 and 1 tokens, rejected rows 2-3 have 2 and 2: l_p = 2 for pair 0, 1 for pair 1
    logps = T([-1.0, -2.0, -4.0], [-3.0, 9.0, 9.0], [-1.0, -1.0, 9.0], [-2.0, -6.0, 9.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]).bool()
    got = length_desensitised_logps(logps, mask, 2, 0.5)
    assert got.tolist() == [-1 - 2 + 0.5 * -4, -3.0, -2.0, -2 + 0.5 * -6]
    assert length_desensitised_logps(logps, mask, 2, 1.0).tolist() == (logps * mask).sum(-1).tolist()
    # the same responses padded on the left: a token's place is its rank among the real ones
    left = torch.stack([torch.cat([r[~m], r[m]]) for r, m in zip(logps, mask)])
    assert length_desensitised_logps(left, mask.flip(1), 2, 0.5).tolist() == got.tolist()


def test_wpo_weight_is_the_pairs_probability_relative_to_the_policys_own_sampling():
    from alignrl.preference.pair_logps import _log_sum_sq

    # a chosen token of probability 0.2 where π = (0.8, 0.2): Σπ² = 0.68; a rejected one at π = (0.5, 0.5): w = 0
    lss = _log_sum_sq(torch.log(T([[0.8, 0.2]], [[0.5, 0.5]])))
    assert lss[:, 0].tolist() == pytest.approx([math.log(0.68), math.log(0.5)])
    logps = torch.log(T([0.2], [0.5]))
    w = wpo_weights(logps, lss, torch.ones(2, 1, dtype=torch.bool), 1)
    assert w.item() == pytest.approx(0.2 / 0.68, rel=1e-6)
    # a token mean over the real tokens; the weight is held at most 1 and carries no gradient
    logps = torch.log(T([0.9, 0.1], [0.5, 0.5])).requires_grad_()
    lss = torch.log(T([0.5, 0.5], [0.5, 0.5]))
    w = wpo_weights(logps, lss, torch.tensor([[1, 0], [1, 1]]).bool(), 1)
    assert w.item() == 1.0 and not w.requires_grad


def _pairs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, generator=g) for _ in range(4)]


@pytest.mark.parametrize("name", sorted(n for n in TRL_DPO_LOSSES if n not in BATCH_SORTED_LOSSES))
def test_every_loss_of_trls_dpo_trainer_weighs_each_pair(name):
    pc, pr, rc, rr = _pairs()
    kw = {"nll": T(0.5, 1.0, 2.0), "bco_delta": 0.3}
    weight = T(1.0, 0.5, 0.0)
    fn = DPO_LOSSES[name]
    weighted = fn(pc, pr, rc, rr, 0.7, 3.0, pair_weight=weight, **kw)[0]
    by_pair = sum(w * fn(pc[i:i + 1], pr[i:i + 1], rc[i:i + 1], rr[i:i + 1], 0.7, 3.0, **{
        **kw, "nll": kw["nll"][i:i + 1]})[0] for i, w in enumerate(weight.tolist()))
    assert weighted.item() == pytest.approx(float(by_pair), rel=1e-6)
    assert torch.equal(fn(pc, pr, rc, rr, 0.7, 3.0, pair_weight=torch.ones(3), **kw)[0],
                       fn(pc, pr, rc, rr, 0.7, 3.0, **kw)[0])
    assert sft_loss(pc, pr, rc, rr, 0.7, 3.0, nll=kw["nll"], pair_weight=weight)[0].item() == pytest.approx(1.0 / 3)


def test_one_training_loss_with_all_four_options_is_the_loss_built_by_hand(tiny_model_dir):
    """reference_free, js_divergence, ld_alpha and use_weighting together on the tiny model: no reference model, and
    the loss the trainer takes is WPO's weighted sigmoid loss on JS logits of LD-DPO's log-probs against zeros."""
    from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
    from alignrl.models.loader import load_model
    from alignrl.preference.dpo import _loss_fn, _Reference
    from alignrl.preference.dpo_mix import trl_keywords
    from alignrl.runtime.env import DistEnv

    policy, tok = load_model(str(tiny_model_dir))
    pairs = load_pairs("builtin:helpful", "better", limit=4)
    batch = collate_pairs(encode_pairs(tok, pairs, 128)[0], pairs, tok.pad_token_id)
    cfg = parse_dpo([f"model_path={tiny_model_dir}", "loss_type=sigmoid", "beta=0.3", "bf16=false",
                     "reference_free=true", "f_divergence_type=js_divergence", "ld_alpha=0.25", "use_weighting=true",
                     "nll_loss_coef=0.5"])
    assert trl_keywords(parse_dpo(["loss_type=sigmoid"]), "sigmoid", *_pairs(), None) == {}  # defaults: as before
    ref = _Reference(cfg, policy, DistEnv(), False)
    assert ref.free and ref.model is None
    policy.eval()
    loss, metrics = _loss_fn(cfg, DistEnv(), ref, None, None)(policy, batch, 4.0)
    with torch.no_grad():
        ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
        from alignrl.data.collate import position_ids

        r = batch.response_ids.shape[1]
        logits = policy(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
        lsm = torch.log_softmax(logits[:, -r - 1:-1].float(), -1)
        tok_lp = lsm.gather(-1, batch.response_ids[..., None]).squeeze(-1)
        m = batch.response_mask
        n = m.sum(-1)
        assert len(set(n.tolist())) > 1  # responses of several lengths: LD-DPO changes something
        lp = length_desensitised_logps(tok_lp, m, 4, 0.25)
        adjusted = ((tok_lp - torch.logsumexp(2 * lsm, -1)) * m).sum(-1) / n
        w = torch.exp(adjusted[:4] + adjusted[4:]).clamp(max=1.0)
        h = (lp[:4] - lp[4:]) - (torch.nn.functional.softplus(lp[:4]) - torch.nn.functional.softplus(lp[4:]))
        nll = -(tok_lp[:4] * m[:4]).sum(-1) / n[:4]
        by_hand = ((-torch.nn.functional.logsigmoid(0.3 * h) + 0.5 * nll) * w).sum() / 4.0
    assert 0.0 < float(w.min()) < 1.0  # the weights change the loss
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-4)
    assert metrics["rewards/chosen"] == pytest.approx(float(0.3 * lp[:4].mean()), rel=1e-4)


@pytest.mark.parametrize("argv, expect", [
    (["reference_free=true", "kl_coeff=0.1"], "reference_free=true loads no reference model, so kl_coeff=0.1"),
    (["reference_free=true", "ref_model_path=x"], "reference_free=true loads no reference model, so ref_model_path"),
    (["f_divergence_type=js_divergence", "loss_type=nca_pair"], "loss_type=nca_pair reads none of them"),
    (["f_divergence_type=alpha_divergence", "loss_type=[apo_zero,sft]"], "reads none of them"),
    (["f_divergence_type=kl"], "f_divergence_type"),
    (["f_alpha_divergence_coef=0.5"], "is read only with f_divergence_type=alpha_divergence"),
    (["f_divergence_type=alpha_divergence", "f_alpha_divergence_coef=0"], "f_alpha_divergence_coef"),
    (["ld_alpha=1.5"], "ld_alpha"),
    (["ld_alpha=0.5", "loss_type=simpo"], "ld_alpha=0.5 is TRL's DPOTrainer's"),
    (["ld_alpha=0.5", "loss_type=ipo_token_mean"], "loss_type ipo_token_mean reads token means"),
    (["ld_alpha=0.5", "logp_reduction=sequence_mean"], "logp_reduction=sequence_mean reads token means"),
    (["use_weighting=true", "loss_type=safe_mm_dpo"], "use_weighting=true is TRL's DPOTrainer's"),
    (["use_weighting=true", "loss_type=[simpo,sft]"], "loss_type=[simpo,sft] is not one"),
    (["use_weighting=true", "logp_reduction=sequence_mean"], "use_weighting=true reads the responses' token"),
])
def test_mistakes_are_one_line(argv, expect, capsys):
    assert dpo_main(["loss_type=sigmoid", *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1 and "Traceback" not in err


def test_trls_flags_are_keys():
    cfg = parse_dpo(["--reference_free", "--f_divergence_type", "js_divergence", "--ld_alpha", "0.3",
                     "--use_weighting", "--loss_type", "sigmoid"])
    assert (cfg.reference_free, cfg.f_divergence_type, cfg.ld_alpha, cfg.use_weighting) == \
        (True, "js_divergence", 0.3, True)
    cfg = parse_dpo(["--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef", "0.5", "--loss_type",
                     "sigmoid"])
    assert (cfg.f_divergence_type, cfg.f_alpha_divergence_coef) == ("alpha_divergence", 0.5)
    with pytest.raises(ConfigError, match="reference_free=true with f_divergence_type=alpha_divergence"):
        parse_dpo(["--reference_free", "--f_divergence_type", "alpha_divergence", "--loss_type", "sigmoid"])
    assert parse_dpo(["--reference_free", "--f_divergence_type", "alpha_divergence", "--loss_type",
                      "ipo_token_mean"]).reference_free
    plain = parse_dpo(["loss_type=sigmoid"])
    assert (plain.reference_free, plain.f_divergence_type, plain.f_alpha_divergence_coef, plain.ld_alpha,
            plain.use_weighting) == (False, "reverse_kl", 1.0, None, False)


def test_ld_dpo_leaves_the_nll_terms_log_probs_whole(tiny_model_dir):
    """LD-DPO down-weights the longer response's tail in the preference term only: the NLL (RPO) term reads the
    chosen response's plain log-probs, as TRL's cross-entropy does."""
    import dataclasses

    from alignrl.data.preference import collate_pairs, encode_pairs, load_pairs
    from alignrl.models.loader import load_model
    from alignrl.preference.pair_logps import policy_logps

    policy, tok = load_model(str(tiny_model_dir))
    pairs = [dataclasses.replace(p, chosen=p.chosen + " and much more besides, at length.")
             for p in load_pairs("builtin:helpful", "better", limit=4)]  # each chosen response the longer one
    batch = collate_pairs(encode_pairs(tok, pairs, 128)[0], pairs, tok.pad_token_id)
    n = batch.response_mask.sum(-1)
    assert bool((n[:4] > n[4:]).all())
    with torch.no_grad():
        plain, _, _, _, whole = policy_logps(policy, batch)
        ld, _, _, _, whole_ld = policy_logps(policy, batch, ld_alpha=0.25)
    assert not torch.allclose(ld, plain)  # LD-DPO shortens the longer chosen responses' sums
    assert torch.allclose(whole, plain) and torch.allclose(whole_ld, plain)  # the NLL term's stay whole
