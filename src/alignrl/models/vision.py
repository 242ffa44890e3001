"""Vision-language models (Qwen2-VL architecture): loading a folder with its processor, and the model-side inputs
of a forward over prompt+response rows that carry images (pixel values, image grids, M-RoPE position ids).

The loop never branches on text vs vision: a batch's images travel as `data.images.ImageRows` beside its token ids,
and `vision_inputs` turns them into the keyword arguments this model's forward takes. Position ids are always
computed here (the model's own `get_rope_index`) and passed explicitly, so a forward never depends on the
`rope_deltas` the model caches between `generate` calls.

The processor is `ImageProcessor`: Qwen2-VL's processor without its video processor, which transformers builds
with torchvision only; images alone need Pillow. Its folder still names `Qwen2VLProcessor`, so AutoProcessor
loads it wherever torchvision is installed. Deliberately out of scope: videos.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from alignrl.data.images import PROCESSOR_ATTR, ImageRows, PromptImages, set_pixel_bounds
from alignrl.models.folder import ModelError, loading, read_config


def _processor_class():
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor for images and text only (no video processor, so no torchvision)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImageProcessor


def __getattr__(name: str):  # ImageProcessor is built on first use: importing transformers' processors is slow
    if name == "ImageProcessor":
        cls = _processor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def save_processor(processor, folder: Path) -> None:
    """save_pretrained, naming the standard class (Qwen2VLProcessor) for AutoProcessor."""
    processor.save_pretrained(str(folder))
    path = Path(folder) / "processor_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg["processor_class"] = "Qwen2VLProcessor"
    path.write_text(json.dumps(cfg, indent=2))


def is_vision_folder(folder: str | Path) -> bool:
    """Whether the folder's config.json is a vision-language model's (it has a vision_config)."""
    return (read_config(folder) or {}).get("vision_config") is not None  # as `folder.auto_class` decides


def hf_model(model):
    """The transformers model inside `model`: through a DDP/FSDP wrapper (`.module`) and LoRA adapters (peft's
    `get_base_model`), whose own `.model` would be the wrapped model rather than its decoder."""
    model = getattr(model, "module", model)
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def is_vision_model(model) -> bool:
    model = hf_model(model)
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def load_processor(folder: str | Path, min_pixels: int = 0, max_pixels: int = 0):
    """The folder's processor; `min_pixels`/`max_pixels` (data.min_pixels/max_pixels, 0: the processor's own)
    bound the resized image area, so the number of image tokens."""
    import warnings

    with loading(folder, "processor"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = __getattr__("ImageProcessor").from_pretrained(str(folder))
    set_pixel_bounds(processor, min_pixels, max_pixels)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    setattr(tokenizer, PROCESSOR_ATTR, processor)  # prompts with images find it from the tokenizer
    return processor


def processor_of(tokenizer):
    """The processor a vision-language model's tokenizer was loaded with (None: a text-only model's)."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def load_vision_model(folder: str | Path, dtype=torch.float32):
    """The image-text-to-text model of a checked folder, in `dtype`."""
    from transformers import AutoModelForImageTextToText

    with loading(folder, "model"):
        model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype)
    model.config.use_cache = False
    return model


def image_token_id(model) -> int:
    return int(hf_model(model).config.image_token_id)


VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model) -> list[int]:
    """The ids that only a prompt's images may hold (image and video placeholders, their start and end markers): a
    response must never contain them, or the next forward would count more image tokens than images. [] for a
    text-only model."""
    return config_vision_token_ids(getattr(hf_model(model), "config", None))


def config_vision_token_ids(config) -> list[int]:
    """`vision_token_ids` of a transformers config ([] for a text-only model's)."""
    if getattr(config, "vision_config", None) is None:
        return []
    return sorted({int(v) for v in (getattr(config, k, None) for k in VISION_TOKENS) if v is not None})


def mrope_positions(model, ids: torch.Tensor, mask: torch.Tensor, grid_thw: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids (3, B, L) of rows `ids` (B, L) whose attended tokens (`mask`) hold the image tokens of
    `grid_thw` (num_images, 3), in row order; and each row's delta (B, 1): the text position of a token appended
    after the row's last one is its count of attended tokens plus that delta. Padding columns get 0."""
    inner = hf_model(model).model
    kinds = (ids == image_token_id(model)).long()
    with torch.no_grad():
        pos, delta = inner.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid_thw,
                                          attention_mask=mask.long())
    return pos, delta


def vision_inputs(model, ids: torch.Tensor, mask: torch.Tensor, images) -> dict:
    """The keyword arguments a forward of rows `ids` (B, L) with attention `mask` takes for their `images`
    (`data.images.ImageRows` of the same B rows, or None): {} when no row has an image, else pixel_values,
    image_grid_thw and the M-RoPE position_ids. The rows' image tokens must match the images': image tokens without
    their images are refused (the model would read the placeholder's embedding as the picture, silently)."""
    if images is None or not images.any():
        if is_vision_model(model) and bool(((ids == image_token_id(model)) & mask.bool()).any()):
            raise ModelError("the rows hold image tokens but no images came with them: whatever computes these "
                             "log-probs must pass the prompts' images (data.images.ImageRows)")
        return {}
    if not is_vision_model(model):
        raise ModelError("these prompts carry images, but the model is a text-only model: set model.path to a "
                         "vision-language model (its config.json has a vision_config)")
    dev = ids.device
    pixel_values, grid = images.batch()
    want = int((grid.prod(-1) // hf_model(model).config.vision_config.spatial_merge_size ** 2).sum())
    have = int(((ids == image_token_id(model)) & mask.bool()).sum())
    if want != have:
        raise ModelError(f"the rows hold {have} image tokens but their images make {want}: a prompt's image tokens "
                         "were cut or its images do not belong to it")
    positions, _ = mrope_positions(model, ids, mask, grid.to(dev))
    dtype = next(hf_model(model).parameters()).dtype
    return {"pixel_values": pixel_values.to(dev, dtype), "image_grid_thw": grid.to(dev), "position_ids": positions}


def ranks_share_model() -> bool:
    """Whether this process is one of several ranks holding one model together (torch.distributed up with more than
    one rank), whose collectives (DDP's gradient all-reduce, FSDP2's and ZeRO-3's gathers of each block) pair up only
    while every rank runs the same modules."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def one_patch_image(model) -> ImageRows:
    """One row's image of a single merged patch (one image token), zeros: what a forward without real images feeds
    the image encoder of a vision-language model to keep it in step with other ranks'."""
    vc = hf_model(model).config.vision_config
    merge = vc.spatial_merge_size
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return ImageRows([PromptImages(torch.zeros(merge * merge, width), torch.tensor([[1, merge, merge]]))])


def encoder_trains(model) -> bool:
    """Whether the image encoder of vision-language `model` has trainable weights (not frozen, not left out of LoRA)."""
    return any(p.requires_grad for p in hf_model(model).model.visual.parameters())


@contextmanager
def encoder_in_every_forward(model, images):
    """Within it, a forward of vision-language `model` whose `images` (`data.images.ImageRows`, or None) hold none
    also runs the image encoder on one blank patch and adds 0 x its mean to the token embeddings, when several ranks
    share the model or a gradient is taken through a trainable encoder. A rank whose micro-batch is text-only would
    otherwise skip the encoder that another rank's image micro-batch runs, and their collectives would pair wrongly
    (gloo: "collective mismatch"; NCCL: a hang). In one process it keeps the optimizer's view the same as over ranks:
    the encoder gets a zero gradient, not none, so AdamW moves it by its momentum on a text-only step either way.
    Adding 0 leaves values, log-probs and the text's gradients bit-equal (verl's Qwen2-VL forward always does it)."""
    if (images is not None and images.any()) or not is_vision_model(model) or \
            not (ranks_share_model() or (torch.is_grad_enabled() and encoder_trains(model))):
        yield
        return
    inner = hf_model(model)
    pixels, grid = one_patch_image(model).batch()

    def add_encoder(_module, _args, embeds):
        features = inner.model.get_image_features(pixels.to(embeds.device), grid.to(embeds.device)).pooler_output
        return embeds + 0.0 * torch.cat(features).mean().to(embeds.dtype)

    handle = inner.get_input_embeddings().register_forward_hook(add_encoder)
    try:
        yield
    finally:
        handle.remove()
