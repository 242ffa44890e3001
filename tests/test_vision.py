"""Prompts with images through the one loop, on a tiny Qwen2-VL model built from a seed: the tiny model, the data
layouts users bring (LMM-R1, verl, TRL, OpenRLHF 0.10), their one-line errors, truncation that never cuts an
image's tokens, engine log-probs that the trainer recomputes, a critic that reads the images, and the wire round trip.
The training runs on images are in test_vision_training.py."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from alignrl.data.images import ImageDataError, ImagePrompt, ImageRows, truncate_outside_images
from alignrl.data.loaders import load_samples
from visionrows import lmm_r1_row, save_pictures, write_jsonl


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    from alignrl.models.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("vl") / "tiny-vl", seed=0)


@pytest.fixture(scope="module")
def vl(vl_dir):
    from alignrl.models.loader import load_model

    return load_model(str(vl_dir))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    return save_pictures(tmp_path_factory.mktemp("pictures"))


def image_tokens(tokenizer, ids) -> int:
    return sum(t == tokenizer.convert_tokens_to_ids("<|image_pad|>") for t in ids)


def test_tiny_vl_is_deterministic_and_small(vl_dir, tmp_path, vl):
    from alignrl.models.tiny_vl import build_tiny_vl

    again = build_tiny_vl(tmp_path / "again", seed=0)
    other = build_tiny_vl(tmp_path / "other", seed=1)
    weights = lambda d: (d / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(again) == weights(vl_dir) and weights(other) != weights(vl_dir)
    cfg = json.loads((vl_dir / "processor_config.json").read_text())
    assert cfg["processor_class"] == "Qwen2VLProcessor"
    model, tok = vl
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    processor = tok.alignrl_processor
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    enc = processor(text=[text], images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    assert image_tokens(tok, enc["input_ids"][0].tolist()) == 4 and enc["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert enc["pixel_values"].shape == (16, 3 * 2 * 14 * 14)


def test_autoprocessor_loads_the_folder_where_torchvision_is(vl_dir):
    pytest.importorskip("torchvision")  # transformers builds Qwen2-VL's video processor with it
    from transformers import AutoProcessor

    assert AutoProcessor.from_pretrained(str(vl_dir)).image_token == "<|image_pad|>"


def test_layouts_load_with_their_images(tmp_path, pictures, vl):
    _, tok = vl
    from alignrl.data.collate import encode_prompts

    red, blue = str(pictures["red"]), str(pictures["blue"])
    # (a) LMM-R1: a JSON string of messages with file:// image items
    a = load_samples(str(write_jsonl(tmp_path / "a.jsonl", [lmm_r1_row(pictures["red"], "Which color?")])),
                     prompt_key="message", label_key="answer")
    # (b) verl (geo3k): images column of {bytes} and <image> in the prompt's text
    import pyarrow as pa
    import pyarrow.parquet as pq

    verl = [{"prompt": [{"role": "user", "content": "<image>Which color? <image> and this one?"}],
             "images": [{"bytes": pictures["red"].read_bytes()}, {"bytes": pictures["blue"].read_bytes()}],
             "data_source": "math", "reward_model": {"style": "rule", "ground_truth": "red"}}]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "b.parquet")
    b = load_samples(str(tmp_path / "b.parquet"))
    # (c) TRL: images beside a prompt without placeholders
    c = load_samples(str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Which color?", "images": [red],
                                                             "solution": "red"}])),
                     prompt_key="prompt", label_key="solution")
    # (d) OpenRLHF 0.10: bare image items filled from the images list
    d_row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}],
             "images": [blue], "label": "blue"}
    d = load_samples(str(write_jsonl(tmp_path / "d.jsonl", [d_row])), prompt_key="prompt", label_key="label")
    assert a[0].images == (red,) and c[0].images == (red,) and d[0].images == (blue,)
    assert len(b[0].images) == 2 and all(isinstance(x, bytes) for x in b[0].images)
    assert b[0].messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Which color? "},
                                           {"type": "image"}, {"type": "text", "text": " and this one?"}]
    assert c[0].messages[0]["content"][0] == {"type": "image"}
    for samples, n_images in ((a, 1), (b, 2), (c, 1), (d, 1)):
        ids = encode_prompts(tok, samples, 256)[0]
        assert isinstance(ids, ImagePrompt) and image_tokens(tok, ids) == 4 * n_images
        assert ids.images.image_grid_thw.shape == (n_images, 3)


def test_bad_image_input_is_one_line(tmp_path, pictures, vl, tiny_model_dir):
    from alignrl.config import load_config
    from alignrl.data.collate import encode_prompts
    from alignrl.data.prompts import load_task_data
    from alignrl.models.folder import load_tokenizer

    _, tok = vl
    missing = write_jsonl(tmp_path / "m.jsonl", [lmm_r1_row(tmp_path / "nowhere.png", "x")])
    with pytest.raises(ImageDataError, match=r"m.jsonl:1: image file not found: .*nowhere.png") as exc:
        load_samples(str(missing), prompt_key="message", label_key="answer")
    assert "\n" not in str(exc.value)
    (tmp_path / "broken.png").write_bytes(b"not a picture")
    broken = load_samples(str(write_jsonl(tmp_path / "b.jsonl", [lmm_r1_row(tmp_path / "broken.png", "x")])),
                          prompt_key="message", label_key="answer")
    with pytest.raises(ImageDataError, match=r"b.jsonl:1: the image .*broken.png cannot be decoded"):
        encode_prompts(tok, broken, 64)
    good = write_jsonl(tmp_path / "g.jsonl", [lmm_r1_row(pictures["red"], "x")])
    cfg = load_config(None, [f"data.train_files={good}", f"data.val_files={good}", "data.prompt_key=message",
                             "data.label_key=answer", f"model.path={tiny_model_dir}"])
    with pytest.raises(ImageDataError, match="model.path is a text-only model; use a vision-language model"):
        load_task_data(cfg, load_tokenizer(tiny_model_dir))
    samples = load_samples(str(good), prompt_key="message", label_key="answer")
    with pytest.raises(ImageDataError, match=r"its images take 6 tokens, over data.max_prompt_length=5"):
        encode_prompts(tok, samples, 5)
    with pytest.raises(ImageDataError, match="placeholder"):
        load_samples(str(write_jsonl(tmp_path / "n.jsonl", [{"prompt": "<image><image> two?", "images": [
            str(pictures["red"])], "y": "1"}])), prompt_key="prompt", label_key="y")


def test_truncation_cuts_text_only_from_the_left(pictures, vl, tmp_path):
    from alignrl.data.collate import encode_prompts

    _, tok = vl
    long_text = "What is 1+1? " * 20
    row = {"message": json.dumps([{"role": "user", "content": [
        {"type": "text", "text": long_text}, {"type": "image", "image": str(pictures["red"])},
        {"type": "text", "text": "Which color is it?"}]}]), "answer": "red"}
    samples = load_samples(str(write_jsonl(tmp_path / "t.jsonl", [row])), prompt_key="message", label_key="answer")
    whole = encode_prompts(tok, samples, 10_000)[0]
    cut = encode_prompts(tok, samples, 24)[0]
    assert len(whole) > 24 and len(cut) == 24
    assert image_tokens(tok, cut) == 4 and cut[-8:] == whole[-8:]  # the images and the prompt's end stay
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    assert cut[cut.index(start):cut.index(start) + 6] == whole[whole.index(start):whole.index(start) + 6]
    # the rule itself: protected positions are never dropped, the earliest others are
    assert truncate_outside_images("r", [1, 2, 9, 9, 3, 4], [False, False, True, True, False, False], 4) == [9, 9, 3, 4]


def _rollout(vl, pictures, tmp_path, n=3):
    from alignrl.data.collate import encode_prompts
    from alignrl.data.synthetic import generate
    from alignrl.interfaces import SamplingParams
    from alignrl.rollout.hf_engine import HFRolloutEngine

    model, tok = vl
    rows = [lmm_r1_row(pictures["red"], "What is 2+3?"), lmm_r1_row(pictures["blue"], "Which color is this?")]
    samples = load_samples(str(write_jsonl(tmp_path / "r.jsonl", rows)), prompt_key="message", label_key="answer")
    prompts = encode_prompts(tok, samples + generate("train", 1, seed=0), 96)  # a text prompt among them
    return HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=10,
                                                                        seed=3))


def test_engine_logprobs_are_the_trainers(vl, pictures, tmp_path):
    """The cached decode (M-RoPE deltas on generated tokens) gives the log-probs of the one-pass forward the trainer
    recomputes, to 1e-4 in fp32 (measured: about 5e-7); image tokens whose images are left out are refused."""
    from alignrl.rl.producer import batched_logprobs

    model, _ = vl
    ro = _rollout(vl, pictures, tmp_path)
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
    ro = _rollout(vl, pictures, tmp_path, n=1)
    tensors = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    plain, _ = response_logprobs(model, *tensors, images=ro.images)
    packed, _ = response_logprobs(model, *tensors, layout=ForwardLayout(remove_padding=True), images=ro.images)
    assert torch.equal(packed, plain)
    for layout in (ForwardLayout(share_prompt=True), ForwardLayout(share_prompt=True, remove_padding=True)):
        assert torch.equal(response_logprobs(model, *tensors, layout=layout, images=ro.images)[0], plain)
    with pytest.raises(ModelError, match="critic is a text-only model but the prompts carry images: set "
                                         "critic.model_path"):
        response_values(load_value_model(str(tiny_model_dir), log=lambda *_: None), *tensors, images=ro.images)


def test_text_forwards_run_the_encoder_when_ranks_share_the_model_or_it_trains(vl, pictures, tmp_path, monkeypatch):
    """A text-only forward (plain or packed) runs the image encoder once on a blank patch when several ranks hold the
    model, as another rank's image micro-batch runs it, so DDP/FSDP2/ZeRO-3 collectives pair up (test_vision_sharded_ref
    runs the ranks), and in one process when a gradient goes through a trainable encoder, so AdamW sees a zero
    gradient as it does over ranks. Log-probs stay bit-equal and the encoder's gradient is zero, not absent; a forward
    with images runs it only for them; a frozen encoder in one process, or a forward without gradient, not at all."""
    from alignrl.models import vision
    from alignrl.models.logprobs import ForwardLayout, response_logprobs

    model, _ = vl
    ro = _rollout(vl, pictures, tmp_path, n=1)
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
    ro = _rollout(vl, pictures, tmp_path, n=2)  # 2 red, 2 blue, 2 text rows
    tensors = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    values = response_values(critic, *tensors, images=ro.images)
    assert values.shape == ro.response_mask.shape and torch.isfinite(values).all()
    assert ((values != 0) == ro.response_mask.bool()).all()
    swapped = ImageRows([ro.images.rows[2], ro.images.rows[3], ro.images.rows[0], ro.images.rows[1]] + ro.images.rows[4:])
    other = response_values(critic, *tensors, images=swapped)  # the red rows see blue, the blue rows red
    assert not torch.allclose(other[:4], values[:4]) and torch.equal(other[4:], values[4:])
    (values * ro.response_mask).sum().backward()
    assert critic.score.weight.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in critic.named_parameters() if ".visual." in n)
    critic.save_pretrained(tmp_path / "critic")
    again = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    assert torch.allclose(response_values(again, *tensors, images=ro.images), values.detach(), atol=1e-6)
    assert torch.equal(response_values(critic, *tensors, remove_padding=True, images=ro.images), values.detach())


def test_wire_round_trip_keeps_images(vl, pictures, tmp_path):
    from alignrl.data.records import ScoredBatch, Scores
    from alignrl.wire.frames import decode, encode
    from alignrl.wire.records import KIND, from_wire, to_wire

    _, tok = vl
    ro = _rollout(vl, pictures, tmp_path, n=2)
    b = len(ro.group)
    batch = ScoredBatch(ro, Scores(torch.zeros(b), torch.zeros(b, dtype=torch.bool)), ro.response_mask.clone(), None,
                        ro.group.clone())
    meta, tensors = to_wire(batch, tok)
    back = from_wire(decode(encode(KIND, meta, tensors)))
    assert len(back.rollout.images) == b
    for x, y in zip(ro.images.rows, back.rollout.images.rows):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.image_grid_thw, y.image_grid_thw)
    tensors["image_counts"] = tensors["image_counts"] + 1
    with pytest.raises(ValueError, match="image tensors do not match image_counts"):
        from_wire(decode(encode(KIND, meta, tensors)))


def test_images_select_and_join():
    from alignrl.data.images import PromptImages, join_rows

    one = PromptImages(torch.ones(4, 3), torch.tensor([[1, 2, 2]]))
    rows = ImageRows([one, None, one])
    assert rows.select(torch.tensor([2, 1])).rows == [one, None]
    joined = join_rows([rows, None], [3, 2])
    assert len(joined) == 5 and joined.rows[3:] == [None, None]
    pixels, grid = joined.batch()
    assert pixels.shape == (8, 3) and grid.shape == (2, 3)


def test_vllm_requests_carry_the_pictures(vl, pictures, tmp_path):
    """The vLLM adapter's request for a prompt with images (vLLM itself runs on GPU machines only)."""
    from alignrl.data.collate import encode_prompts
    from alignrl.rollout.vllm_engine import request

    _, tok = vl
    samples = load_samples(str(write_jsonl(tmp_path / "v.jsonl", [lmm_r1_row(pictures["green"], "Which?")])),
                           prompt_key="message", label_key="answer")
    prompt = encode_prompts(tok, samples, 64)[0]
    req = request(prompt)
    assert req["prompt_token_ids"] == list(prompt) and len(req["multi_modal_data"]["image"]) == 1
    assert req["multi_modal_data"]["image"][0].getpixel((0, 0)) == (0, 255, 0)
    assert request([1, 2, 3]) == {"prompt_token_ids": [1, 2, 3]}


def test_a_reference_that_cannot_read_images_is_one_line(vl, pictures, tmp_path):
    from alignrl.models.folder import ModelError
    from alignrl.rl.producer import LocalRefScorer, RolloutMaker

    class TextOnlyRef:  # the shape of the HTTP and Ray reference clients
        def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask):
            raise AssertionError("called without the images")

    ro = _rollout(vl, pictures, tmp_path, n=1)
    with pytest.raises(ModelError, match=r"the reference \(TextOnlyRef\) cannot read prompts with images"):
        RolloutMaker(None, None, None, TextOnlyRef()).ref_logprobs(ro, None)
    local = RolloutMaker(None, None, None, LocalRefScorer(vl[0], 1.0, 4)).ref_logprobs(ro, None)
    assert (local - ro.logprobs).abs().max() < 1e-4  # the same (untrained) model: the engine's own log-probs


def test_pixel_bounds_set_the_image_tokens(vl_dir, tmp_path):
    from alignrl.config import load_config
    from alignrl.data.collate import encode_prompts
    from alignrl.data.prompts import load_task_data
    from alignrl.models.loader import load_tokenizer

    Image.new("RGB", (112, 112), (9, 9, 9)).save(tmp_path / "big.png")
    data = write_jsonl(tmp_path / "p.jsonl", [lmm_r1_row(tmp_path / "big.png", "Which?")])
    counts = []
    for bound in (0, 56 * 56):  # the tiny processor's own bound (112*112: 16 tokens), then one of 4 tokens
        tok = load_tokenizer(vl_dir)
        cfg = load_config(None, [f"data.train_files={data}", f"data.val_files={data}", "data.prompt_key=message",
                                 "data.label_key=answer", f"data.max_pixels={bound}"])
        train, _ = load_task_data(cfg, tok)
        counts.append(image_tokens(tok, encode_prompts(tok, train, 256)[0]))
    assert counts == [16, 4]


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
