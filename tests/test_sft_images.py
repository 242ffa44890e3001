"""`alignrl train sft` on rows with images, for the tiny Qwen2-VL model: verl's and TRL's layouts encode alike and as
the processor does, the labels cover the reply alone, the picture changes the loss, a few steps lower it and the
saved folder loads as a vision-language model with its processor; mistakes are one line each."""

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


def _encoded(tok, path: str, max_length: int = 512):
    rows = load_rows(path, SFTKeys())
    return encode_rows(tok, rows, SFTKeys(), max_length)[0]


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
    assert torch.equal(enc[0].images.grid, torch.tensor([[1, 4, 4]]))


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
    user = {"role": "user", "content": f"<image>{ASK}"}
    cases = [({"messages": [user, {"role": "assistant", "content": "red"}], "images": ["nope.png"]},
              "images\\[0\\]: image file not found: nope.png"),
             ({"messages": [{"role": "user", "content": f"<image><image>{ASK}"},
                            {"role": "assistant", "content": "red"}], "images": [str(pictures["red"])]},
              r"the prompt has 2 image placeholder\(s\) but column 'images' holds 1"),
             ({"messages": [user, {"role": "assistant", "content": "<image>red"}],
               "images": [str(pictures["red"]), str(pictures["blue"])]}, r"message 1 \(assistant\) holds an image")]
    for i, (row, words) in enumerate(cases):
        with pytest.raises(UserError, match=rf"rows{i}.jsonl:1:? {words}"):
            load_rows(_write(tmp_path / f"rows{i}.jsonl", [row]), SFTKeys())
    good = _write(tmp_path / "good.jsonl", [{"messages": [user, {"role": "assistant", "content": "red"}],
                                             "images": [str(pictures["red"])]}])
    with pytest.raises(ImageDataError, match="good.jsonl:1: the row has images, but model_path is a text-only model"):
        _encoded(load_tokenizer(tiny_model_dir, chat=False), good)
    with pytest.raises(UserError, match="good.jsonl:1: max_length=8 would cut the row's image tokens"):
        _encoded(tok, good, max_length=8)
    with pytest.raises(UserError, match="packing is text-only, and 1 training rows have images: set packing=false"):
        check_not_packed(_encoded(tok, good), True, "training")
