"""Micro-batches side by side on a CPU (runtime.lanes): the same update as one at a time, the same every run."""

import copy
import threading

import pytest
import torch

from alignrl.config import load_config
from alignrl.data.records import Experience
from alignrl.models import lora
from alignrl.models.loader import recompute_activations
from alignrl.models.logprobs import ForwardLayout
from alignrl.placements.build import forward_layout
from alignrl.rl.producer import batched_logprobs
from alignrl.runtime import lanes
from alignrl.runtime.env import SINGLE
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.engines import OptimSpec, build_engine

PACKED = ForwardLayout(share_prompt=True, remove_padding=True)


@pytest.fixture
def two_threads():
    """Lanes are taken only where the process has a thread per lane; the test process may have been fitted to one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_lanes_share_the_tokens_evenly_and_never_outnumber_the_micro_batches():
    assert lanes.lanes_of([850, 950, 1000, 1100], 2) == [[0, 3], [1, 2]]  # 1950 tokens each
    assert lanes.lanes_of([5, 5, 5], 2) == [[0, 2], [1]]
    assert lanes.lanes_of([7], 2) == [[0]]
    assert lanes.lanes_of([], 2) == [[]]


def test_lane_count_follows_device_threads_and_distributed_groups(two_threads, monkeypatch):
    assert lanes.lane_count(2, "cpu") == 2
    assert lanes.lane_count(4, "cpu") == 2  # no more lanes than threads
    assert lanes.lane_count(1, "cpu") == 1
    assert lanes.lane_count(2, "cuda") == 1
    torch.set_num_threads(1)
    assert lanes.lane_count(2, "cpu") == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert lanes.lane_count(2, "cpu") == 1  # a rank's collectives must come in one order


def test_run_lanes_gives_each_lane_its_share_of_threads_and_the_callers_grad_mode(two_threads):
    seen = []

    def probe():
        seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
        return len(seen)

    with torch.no_grad():
        out = lanes.run_lanes([probe, probe])
    assert sorted(out) == [1, 2]
    assert {t for _, t, _ in seen} == {1} and {g for _, _, g in seen} == {False}
    assert all(name.startswith("alignrl-lane") for name, _, _ in seen)
    assert torch.get_num_threads() == 2  # the caller keeps its own


def test_an_error_in_one_lane_is_raised_after_the_other_lane_finished(two_threads):
    finished = threading.Event()

    def slow():
        assert not finished.wait(0.2)  # still running when the other lane has failed
        finished.set()
        return 1

    def bad():
        raise ValueError("lane failed")

    with pytest.raises(ValueError, match="lane failed"):
        lanes.run_lanes([bad, slow])
    assert finished.is_set()


def test_lane_sums_add_in_lane_order_and_keep_missing_gradients():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5])
    total = lanes.lane_sums([[a, None, None], [b, None, a]])
    assert torch.equal(total[0], a + b) and total[1] is None and torch.equal(total[2], a)


def _experience(rows=16, vocab=60):
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (4, 6), generator=g)[torch.arange(rows) % 4]
    p_len = torch.tensor([3, 6, 5, 4])[torch.arange(rows) % 4]
    pm = torch.arange(6)[None] >= 6 - p_len[:, None]
    r_len = torch.randint(1, 9, (rows,), generator=g)
    rm = torch.arange(8)[None] < r_len[:, None]
    rid = torch.randint(3, vocab, (rows, 8), generator=g) * rm
    old = -torch.rand(rows, 8, generator=g) * rm
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, 8) * rm
    return Experience(prompts * pm, pm, rid, rm, old, None, adv)


def _update(model, layout, exp):
    actor = Actor(build_engine("single", model, OptimSpec(lr=1e-3, total_steps=10, grad_clip=1.0), SINGLE), layout)
    metrics = actor.update(exp, PolicyLossSpec(), mini_batch=len(exp), micro_batch=4, epochs=1,
                           generator=torch.Generator().manual_seed(0))
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]), metrics


@pytest.mark.parametrize("layout,variant", [(ForwardLayout(), None), (PACKED, None), (PACKED, "recomputed"),
                                            (PACKED, "lora")], ids=["padded", "packed", "packed-recomputed", "packed-lora"])
def test_side_by_side_update_equals_one_at_a_time_and_repeats_exactly(tiny_model, two_threads, layout, variant):
    """`recomputed`: activation checkpointing, whose layers run their forward again inside each lane's backward.
    `lora`: peft adapters (their B matrices drawn, not zero, so that every adapter weight gets a gradient)."""
    model, _ = tiny_model
    recompute = variant == "recomputed"
    if variant is not None:
        model = copy.deepcopy(model)
    if recompute:
        recompute_activations(model)
    if variant == "lora":
        model = lora.add_adapters(model, lora.lora_spec(4))
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    exp = _experience(vocab=model.config.vocab_size)
    ran = []
    real = lanes.run_lanes
    lanes_used = lambda work: ran.append(len(work)) or real(work)  # noqa: E731
    import alignrl.train.minibatch as minibatch

    minibatch.run_lanes = lanes_used
    try:
        one, m_one = _update(copy.deepcopy(model), layout, exp)
        laned = copy.deepcopy(model)
        calls = []
        lora.base_model(laned).model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
        two, m_two = _update(laned, ForwardLayout(layout.share_prompt, layout.remove_padding, 2), exp)
        again, _ = _update(copy.deepcopy(model), ForwardLayout(layout.share_prompt, layout.remove_padding, 2), exp)
    finally:
        minibatch.run_lanes = real
    assert ran == [2, 2]  # the lanes did run, one update each
    # four micro-batches; recomputed, each one's attention ran again inside its lane's backward
    assert len(calls) == (2 if recompute else 1) * len(exp) // 4
    scale = one.abs().max()
    torch.testing.assert_close(two / scale, one / scale, atol=1e-5, rtol=0)
    assert torch.equal(two, again)  # lanes sum in a fixed order: the same bits every run
    assert m_two["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-4)
    assert m_two["actor/ratio_mean"] == pytest.approx(m_one["actor/ratio_mean"], rel=1e-5)  # micro-batch metrics, by share
    # overlapping packed calls restore the model's own (a recomputed model keeps the packed route for good)
    assert model.config._attn_implementation == ("alignrl_packed" if recompute else "sdpa")


def test_side_by_side_reference_log_probs_equal_one_at_a_time(tiny_model, two_threads):
    model, _ = tiny_model
    exp = _experience(vocab=model.config.vocab_size)
    args = (model, exp.prompt_ids, exp.prompt_mask, exp.response_ids, exp.response_mask, 1.0, 4)
    one = batched_logprobs(*args, PACKED)
    two = batched_logprobs(*args, ForwardLayout(True, True, 2))
    torch.testing.assert_close(two, one, atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_cpu_lanes_is_a_trainer_key_that_reaches_the_forward_layout():
    assert forward_layout(load_config(None, [])).lanes == 2
    assert forward_layout(load_config(None, ["trainer.cpu_lanes=1"])).lanes == 1


def test_a_critic_update_side_by_side_equals_one_at_a_time(tiny_model_dir, two_threads, monkeypatch):
    import alignrl.data.collate as collate
    import alignrl.train.minibatch as minibatch
    from alignrl.models.value import load_value_model
    from alignrl.train.critic import Critic

    ran = []
    for module in (collate, minibatch):
        real = module.run_lanes
        monkeypatch.setattr(module, "run_lanes", lambda work, real=real: ran.append(len(work)) or real(work))

    exp = _experience()
    returns = torch.randn(exp.response_ids.shape, generator=torch.Generator().manual_seed(2)) * exp.response_mask
    grads = []
    for lanes_wanted in (1, 2):
        model = load_value_model(str(tiny_model_dir), seed=5, log=lambda *_: None)
        engine = build_engine("single", model, OptimSpec(lr=1e-3, total_steps=10, grad_clip=1.0), SINGLE)
        critic = Critic(engine, cliprange_value=None, remove_padding=True, lanes=lanes_wanted)
        old = critic.values(exp, 4)
        critic.update(exp, old, returns, len(exp), 4, 1, torch.Generator().manual_seed(0))
        grads.append((old, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    assert ran == [1, 2, 2]  # one lane: the values; two: the values, then the update
    (old_one, one), (old_two, two) = grads
    torch.testing.assert_close(old_two, old_one, atol=1e-6, rtol=0)
    scale = one.abs().max()
    torch.testing.assert_close(two / scale, one / scale, atol=1e-5, rtol=0)


def test_a_model_that_draws_dropout_runs_one_micro_batch_at_a_time(tiny_model, two_threads, monkeypatch):
    """Dropout masks come from one random generator: from two lanes their order would follow the threads' timing."""
    import alignrl.train.minibatch as minibatch

    model = copy.deepcopy(tiny_model[0])
    model.config.attention_dropout = 0.1
    ran = []
    real = minibatch.run_lanes
    monkeypatch.setattr(minibatch, "run_lanes", lambda work: ran.append(len(work)) or real(work))
    _update(model, ForwardLayout(True, True, 2), _experience(vocab=model.config.vocab_size))
    assert ran == []
    model.config.attention_dropout = 0.0
    _update(model, ForwardLayout(True, True, 2), _experience(vocab=model.config.vocab_size))
    assert ran == [2]
