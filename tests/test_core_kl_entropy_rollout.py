"""KL reward penalty and controllers, chunked entropy, rollout/trainer correction: hand-worked values."""

import math

import pytest
import torch

import alignrl.core.entropy as entropy_mod
from alignrl.core.entropy import entropy_from_logits
from alignrl.core.kl import AdaptiveKLController, FixedKLController, kl_penalty_rewards
from alignrl.core.losses import kl_k3
from alignrl.core.rollout_correction import rollout_kl, truncated_is_weights

# ---------------------------------------------------------------- KL penalty in the reward


def test_kl_penalty_rewards_hand_worked():
    # k1 = logp - ref = 0.5, 0, -0.5; third token of row 0 is masked (keeps its reward untouched)
    # row 0 rewards (0, 0, 1) - 0.1 * (0.5, 0, [masked]) = (-0.05, 0, 1)
    # metric: per-sequence token mean of KL = (0.5 + 0) / 2 = 0.25 (one sequence)
    r = torch.tensor([[0.0, 0.0, 1.0]])
    logp, ref = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.5, -1.0, -0.5]])
    out, m = kl_penalty_rewards(r, logp, ref, torch.tensor([[1, 1, 0]]), 0.1, "k1")
    assert torch.allclose(out, torch.tensor([[-0.05, 0.0, 1.0]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.25) and m["actor/reward_kl_penalty_coeff"] == 0.1
    # all tokens counted, k3: (e^-0.5 + 0.5 - 1, 0, e^0.5 - 0.5 - 1) = (0.10653, 0, 0.14872)
    out3, _ = kl_penalty_rewards(r, logp, ref, torch.ones(1, 3), 1.0, "k3")
    k3 = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(0.5) - 0.5 - 1]
    assert torch.allclose(out3, torch.tensor([[-k3[0], 0.0, 1 - k3[2]]]))
    assert not out3.requires_grad
    # k3 in the reward penalty is clamped at 10 as verl's low_var_kl: d = ref - logp = 5 gives
    # e^5 - 6 = 142.4 unclamped; the reward is 1 - 0.1 * 10 = 0 instead of 1 - 14.24
    out_c, m_c = kl_penalty_rewards(torch.ones(1, 1), torch.zeros(1, 1), torch.full((1, 1), 5.0),
                                    torch.ones(1, 1), 0.1, "low_var_kl")
    assert out_c.item() == pytest.approx(0.0) and m_c["actor/reward_kl_penalty"] == pytest.approx(10.0)


def test_adaptive_kl_controller_hand_worked():
    # KL 9 vs target 6: error 9/6 - 1 = 0.5, clipped to 0.2; 256 steps over horizon 10000
    # -> beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512 = 0.100512
    c = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    c.update(9.0, 256)
    assert c.value == pytest.approx(0.100512)
    # KL 5.4: error 5.4/6 - 1 = -0.1 (inside the clip) -> 0.100512 * (1 - 0.1 * 256 / 10000) = 0.100512 * 0.99744
    c.update(5.4, 256)
    assert c.value == pytest.approx(0.100512 * 0.99744)
    f = FixedKLController(0.05)
    f.update(100.0, 1000)
    assert f.value == 0.05
    restored = AdaptiveKLController(1.0, 6.0, 10000)
    restored.load_state_dict(c.state_dict())  # a resumed run continues from the saved coefficient
    assert restored.value == c.value
    late = AdaptiveKLController(0.3, 6.0, 10000)
    late.load_state_dict(None)  # the penalty turned on at the resume: it starts from its own coefficient
    assert late.value == 0.3
    changed = FixedKLController(0.2)
    changed.load_state_dict(f.state_dict())  # a fixed coefficient changed at the resume is the new one
    assert changed.value == 0.2


# ---------------------------------------------------------------- chunked entropy

def test_entropy_hand_worked():
    # uniform over 4 -> log 4; softmax(0, log 3) = (0.25, 0.75) -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    # a near-one-hot row -> ~0
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4], [100.0, 0.0, 0.0, 0.0]])
    h = entropy_from_logits(logits, chunk=2)
    assert torch.allclose(h, torch.tensor([math.log(4.0), 0.562335, 0.0]), atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_categorical_with_grad(chunk, dtype):
    torch.manual_seed(0)
    x = (3 * torch.randn(7, 11)).to(dtype).requires_grad_()
    h = entropy_from_logits(x, chunk=chunk)
    assert h.dtype == torch.float32 and h.shape == (7,)
    ref = torch.distributions.Categorical(logits=x.float()).entropy()
    assert torch.allclose(h, ref, atol=1e-5)
    w = torch.randn(7)
    (g,) = torch.autograd.grad((h * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    assert torch.allclose(g.float(), g_ref.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_entropy_upcasts_at_most_chunk_rows(monkeypatch):
    seen = []
    real = entropy_mod._entropy_rows

    def spy(rows):
        seen.append(rows.shape[0])
        return real(rows)

    monkeypatch.setattr(entropy_mod, "_entropy_rows", spy)
    x = torch.randn(2, 5, 13, dtype=torch.bfloat16, requires_grad=True)
    h = entropy_from_logits(x, chunk=4)
    h.sum().backward()  # backward recomputes each chunk: still at most 4 rows at a time
    assert h.shape == (2, 5) and max(seen) == 4 and sum(seen) >= 10
    assert entropy_from_logits(torch.zeros(0, 5)).shape == (0,)


# ---------------------------------------------------------------- rollout correction

def test_rollout_kl_hand_worked():
    # p_rollout = 0.5, p_trainer = 0.25 on the counted token; second token masked
    # k1 = log 0.5 - log 0.25 = log 2; k3 with d = log q - log p = -log 2: 0.5 + log 2 - 1 = 0.193147
    ro = torch.tensor([[math.log(0.5), 0.0]])
    tr = torch.tensor([[math.log(0.25), -30.0]])
    mask = torch.tensor([[1, 0]])
    assert rollout_kl(ro, tr, mask, "k1").item() == pytest.approx(math.log(2))
    assert rollout_kl(ro, tr, mask).item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert rollout_kl(ro, tr, mask).item() == pytest.approx(kl_k3(ro, tr)[0, 0].item())


def test_truncated_is_weights_hand_worked():
    # token ratios trainer/rollout = 3, 0.5, 1.5 (the 4th token is padding)
    tr = torch.log(torch.tensor([[3.0, 0.5, 1.5, 9.0]]))
    ro = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    # token, truncate at 2: (2, 0.5, 1.5, 0); 1 of 3 tokens over the threshold; mean (2 + 0.5 + 1.5) / 3 = 4/3
    w, keep, m = truncated_is_weights(tr, ro, mask, "token", 2.0, "truncate")
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.5, 0.0]])) and torch.equal(keep, mask.bool())
    assert m["rollout/is_truncated_frac"] == pytest.approx(1 / 3)
    assert m["rollout/is_raw_weight_max"] == pytest.approx(3.0)
    assert m["rollout/is_weight_mean"] == pytest.approx(4 / 3)
    # token, mask within [1/2, 2]: the token at 3 leaves the mask, 0.5 stays (the bound is inclusive)
    w, keep, m = truncated_is_weights(tr, ro, mask, "token", 2.0, "mask")
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.5, 0.0]]))
    assert keep.tolist() == [[False, True, True, False]] and m["rollout/is_masked_frac"] == pytest.approx(1 / 3)
    assert m["rollout/is_weight_mean"] == pytest.approx(1.0)  # over the kept tokens
    # truncation with a lower bound clamps into [0.6, 2] (OpenRLHF's tis): 0.5 is raised, every token kept
    w, keep, m = truncated_is_weights(tr, ro, mask, "token", 2.0, "truncate", lower=0.6)
    assert torch.allclose(w, torch.tensor([[2.0, 0.6, 1.5, 0.0]])) and torch.equal(keep, mask.bool())
    assert m["rollout/is_truncated_frac"] == pytest.approx(2 / 3)
    # geo_mask (OpenRLHF's seq-mask-tis): the geometric mean (3 * 0.5 * 1.5)^(1/3) = 1.31 lies inside [0.5, 2], so the
    # sequence stays with its own token weights; inside [0.5, 1.2] it leaves whole, counted once
    w, keep, m = truncated_is_weights(tr, ro, mask, "token", 2.0, "geo_mask", lower=0.5)
    assert torch.allclose(w, torch.tensor([[3.0, 0.5, 1.5, 0.0]])) and torch.equal(keep, mask.bool())
    assert m["rollout/is_masked_frac"] == 0.0 and m["rollout/is_raw_weight_max"] == pytest.approx(3.0)
    w, keep, m = truncated_is_weights(torch.cat([tr, torch.zeros(1, 4)]), torch.zeros(2, 4), mask.repeat(2, 1),
                                      "token", 1.2, "geo_mask", lower=0.5)
    assert keep.tolist() == [[False] * 4, [True, True, True, False]] and m["rollout/is_masked_frac"] == 0.5
    with pytest.raises(ValueError, match="geo_mask at token level"):
        truncated_is_weights(tr, ro, mask, "sequence", 2.0, "geo_mask")
    # a lower bound of 0.6 rejects 0.5 too
    _, keep, m = truncated_is_weights(tr, ro, mask, "token", 2.0, "mask", lower=0.6)
    assert keep.tolist() == [[False, False, True, False]] and m["rollout/is_masked_frac"] == pytest.approx(2 / 3)
    # sequence: product 3 * 0.5 * 1.5 = 2.25 -> truncate to 2 on every token, mask -> the sequence leaves,
    # threshold 3 -> 2.25
    w, _, m = truncated_is_weights(tr, ro, mask, "sequence", 2.0, "truncate")
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0, 0.0]])) and m["rollout/is_truncated_frac"] == 1.0
    w, keep, _ = truncated_is_weights(tr, ro, mask, "sequence", 2.0, "mask")
    assert torch.equal(w, torch.zeros(1, 4)) and not keep.any()
    w, _, _ = truncated_is_weights(tr, ro, mask, "sequence", 3.0, "truncate")
    assert torch.allclose(w, torch.tensor([[2.25, 2.25, 2.25, 0.0]]))
    with pytest.raises(ValueError):
        truncated_is_weights(tr, ro, mask, "seq")


def test_rejected_tokens_leave_the_token_count():
    """verl's rollout_is_mode=mask rejects through the loss mask: 4 tokens, one at ratio 3, advantage 1 gives
    the token-mean loss -1 over the 3 kept tokens, not -3/4 with the rejected one still counted."""
    from alignrl.core.aggregation import token_mean

    tr = torch.log(torch.tensor([[1.0, 1.0, 3.0, 1.0]]))
    w, keep, _ = truncated_is_weights(tr, torch.zeros(1, 4), torch.ones(1, 4), "token", 2.0, "mask")
    assert token_mean(-w, keep.float()).item() == pytest.approx(-1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_is_weights_finite_and_constant(level, mode):
    tr = torch.tensor([[500.0, 1e4, -1e4], [300.0, 300.0, 300.0]], requires_grad=True)
    w, _, m = truncated_is_weights(tr, torch.zeros(2, 3), torch.ones(2, 3), level, 2.0, mode)
    assert torch.isfinite(w).all() and (w <= 2.0).all() and not w.requires_grad
    assert all(math.isfinite(v) for v in m.values())
