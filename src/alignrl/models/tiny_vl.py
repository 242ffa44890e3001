"""A tiny, randomly initialised vision-language model of the Qwen2-VL architecture, built here from a seed.

No hub download: the tokenizer is trained on a small text corpus (the synthetic arithmetic task unless
`texts` is given) with the embedded demo model's recipe (`alignrl.models.tokenizer`), plus Qwen2-VL's vision
special tokens, and a chat template that renders `{"type": "image"}` content items as
`<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2-VL-Instruct's does. The folder holds the model,
the tokenizer and the processor (Pillow image processor), all written with save_pretrained.

Usage:

    from alignrl.models.tiny_vl import build_tiny_vl
    folder = build_tiny_vl("/tmp/tiny-vl", seed=0)          # about a second on one CPU core
    # then: alignrl train grpo model.path=/tmp/tiny-vl ...  (or alignrl.models.vision.load_vision_model)

    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder)

With the defaults a 56x56 image is 4x4 patches of 14 pixels, merged 2x2 into 4 image tokens; images are
resized within `min_pixels`..`max_pixels` (56*56 .. 112*112: at most 16 image tokens). The same seed gives
the same bytes on one torch version (built on one thread).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# ChatML with content lists: an image item (OpenRLHF's {"type": "image"}, LMM-R1's {"type": "image", "image":
# ...}, OpenAI's {"type": "image_url"}) becomes one vision span the processor widens to the image's tokens.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% elif item['type'] in ('image', 'image_url') or 'image' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVLRecipe:
    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 2
    patch_size: int = 14
    spatial_merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    tokenizer_corpus: int = 500  # synthetic problems the tokenizer is trained on (when no `texts` are given)


def _corpus(recipe: TinyVLRecipe) -> list[str]:
    from alignrl.data import synthetic

    samples = synthetic.generate("train", recipe.tokenizer_corpus, seed=recipe.seed + 1)
    return [s.messages[-1]["content"] + "\n" + s.extra["answer"] for s in samples]


def build_vl_tokenizer(texts: Iterable[str], recipe: TinyVLRecipe, out_dir: Path):
    """A byte-level BPE Qwen2 tokenizer with the vision special tokens, saved to `out_dir` and loaded back."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from alignrl.models.tokenizer import save_as_qwen2, train_tokenizer

    tok = train_tokenizer(texts, recipe.vocab_size)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    save_as_qwen2(tok, out_dir, recipe.max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # replaced by the model's config
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_vl_config(tokenizer, recipe: TinyVLRecipe):
    from transformers import Qwen2VLConfig

    head_dim = recipe.hidden_size // recipe.num_attention_heads
    # M-RoPE splits each head's rotary half (head_dim / 2) into temporal, height and width sections
    quarter = head_dim // 2 // 4
    sections = [head_dim // 2 - 2 * quarter, quarter, quarter]
    text = dict(vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
                intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
                num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
                max_position_embeddings=recipe.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    vision = dict(depth=recipe.vision_depth, embed_dim=recipe.vision_embed_dim, hidden_size=recipe.hidden_size,
                  num_heads=recipe.vision_heads, mlp_ratio=2, patch_size=recipe.patch_size,
                  spatial_merge_size=recipe.spatial_merge_size, temporal_patch_size=2, in_channels=3)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD), ("vision_start_token_id", VISION_START),
            ("vision_end_token_id", VISION_END))}
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **ids)


def tiny_vl_processor(tokenizer, recipe: TinyVLRecipe):
    """The processor (Pillow image processor + tokenizer + template); see `alignrl.models.vision.ImageProcessor`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from alignrl.models.vision import ImageProcessor

    images = Qwen2VLImageProcessorPil(min_pixels=recipe.min_pixels, max_pixels=recipe.max_pixels,
                                      patch_size=recipe.patch_size, merge_size=recipe.spatial_merge_size,
                                      temporal_patch_size=2)
    return ImageProcessor(image_processor=images, tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE)


def build_tiny_vl(folder: str | Path, seed: int = 0, texts: Iterable[str] | None = None,
                  recipe: TinyVLRecipe | None = None) -> Path:
    """Write a random tiny Qwen2-VL model, its tokenizer and processor to `folder` (put in place whole, replacing
    what was there) and return it. `texts`: the tokenizer's training corpus (default: synthetic arithmetic
    problems); `recipe` sizes the model (its seed is replaced by `seed`)."""
    from dataclasses import replace

    from transformers import Qwen2VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from alignrl.models.tiny import build_into
    from alignrl.models.vision import save_processor

    recipe = replace(recipe or TinyVLRecipe(), seed=seed)
    texts = list(texts) if texts is not None else _corpus(recipe)
    hf_logging.disable_progress_bar()  # a bar per tiny save is noise
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums, so the same bytes, on any machine's core count
    try:
        with build_into(Path(folder)) as tmp:
            tokenizer = build_vl_tokenizer(texts, recipe, tmp)
            config = tiny_vl_config(tokenizer, recipe)
            torch.manual_seed(recipe.seed)
            model = Qwen2VLForConditionalGeneration(config)
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.save_pretrained(tmp)
            save_processor(tiny_vl_processor(tokenizer, recipe), tmp)
            (tmp / "tiny_vl_recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    finally:
        torch.set_num_threads(threads)
    return Path(folder)
