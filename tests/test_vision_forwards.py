"""Forwards of a tiny Qwen2-VL model over prompts with images: the engine's log-probs equal the trainer's, packing
and prompt sharing leave image rows to the plain forward, text forwards run the encoder where ranks share the model,
a critic reads the images, a reference that cannot is one line, cached decoding equals uncached, responses never hold
image placeholders, and a multi-turn episode scores as the trainer recomputes. Data layouts are in test_vision.py."""

import pytest
import torch

from alignrl.data.images import ImageRows
from alignrl.data.loaders import load_samples
from visionrows import lmm_r1_row, vl_rollout, write_jsonl


def test_engine_logprobs_are_the_trainers(vl, pictures, tmp_path):
    """The cached decode (M-RoPE deltas on generated tokens) gives the log-probs of the one-pass forward the trainer
    recomputes, to 1e-4 in fp32 (measured: about 5e-7); image tokens whose images are left out are refused."""
    from alignrl.rl.producer import batched_logprobs

    model, _ = vl
    ro = vl_rollout(vl, pictures, tmp_path)
    assert [r is None for r in ro.images.rows] == [False] * 6 + [True] * 3
    args = (model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 2)
    recomputed = batched_logprobs(*args, images=ro.images)
    assert (recomputed - ro.logprobs).abs().max() < 1e-4
    text_rows = ImageRows([None] * 6 + ro.images.rows[6:])  # the image rows' pictures left out
    from alignrl.models.folder import ModelError

    with pytest.raises(ModelError, match="image tokens"):
        batched_logprobs(*args, images=text_rows)
    with pytest.raises(ModelError, match="image tokens but no images came with them"):
        batched_logprobs(*args)


def test_multimodal_batches_skip_packing_and_prompt_sharing_and_refuse_text_only_critics(vl, pictures, tmp_path,
                                                                                         tiny_model_dir):
    """use_remove_padding (set by verl's vision-language scripts) and prompt sharing are speed-ups for text: rows with
    images take the plain forward and get its log-probs."""
    from alignrl.models.folder import ModelError
    from alignrl.models.logprobs import ForwardLayout, response_logprobs
    from alignrl.models.value import load_value_model, response_values

    model, _ = vl
    ro = vl_rollout(vl, pictures, tmp_path, n=1)
    tensors = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    plain, _ = response_logprobs(model, *tensors, images=ro.images)
    packed, _ = response_logprobs(model, *tensors, layout=ForwardLayout(remove_padding=True), images=ro.images)
    assert torch.equal(packed, plain)
    for layout in (ForwardLayout(share_prompt=True), ForwardLayout(share_prompt=True, remove_padding=True)):
        assert torch.equal(response_logprobs(model, *tensors, layout=layout, images=ro.images)[0], plain)
    with pytest.raises(ModelError, match="critic is a text-only model but the prompts carry images: set "
                                         "critic.model_path"):
        response_values(load_value_model(str(tiny_model_dir), log=lambda *_: None), *tensors, images=ro.images)


def test_shared_prompts_of_a_vision_language_model_over_ranks_take_the_plain_forward(vl, tiny_model, monkeypatch):
    """The shared-prompt forward makes two model calls, the plain one one: where several ranks hold a vision-language
    model, one rank's image micro-batch (plain) and another's text micro-batch (shared) would pair their collectives
    wrongly, so every micro-batch takes the plain forward there; a text-only model and one process still share."""
    from alignrl.models import logprobs
    from alignrl.models.logprobs import ForwardLayout

    shared = ForwardLayout(share_prompt=True)
    assert logprobs.shares_prompts(vl[0], shared, with_images=False)
    assert not logprobs.shares_prompts(vl[0], shared, with_images=True)
    monkeypatch.setattr(logprobs, "ranks_share_model", lambda: True)
    assert not logprobs.shares_prompts(vl[0], shared, with_images=False)
    assert logprobs.shares_prompts(tiny_model[0], shared, with_images=False)


def test_text_forwards_run_the_encoder_when_ranks_share_the_model_or_it_trains(vl, pictures, tmp_path, monkeypatch):
    """A text-only forward (plain or packed) runs the image encoder once on a blank patch when several ranks hold the
    model, as another rank's image micro-batch runs it, so DDP/FSDP2/ZeRO-3 collectives pair up (test_vision_sharded_ref
    runs the ranks), and in one process when a gradient goes through a trainable encoder, so AdamW sees a zero
    gradient as it does over ranks. Log-probs stay bit-equal and the encoder's gradient is zero, not absent; a forward
    with images runs it only for them; a frozen encoder in one process, or a forward without gradient, not at all."""
    from alignrl.models import vision
    from alignrl.models.logprobs import ForwardLayout, response_logprobs

    model, _ = vl
    ro = vl_rollout(vl, pictures, tmp_path, n=1)
    text = [i for i, r in enumerate(ro.images.rows) if r is None]
    tensors = tuple(t[text] for t in (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask))
    layouts = [ForwardLayout(remove_padding=p) for p in (False, True)]
    runs, visual = [], model.model.visual
    hook = visual.register_forward_hook(lambda *_: runs.append(1))
    try:
        with torch.no_grad():
            alone = [response_logprobs(model, *tensors, layout=layout)[0] for layout in layouts]
        visual.requires_grad_(False)
        frozen = [response_logprobs(model, *tensors, layout=layout)[0] for layout in layouts]
        visual.requires_grad_(True)
        assert not runs and all(torch.equal(a, b) for a, b in zip(alone, frozen))
        for layout, want in zip(layouts, alone):  # one process, gradient through the trainable encoder
            model.zero_grad(set_to_none=True)
            got, _ = response_logprobs(model, *tensors, layout=layout)
            assert torch.equal(got, want)
            got.sum().backward()
            assert all(p.grad is not None and not p.grad.any() for p in visual.parameters()), layout
        assert len(runs) == 2
        monkeypatch.setattr(vision, "ranks_share_model", lambda: True)
        with torch.no_grad():  # ranks sharing the model: also without a gradient (ZeRO-3's and FSDP2's gathers)
            assert all(torch.equal(response_logprobs(model, *tensors, layout=layout)[0], want)
                       for layout, want in zip(layouts, alone))
            assert len(runs) == 4
            response_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                              images=ro.images)
        assert len(runs) == 5  # the images' own run only
    finally:
        hook.remove()
        visual.requires_grad_(True)
        model.zero_grad(set_to_none=True)


def test_a_vision_value_model_reads_the_images_and_saves_as_a_plain_folder(vl_dir, vl, pictures, tmp_path):
    """The critic of a VL policy: its backbone (vision tower included) is the policy's, its head is new and seeded;
    its values follow the picture; gradients reach the vision tower; saved and loaded back, it gives the same
    values; asked to pack, it takes the plain forward for rows with images."""
    from transformers import AutoModelForTokenClassification

    from alignrl.models.value import load_value_model, response_values

    policy, _ = vl
    critic = load_value_model(str(vl_dir), seed=1, log=lambda *_: None)
    assert type(critic).__name__ == "Qwen2VLForTokenClassification"
    backbone = {k: v for k, v in critic.state_dict().items() if k.startswith("model.")}
    assert backbone and all(torch.equal(v, policy.state_dict()[k]) for k, v in backbone.items())
    assert any(k.startswith("model.visual.") for k in backbone)
    assert torch.equal(critic.score.weight, load_value_model(str(vl_dir), seed=1, log=lambda *_: None).score.weight)
    ro = vl_rollout(vl, pictures, tmp_path, n=2)  # 2 red, 2 blue, 2 text rows
    tensors = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    values = response_values(critic, *tensors, images=ro.images)
    assert values.shape == ro.response_mask.shape and torch.isfinite(values).all()
    assert ((values != 0) == ro.response_mask.bool()).all()
    rows = ro.images.rows
    swapped = ImageRows([rows[2], rows[3], rows[0], rows[1]] + rows[4:])
    other = response_values(critic, *tensors, images=swapped)  # the red rows see blue, the blue rows red
    assert not torch.allclose(other[:4], values[:4]) and torch.equal(other[4:], values[4:])
    (values * ro.response_mask).sum().backward()
    assert critic.score.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in critic.named_parameters() if ".visual." in n)
    critic.save_pretrained(tmp_path / "critic")
    again = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    assert torch.allclose(response_values(again, *tensors, images=ro.images), values.detach(), atol=1e-6)
    assert torch.equal(response_values(critic, *tensors, remove_padding=True, images=ro.images), values.detach())


def test_a_reference_that_cannot_read_images_is_one_line(vl, pictures, tmp_path):
    from alignrl.models.folder import ModelError
    from alignrl.rl.producer import LocalRefScorer, RolloutMaker

    class TextOnlyRef:  # the shape of the HTTP and Ray reference clients
        def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask):
            raise AssertionError("called without the images")

    ro = vl_rollout(vl, pictures, tmp_path, n=1)
    with pytest.raises(ModelError, match=r"the reference \(TextOnlyRef\) cannot read prompts with images"):
        RolloutMaker(None, None, None, TextOnlyRef()).ref_logprobs(ro, None)
    local = RolloutMaker(None, None, None, LocalRefScorer(vl[0], 1.0, 4)).ref_logprobs(ro, None)
    assert (local - ro.logprobs).abs().max() < 1e-4  # the same (untrained) model: the engine's own log-probs


def test_cached_greedy_decode_is_the_uncached_one(vl, pictures, tmp_path):
    """The engine's KV-cached greedy tokens (prefill with the images, then M-RoPE deltas) are those of re-running the
    whole prompt+response through the model for every token."""
    from alignrl.data.collate import encode_prompts
    from alignrl.data.images import ImageRows
    from alignrl.interfaces import SamplingParams
    from alignrl.models.vision import vision_inputs
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tok = vl
    rows = [lmm_r1_row(pictures["yellow"], "Describe it."), lmm_r1_row(pictures["blue"], "Which color?")]
    samples = load_samples(str(write_jsonl(tmp_path / "g.jsonl", rows)), prompt_key="message", label_key="answer")
    prompts = encode_prompts(tok, samples, 64)
    ro = HFRolloutEngine(model, tok, eos_token_ids=[-1]).generate(prompts, SamplingParams(temperature=0.0,
                                                                                          max_new_tokens=8))
    for i, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(8):
            x = torch.tensor([ids])
            mask = torch.ones_like(x, dtype=torch.bool)
            with torch.no_grad():
                logits = model(input_ids=x, attention_mask=mask.long(),
                               **vision_inputs(model, x, mask, ImageRows([prompt.images]))).logits
            ids.append(int(logits[0, -1].argmax()))
        assert ro.response_ids[i].tolist() == ids[len(prompt):]


def test_responses_never_hold_image_placeholders(vl, tiny_model):
    """A vision model's image, video and vision-marker tokens are never sampled into a response (the next forward
    would count more image tokens than images); the reported log-prob stays the model's own."""
    from alignrl.interfaces import SamplingParams
    from alignrl.models.vision import vision_token_ids
    from alignrl.rollout.hf_engine import sample_next

    model, tok = vl
    banned = vision_token_ids(model)
    assert len(banned) == 4 and tok.convert_tokens_to_ids("<|image_pad|>") in banned
    assert vision_token_ids(tiny_model[0]) == []  # a text model bans nothing
    logits = torch.zeros(64, 10)
    logits[:, 3] = 5.0  # the banned token is by far the likeliest
    ban = torch.tensor([3])
    greedy, lp = sample_next(logits, SamplingParams(n=1, temperature=0.0), None, ban)
    assert (greedy != 3).all() and torch.allclose(lp, torch.log_softmax(logits, -1)[:, 0])
    drawn, lp = sample_next(logits, SamplingParams(n=1, temperature=1.0), torch.Generator().manual_seed(0), ban)
    assert (drawn != 3).all()
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, drawn[:, None]).squeeze(-1))


def test_a_multi_turn_episode_over_image_prompts_scores_as_the_trainer_recomputes(vl, pictures, tmp_path):
    """The agent loop hands each turn's engine call the prompt's images, and the rollout carries them: the engine's
    log-probs of every generated token (after observations too) equal the trainer's recomputed ones."""
    from alignrl.data.collate import encode_prompts
    from alignrl.interfaces import SamplingParams
    from alignrl.rl.producer import batched_logprobs
    from alignrl.rollout.agent import AgentRollout
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tok = vl
    rows = [lmm_r1_row(pictures["red"], "What is 2+3?"), lmm_r1_row(pictures["blue"], "Which color is this?")]
    samples = load_samples(str(write_jsonl(tmp_path / "r.jsonl", rows)), prompt_key="message", label_key="answer")
    agent = AgentRollout(HFRolloutEngine(model, tok, eos_token_ids=[-1]), tok, None, max_turns=2, max_obs_length=16)
    ro = agent.generate(encode_prompts(tok, samples, 96), SamplingParams(n=2, temperature=1.0, max_new_tokens=6,
                                                                         seed=5))
    assert ro.images is not None and all(r is not None for r in ro.images.rows)
    assert ro.stats["turns"].max() >= 2 and not bool(ro.loss_mask.all())  # observations between turns
    recomputed = batched_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask, 1.0, 2,
                                  images=ro.images)
    assert (recomputed - ro.logprobs)[ro.loss_mask].abs().max() < 1e-4
