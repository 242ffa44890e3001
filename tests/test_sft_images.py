"""`alignrl train sft` on rows with images, for the tiny Qwen2-VL model: verl's and TRL's layouts encode alike and as
the processor does, the labels cover the reply alone (no image token is trained, even when every other token is),
the picture changes the loss, a few steps lower it and the saved folder loads as a vision-language model with its
processor; held-out images load per batch; mistakes are one line each."""

import json
from pathlib import Path

import pytest
import torch

from alignrl.data.images import ImageDataError
from alignrl.data.sft_rows import SFTKeys, collate_rows, encode_rows, load_rows
from alignrl.errors import UserError

ASK = "What colour is it?"


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _layouts(pic: Path) -> list[dict]:
    """One row in verl's layout (<image> in the text), TRL's conversational one (image items), TRL's
    prompt-completion one (no placeholder), and TRL's one-image `image` column with a relative path."""
    return [
        {"messages": [{"role": "user", "content": f"<image>{ASK}"}, {"role": "assistant", "content": "red"}],
         "images": [str(pic)]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ASK}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red"}]}], "images": [str(pic)]},
        {"prompt": ASK, "completion": "red", "images": [str(pic)]},
        {"prompt": [{"role": "user", "content": ASK}], "completion": [{"role": "assistant", "content": "red"}],
         "image": pic.name},
    ]


TEMPLATED = SFTKeys(chat_template=True)  # string prompt-completion rows with images need it


def _encoded(tok, path: str, max_length: int = 512, keys: SFTKeys = TEMPLATED):
    rows = load_rows(path, keys)
    return encode_rows(tok, rows, keys, max_length)[0]


def test_verl_and_trl_layouts_encode_alike_as_the_processor_does(vl, pictures, tmp_path):
    """Every layout gives the processor's own ids (the image widened to its tokens); the trained tokens are exactly
    the assistant's reply as the template closes it: none of the prompt's, none of the image's."""
    from PIL import Image

    _, tok = vl
    pic = tmp_path / "red.png"
    pic.write_bytes(pictures["red"].read_bytes())
    enc = _encoded(tok, _write(tmp_path / "rows.jsonl", _layouts(pic)))
    assert len(enc) == 4 and all(e.ids == enc[0].ids and e.trained == enc[0].trained for e in enc[1:])
    processor = tok.alignrl_processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ASK}]},
                {"role": "assistant", "content": "red"}]
    image = [Image.open(pic)]
    whole = processor(text=[processor.apply_chat_template(messages, tokenize=False)], images=image,
                      return_tensors="pt")["input_ids"][0].tolist()
    head = processor(text=[processor.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)],
                     images=image, return_tensors="pt")["input_ids"][0].tolist()
    assert enc[0].ids == whole and whole[:len(head)] == head
    assert [i for i, t in enumerate(enc[0].trained) if t] == list(range(len(head), len(whole)))
    assert sum(t == processor.image_token_id for t in whole) == 4  # a 56 x 56 picture: 4 merged patches
    assert enc[0].images.counts == (4,)
    # counted from the size alone, as many tokens as the processor makes of odd sizes too
    from alignrl.data.sft_images import image_tokens

    for w, h in ((10, 10), (300, 37), (57, 900)):
        Image.new("RGB", (w, h)).save(tmp_path / "odd.png")
        grid = processor.image_processor(images=[Image.open(tmp_path / "odd.png")], return_tensors="pt")
        want = int(grid["image_grid_thw"].prod()) // processor.image_processor.merge_size ** 2
        assert image_tokens("x", processor.image_processor, 0, str(tmp_path / "odd.png")) == want, (w, h)


def test_no_image_token_is_trained_when_every_other_token_is(vl, pictures, tmp_path):
    """assistant_only_loss=false and completion_only_loss=false train the prompt's text, never the image's tokens
    (pads, start and end: the model config's vision tokens); a template kept on the tokenizer alone renders the
    same ids (SFT and RL prompts)."""
    from types import SimpleNamespace

    from alignrl.data.images import encode_image_prompt
    from alignrl.models.vision import config_vision_token_ids
    from alignrl.preference.sft import _encode
    from alignrl.preference.sft_cli import SFTConfig

    model, tok = vl
    banned = set(config_vision_token_ids(model.config))
    user = {"role": "user", "content": f"<image>{ASK}"}
    path = _write(tmp_path / "all.jsonl", [{"messages": [user, {"role": "assistant", "content": "red"}],
                                            "images": [str(pictures["red"])]},
                                           {"prompt": [user], "completion": "red", "images": [str(pictures["red"])]}])
    quiet = SimpleNamespace(print=lambda *_: None)
    cfg = SFTConfig(train_files=[path], assistant_only_loss=False, completion_only_loss=False, bf16="false")
    enc, _, _ = _encode(tok, cfg, load_rows(path, TEMPLATED), [], quiet)
    for e in enc:
        trained = {t for t, k in zip(e.ids, e.trained) if k}
        assert len(banned) == 4 and len(banned & set(e.ids)) == 3 and not trained & banned  # no video
        assert e.n_trained == len(e.ids) - 1 - sum(t in banned for t in e.ids)  # all the rest, text of the prompt too
    processor = tok.alignrl_processor
    sample = SimpleNamespace(messages=[{"role": "user", "content": [{"type": "image"}]}], source="x",
                             images=(str(pictures["red"]),))
    prompt = list(encode_image_prompt(tok, sample, 512))
    own, processor.chat_template = processor.chat_template, None  # a folder whose template is the tokenizer's alone
    try:
        assert tok.chat_template and _encoded(tok, path)[0].ids == enc[0].ids
        assert list(encode_image_prompt(tok, sample, 512)) == prompt and processor.image_token_id in prompt
    finally:
        processor.chat_template = own


def test_held_out_images_load_per_batch(vl, pictures, tmp_path):
    """The held-out batches with images are collated when they run (their pixels never held for the run), text-only
    ones up front; the loss is the same as from batches collated at once."""
    from alignrl.preference.sft import collator, eval_batches, evaluate
    from alignrl.preference.sft_cli import SFTConfig
    from alignrl.runtime.env import DistEnv

    model, tok = vl
    rows = [{"messages": [{"role": "user", "content": f"<image>{ASK}"}, {"role": "assistant", "content": c}],
             "images": [str(pictures[c])]} for c in ("red", "blue")]
    rows.append({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]})
    enc = _encoded(tok, _write(tmp_path / "held.jsonl", rows))
    cfg, env = SFTConfig(bf16="false"), DistEnv()
    batches = eval_batches(enc, collator(cfg, tok.pad_token_id), 2, env)
    assert [callable(b) for b in batches] == [True, False]
    got, want = evaluate(model, batches, cfg, env), evaluate(model, [collate_rows(enc[:2], tok.pad_token_id, 0.0),
                                                                     batches[1]], cfg, env)
    assert got == want and got["tokens"] > 0


def _loss(model, tok, path: str) -> float:
    from alignrl.preference.sft import summed_loss
    from alignrl.preference.sft_cli import SFTConfig

    enc = _encoded(tok, path)
    batch = collate_rows(enc, tok.pad_token_id, 1.0)
    with torch.no_grad():
        total, n = summed_loss(model, batch, SFTConfig(bf16="false"), torch.device("cpu"))
    return float(total) / n


def test_the_picture_is_seen(vl, pictures, tmp_path):
    """The same text with another picture gives another loss; the same picture the same loss; the text alone (no
    image) is a row of its own a vision-language model still trains on."""
    model, tok = vl
    row = lambda c: {"messages": [{"role": "user", "content": f"<image>{ASK}"},  # noqa: E731
                                  {"role": "assistant", "content": "red"}], "images": [str(pictures[c])]}
    red, blue = (_loss(model, tok, _write(tmp_path / f"{c}.jsonl", [row(c)])) for c in ("red", "blue"))
    assert abs(red - blue) > 1e-4 and _loss(model, tok, str(tmp_path / "red.jsonl")) == red
    text = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "red"}]
    alone = _loss(model, tok, _write(tmp_path / "text.jsonl", [{"messages": text}]))
    assert torch.isfinite(torch.tensor(alone)) and alone not in (red, blue)


def test_a_few_steps_lower_the_loss_and_save_a_vision_model(vl_dir, pictures, tmp_path):
    """Four pictures, each answered by its colour, and a text-only row in the same batches: the held-out loss on them
    falls, and the saved folder is a vision-language model whose processor loads, with the trained weights."""
    from alignrl.models.vision import is_vision_folder, load_processor, load_vision_model
    from alignrl.preference.sft_cli import sft_main

    rows = [{"messages": [{"role": "user", "content": f"<image>{ASK}"}, {"role": "assistant", "content": c}],
             "images": [str(p)]} for c, p in pictures.items()]
    rows.append({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]})
    data = _write(tmp_path / "train.jsonl", rows)
    out = tmp_path / "sft"
    assert sft_main([f"model_path={vl_dir}", f"train_files=[{data}]", f"eval_files=[{data}]", "--output_dir",
                     str(out), "--logging_dir", str(tmp_path / "logs"), "report_to=[jsonl]", "batch_size=5",
                     "max_steps=8", "epochs=8", "learning_rate=5e-3", "warmup_ratio=0", "bf16=false",
                     "strategy=single"]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["steps"] == 8 and results["after"]["loss"] < 0.7 * results["before"]["loss"], results
    assert is_vision_folder(out) and load_processor(out).image_token_id == load_processor(vl_dir).image_token_id
    trained, base = load_vision_model(out), load_vision_model(vl_dir)
    assert not torch.equal(trained.lm_head.weight, base.lm_head.weight)


def test_mistakes_are_one_line_each(vl, tiny_model_dir, pictures, tmp_path):
    """A missing image file, placeholders that do not match the images, an image in the reply, a text-only model
    given images, a row cut inside its images and packed image rows: each one line naming what to change."""
    from alignrl.models.loader import load_tokenizer
    from alignrl.preference.sft_vision import check_not_packed

    _, tok = vl
    user, reply = {"role": "user", "content": f"<image>{ASK}"}, {"role": "assistant", "content": "red"}
    cases = [({"messages": [user, {"role": "assistant", "content": "red"}], "images": ["nope.png"]},
              "images\\[0\\]: image file not found: nope.png"),
             ({"messages": [{"role": "user", "content": f"<image><image>{ASK}"},
                            {"role": "assistant", "content": "red"}], "images": [str(pictures["red"])]},
              r"the prompt has 2 image placeholder\(s\) but column 'images' holds 1"),
             ({"messages": [user, {"role": "assistant", "content": "<image>red"}],
               "images": [str(pictures["red"]), str(pictures["blue"])]}, r"message 1 \(assistant\) holds an image"),
             ({"prompt": ASK, "completion": "red", "images": [str(pictures["red"])]},
              "rows with images go through the chat template, .* set apply_chat_template=true"),
             ({"messages": [user, reply], "images": 5}, "images\\[0\\]: an image is given as int '5'"),
             ({"messages": [user, reply], "images": [str(pictures["red"])]},  # read with image_key=pics
              "the row has no pics column \\(image_key\\) but has images; set image_key=images")]
    for i, (row, words) in enumerate(cases):
        keys = SFTKeys(image="pics") if i == len(cases) - 1 else SFTKeys()
        with pytest.raises(UserError, match=rf"rows{i}.jsonl:1:? {words}"):
            load_rows(_write(tmp_path / f"rows{i}.jsonl", [row]), keys)
    good = _write(tmp_path / "good.jsonl", [{"messages": [user, {"role": "assistant", "content": "red"}],
                                             "images": [str(pictures["red"])]}])
    with pytest.raises(ImageDataError, match="good.jsonl:1: the row has images, but model_path is a text-only model"):
        _encoded(load_tokenizer(tiny_model_dir, chat=False), good)
    with pytest.raises(UserError, match="good.jsonl:1: max_length=8 would cut the row's image tokens"):
        _encoded(tok, good, max_length=8)
    with pytest.raises(UserError, match="packing is text-only, and 1 training rows have images: set packing=false"):
        check_not_packed(load_rows(good, SFTKeys()), True, "training")  # the rows read, before they are encoded
    from PIL import Image

    Image.new("RGB", (3000, 10)).save(tmp_path / "thin.png")
    thin = _write(tmp_path / "thin.jsonl", [{"messages": [user, {"role": "assistant", "content": "red"}],
                                             "images": [str(tmp_path / "thin.png")]}])
    with pytest.raises(UserError, match=r"thin.jsonl:1: image 0 \(.*thin.png, 3000x10 pixels\) cannot be processed: "
                                        "absolute aspect ratio must be smaller than 200"):
        _encoded(tok, thin)
