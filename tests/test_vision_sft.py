"""Supervised fine-tuning of the tiny Qwen2-VL model on prompts with images: the images go into the forward (a
prompt's image tokens without them are refused), and the loss falls."""

import pytest
import torch
from PIL import Image

from alignrl.data.records import Sample
from alignrl.models.sft import sft_train
from visionrows import COLORS


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



def test_lora_sft_on_image_prompts(vl_and_samples):
    """LoRA adapters on a vision-language model: the image positions and tokens are found through peft's wrapper;
    only the adapters train, and the merged model is an ordinary one."""
    from alignrl.models.loader import load_model
    from alignrl.models.lora import lora_spec
    from alignrl.models.sft import sft_train_lora

    folder, samples = vl_and_samples
    model, tokenizer = load_model(str(folder))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged, losses = sft_train_lora(model, tokenizer, samples, lora_spec(8, 16, 0.0, "q_proj,v_proj"), steps=8,
                                    batch_size=2, lr=1e-2, warmup_steps=0, seed=0)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    after = merged.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), sorted(changed)[:5]
