"""Supervised fine-tuning of the tiny Qwen2-VL model on prompts with images: the images go into the forward (a
prompt's image tokens without them are refused), and the loss falls."""

import pytest
import torch
from PIL import Image

from alignrl.data.records import Sample
from alignrl.models.sft import sft_train

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}


@pytest.fixture(scope="module")
def vl_and_samples(tmp_path_factory):
    from alignrl.models.tiny_vl import build_tiny_vl

    root = tmp_path_factory.mktemp("vl_sft")
    folder = build_tiny_vl(root / "tiny-vl", seed=0)
    samples = []
    for name, rgb in COLORS.items():
        Image.new("RGB", (56, 56), rgb).save(root / f"{name}.png")
        content = [{"type": "image"}, {"type": "text", "text": "Which color is this?"}]
        samples.append(Sample([{"role": "user", "content": content}], name, extra={"answer": f"It is {name}."},
                              images=(str(root / f"{name}.png"),)))
    return folder, samples


def test_sft_on_image_prompts_lowers_the_loss(vl_and_samples):
    from alignrl.models.loader import load_model

    folder, samples = vl_and_samples
    torch.manual_seed(0)
    model, tokenizer = load_model(str(folder))
    losses = sft_train(model, tokenizer, samples, steps=8, batch_size=2, lr=3e-3, warmup_steps=0, seed=0)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses

