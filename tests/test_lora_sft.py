"""SFT through LoRA adapters (models.sft.sft_train_lora): the loss falls, the result is a plain model with the adapters
merged in, and only the layers that had adapters changed."""

import torch

from alignrl.data import synthetic
from alignrl.models.loader import frozen_copy
from alignrl.models.lora import lora_spec
from alignrl.models.sft import sft_train_lora


def test_sft_with_adapters_returns_a_merged_plain_model(tiny_model):
    model, tokenizer = tiny_model
    base = {k: v.clone() for k, v in model.state_dict().items()}
    samples = synthetic.generate("train", 16, seed=0)
    merged, losses = sft_train_lora(frozen_copy(model).train(), tokenizer, samples, spec=lora_spec(8, 16),
                                    steps=12, batch_size=8, lr=1e-2, warmup_steps=0)
    assert losses[-1] < losses[0]
    state = merged.state_dict()
    assert set(state) == set(base) and not any("lora_" in k for k in state)
    changed = {k for k in base if not torch.equal(base[k], state[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)
