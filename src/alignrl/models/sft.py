"""Supervised fine-tuning on (prompt, response) pairs: loss on response tokens only.

Samples carry their target response in `extra["answer"]` (the GSM8K worked solution); the
response is followed by the tokenizer's eos so the model learns to stop. Prompts with images (a vision-language
model's tokenizer encodes them with their images, `data.images`) train with their images in the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignrl.data.collate import encode_prompts, left_pad, right_pad
from alignrl.data.images import prompt_images
from alignrl.data.records import Sample
from alignrl.models.logprobs import response_logprobs
from alignrl.core.optim import build_optimizer
from alignrl.models.lora import LoraSpec, add_adapters


def encode_pairs(tokenizer, samples: Sequence[Sample], max_prompt_length: int) -> tuple[list, list]:
    prompts = encode_prompts(tokenizer, samples, max_prompt_length)
    responses = [tokenizer(s.extra["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                 for s in samples]
    return prompts, responses


def sft_train(model, tokenizer, samples: Sequence[Sample], *, steps: int, batch_size: int, lr: float,
              warmup_steps: int = 10, min_lr_ratio: float = 0.1, seed: int = 0, max_prompt_length: int = 128,
              on_step=None) -> list[float]:
    """Cosine-scheduled AdamW over shuffled batches; returns the loss of every step.

    `on_step(step, loss)` is called after each step (progress display)."""
    prompts, responses = encode_pairs(tokenizer, samples, max_prompt_length)
    trained = [p for p in model.parameters() if p.requires_grad]  # the adapters alone under LoRA
    opt, sched = build_optimizer(trained, lr, 0.0, (0.9, 0.95), warmup_steps, steps, "cosine", min_lr_ratio)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(samples), generator=gen)
    losses, model_was_training = [], model.training
    model.train()
    pad = tokenizer.pad_token_id
    pos = 0
    for step in range(steps):
        if pos + batch_size > len(samples):  # new epoch, new order
            order, pos = torch.randperm(len(samples), generator=gen), 0
        idx = order[pos:pos + batch_size].tolist()
        pos += batch_size
        batch = [prompts[i] for i in idx]
        pi, pm = left_pad(batch, pad)
        ri, rm = right_pad([responses[i] for i in idx], pad)
        # prompts with images (a vision-language model's ImagePrompt) take their images into the forward
        logp, _ = response_logprobs(model, pi, pm, ri, rm, images=prompt_images(batch))
        loss = -logp.sum() / rm.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.train(model_was_training)
    return losses


def sft_train_lora(model, tokenizer, samples: Sequence[Sample], spec: LoraSpec, **kw) -> tuple[object, list[float]]:
    """`sft_train` of LoRA adapters (`spec`) on `model`, whose own weights stay frozen; returns the plain model with
    the adapters merged in (its save_pretrained writes an ordinary HF folder) and the losses. The adapters' initial
    values come from `kw["seed"]`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(kw.get("seed", 0))
        wrapped = add_adapters(model, spec, key="lora rank")
    losses = sft_train(wrapped, tokenizer, samples, **kw)
    return wrapped.merge_and_unload(), losses
