"""Prompts with images through the one loop, on a tiny Qwen2-VL model built from a seed: the tiny model, the data
layouts users bring (LMM-R1, verl, TRL, OpenRLHF 0.10), their one-line errors, truncation that never cuts an
image's tokens, engine log-probs that the trainer recomputes, a critic that reads the images, and the wire round trip.
The training runs on images are in test_vision_training.py, the model's forwards in test_vision_forwards.py."""

import json

import pytest
import torch
from PIL import Image

from alignrl.data.images import ImageDataError, ImagePrompt, ImageRows, truncate_outside_images
from alignrl.data.loaders import load_samples
from visionrows import image_tokens, lmm_r1_row, vl_rollout, write_jsonl


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


def test_wire_round_trip_keeps_images(vl, pictures, tmp_path):
    from alignrl.data.records import ScoredBatch, Scores
    from alignrl.wire.frames import decode, encode
    from alignrl.wire.records import KIND, from_wire, to_wire

    _, tok = vl
    ro = vl_rollout(vl, pictures, tmp_path, n=2)
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
