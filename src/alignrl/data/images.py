"""Prompts with images: the image layouts of the data files users bring, the per-row image tensors a batch carries,
and a prompt's token ids with its images (a vision-language model's processor expands each image into its tokens).

Layouts (each becomes chat messages whose content lists hold `{"type": "image"}` and `{"type": "text"}` items in
order, and `Sample.images`, the images in the same order):

* LMM-R1 / OpenRLHF's multimodal fork: the prompt column (data.prompt_key=message) is a list of chat messages, or
  that list as a JSON string, whose content items are `{"type": "image", "image": "file:///..."}` and
  `{"type": "text", "text": ...}`;
* verl (geo3k): an `images` column (data.image_key) of {"bytes": ...} / {"path": ...} items or paths, and
  `<image>` placeholders in the prompt's text;
* TRL: an `images` column beside a `prompt` without placeholders: the images go before the first user turn's text;
* OpenRLHF 0.10: `{"type": "image"}` items without a source in the messages, filled from the `images` column.

Images are decoded with Pillow when a prompt is first encoded; a missing file is found at load time. Truncation of
a long prompt cuts text only, from the left, never an image's tokens; a prompt whose images alone do not fit is
refused. Deliberately out of scope: videos, images in assistant turns of the prompt (they are encoded all alike).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from alignrl.errors import UserError

PLACEHOLDER = "<image>"  # verl's and TRL's marker of an image's place in the text
PROCESSOR_ATTR = "alignrl_processor"  # a vision-language model's tokenizer carries its processor here


class ImageDataError(UserError):
    """An image in the data cannot be used (missing file, undecodable, not fitting the prompt length)."""


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images as its model reads them."""

    pixel_values: torch.Tensor  # (num_patches, D) float, the images' patches in order
    image_grid_thw: torch.Tensor  # (num_images, 3) long, each image's (t, h, w) grid of patches


@dataclass
class ImageRows:
    """The images of each row of a batch (None: a row without images); B entries."""

    rows: list[PromptImages | None]

    def __len__(self) -> int:
        return len(self.rows)

    def any(self) -> bool:
        return any(r is not None for r in self.rows)

    def select(self, idx) -> ImageRows:
        idx = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        return ImageRows([self.rows[i] for i in idx])

    def cat(self, other: ImageRows | None, other_rows: int) -> ImageRows:
        return ImageRows(self.rows + (other.rows if other is not None else [None] * other_rows))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (sum of patches, D), image_grid_thw (sum of images, 3)) of the rows in order."""
        real = [r for r in self.rows if r is not None]
        return torch.cat([r.pixel_values for r in real]), torch.cat([r.image_grid_thw for r in real])


def join_images(parts: list[PromptImages | None]) -> PromptImages | None:
    """One row's images from several sources in order (its prompt's, then its tool observations'): their patches and
    grids concatenated, as the row's image tokens appear in its ids; None when none has images."""
    real = [p for p in parts if p is not None]
    if len(real) < 2:
        return real[0] if real else None
    return PromptImages(torch.cat([p.pixel_values for p in real]), torch.cat([p.image_grid_thw for p in real]))


def join_rows(parts: list[ImageRows | None], sizes: list[int]) -> ImageRows | None:
    """The rows of several batches' images, in order (None when none has images)."""
    if all(p is None for p in parts):
        return None
    return ImageRows([r for p, n in zip(parts, sizes) for r in (p.rows if p is not None else [None] * n)])


class ImagePrompt(list):
    """A prompt's token ids (a list of ints, as every engine takes them) with the images its image tokens stand
    for: engines of vision-language models read `images`, text-only ones never see an ImagePrompt."""

    def __init__(self, ids, images: PromptImages, pictures: tuple = ()):
        super().__init__(ids)
        self.images = images
        self.pictures = pictures  # the decoded Pillow images, for engines that process images themselves (vLLM)


def images_to_json(images: PromptImages | None) -> dict | None:
    """A prompt's images for a JSON body (the generation service's /v1/generate_tokens `images`): the float32 pixel
    rows as base64 of their raw little-endian bytes, with their shape, and the grids as lists."""
    import base64

    if images is None:
        return None
    pixels = images.pixel_values.float().contiguous()
    return {"pixel_values": base64.b64encode(pixels.numpy().astype("<f4").tobytes()).decode(),
            "shape": list(pixels.shape), "image_grid_thw": images.image_grid_thw.tolist()}


def images_from_json(value: dict | None, what: str) -> PromptImages | None:
    """`images_to_json`'s form back; ImageDataError naming `what` when it does not add up."""
    import base64
    import binascii

    if value is None:
        return None
    try:
        raw = base64.b64decode(value["pixel_values"], validate=True)
        rows, width = (int(x) for x in value["shape"])
        grid = torch.tensor(value["image_grid_thw"], dtype=torch.long)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ImageDataError(f"{what}: images must be {{pixel_values: base64 float32, shape: [rows, width], "
                             f"image_grid_thw: [[t, h, w], ...]}} ({type(exc).__name__})") from None
    if (len(raw) != 4 * rows * width or grid.dim() != 2 or grid.shape[1:] != (3,) or bool((grid < 1).any())
            or int(grid.prod(-1).sum()) != rows):
        raise ImageDataError(f"{what}: images hold {len(raw)} bytes for shape [{rows}, {width}] and grids "
                             f"{grid.tolist()}: they do not add up (a grid's t*h*w patches per image, 4 bytes a value)")
    pixels = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(rows, width)
    return PromptImages(pixels, grid)


def prompt_images(prompts) -> ImageRows | None:
    """The images of a list of prompts (ImagePrompt or plain ids), or None when none has any."""
    rows = [getattr(p, "images", None) for p in prompts]
    return ImageRows(rows) if any(r is not None for r in rows) else None


def set_pixel_bounds(processor, min_pixels: int = 0, max_pixels: int = 0) -> None:
    """Images resized to between `min_pixels` and `max_pixels` pixels (data.min_pixels/max_pixels; 0: the
    processor's own bound), which bounds each image's number of tokens."""
    size = dict(processor.image_processor.size)
    if min_pixels:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels:
        size["longest_edge"] = int(max_pixels)
    if size["shortest_edge"] > size["longest_edge"]:
        raise ImageDataError(f"data.min_pixels={size['shortest_edge']} is above data.max_pixels="
                             f"{size['longest_edge']}: lower min_pixels or raise max_pixels")
    processor.image_processor.size = type(processor.image_processor.size)(**size)


# ---- loading: image sources in rows ----

def image_source(loc: str, value: Any, base: Path | None) -> str | bytes:
    """An image reference (a path, a file:// or data: URL, {"bytes"/"path": ...}) as a file path or the encoded
    bytes; ImageDataError naming `loc` when it is neither or its file is missing. `base`: where relative paths
    may also be found (the data file's folder)."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        value = value.get("path") or value.get("image") or value.get("url") or (value.get("image_url") or {})
        if isinstance(value, dict):
            value = value.get("url")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str) or not value:
        raise ImageDataError(f"{loc}: an image is given as {type(value).__name__} {str(value)[:60]!r}; give a file "
                             "path, a file:// URL or {'bytes': ...}")
    if value.startswith("data:"):
        import base64

        import binascii

        try:
            return base64.b64decode(value.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error):
            raise ImageDataError(f"{loc}: a data: URL that is not base64 (data:image/png;base64,<base64 bytes>)") \
                from None
    path = Path(value.removeprefix("file://"))
    if not path.is_absolute() and base is not None and not path.exists() and (base / path).exists():
        path = base / path
    if not path.is_file():
        raise ImageDataError(f"{loc}: image file not found: {path} (fix the path in the data, or copy the image there)")
    return str(path)


def _items(loc: str, content: Any, base: Path | None, found: list) -> list[dict[str, str]]:
    """A message's content as text/image items; the sources of images that name one go to `found` (None for a
    bare {"type": "image"}, filled from the image column later)."""
    if isinstance(content, str):
        parts = content.split(PLACEHOLDER)
        out = []
        for i, text in enumerate(parts):
            if i:
                out.append({"type": "image"})
                found.append(None)
            if text:
                out.append({"type": "text", "text": text})
        return out
    out = []
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            out += _items(loc, str(item.get("text") or ""), base, found)  # parquet's absent text is None
        elif kind in ("image", "image_url") or (isinstance(item, dict) and "image" in item):
            src = item.get("image") or item.get("image_url") or item.get("url")
            found.append(None if src is None else image_source(loc, src, base))
            out.append({"type": "image"})
        else:
            raise ImageDataError(f"{loc}: a content item {str(item)[:80]!r} is neither text nor image")
    return out


def parse_message_list(value: Any) -> Any:
    """LMM-R1's prompt column: a JSON string of a chat-message list becomes the list (other strings stay)."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed):
            return parsed
    return value


def with_row_images(loc: str, sample, row: dict[str, Any], image_key: str, base: Path | None):
    """`sample` with its images: from the messages' image items and the row's `image_key` column (the layouts in
    the module docstring). A text-only sample without images comes back unchanged."""
    column = row.get(image_key)
    one = isinstance(column, (str, bytes, dict)) or not hasattr(column, "__iter__")  # a scalar: image_source says
    column = [] if column is None else ([column] if one else list(column))
    has_items = any(not isinstance(m["content"], str) or PLACEHOLDER in m["content"] for m in sample.messages)
    if not column and not has_items:
        return sample
    if sample.prompt_text is not None:
        raise ImageDataError(f"{loc}: a prompt with images is templated by the model's processor: set "
                             "data.apply_chat_template=true (--apply_chat_template)")
    found: list = []
    messages = [{"role": m["role"], "content": _items(loc, m["content"], base, found)} for m in sample.messages]
    bare = [i for i, f in enumerate(found) if f is None]
    if bare and len(bare) != len(column):
        raise ImageDataError(f"{loc}: the prompt has {len(bare)} image placeholder(s) but column {image_key!r} holds "
                             f"{len(column)} image(s); give one image per placeholder")
    if not found and column:  # TRL: no placeholder; the images go first in the first user turn
        user = next((m for m in messages if m["role"] == "user"), messages[-1])
        user["content"] = [{"type": "image"} for _ in column] + user["content"]
        found = [None] * len(column)
        bare = list(range(len(column)))
    elif found and column and not bare:
        raise ImageDataError(f"{loc}: the messages name their images and column {image_key!r} holds more; keep one")
    for i, value in zip(bare, column):
        found[i] = image_source(f"{loc} {image_key}[{bare.index(i)}]", value, base)
    return replace(sample, messages=messages, images=tuple(found))


def to_rgb(image):
    """A Pillow image as RGB, its transparent pixels on white, as transformers' processors and verl's image loading
    flatten them (Pillow's own convert("RGB") drops the alpha channel: a transparent background turned black)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def decode_image(loc: str, source: str | bytes):
    """The image as a Pillow RGB image (`to_rgb`); ImageDataError when it is not an image Pillow reads."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            return to_rgb(im) if im.mode != "RGB" else im.convert("RGB")  # a copy either way, read before the close
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ImageDataError(f"{loc}: the image {_what(source)} cannot be decoded ({type(exc).__name__}); replace it "
                             "with a PNG or JPEG file") from None


def image_size(loc: str, source: str | bytes) -> tuple[int, int]:
    """(width, height) of the image, from its header alone (no pixels decoded); as `decode_image` when Pillow does
    not read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            return im.size
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ImageDataError(f"{loc}: the image {_what(source)} cannot be decoded ({type(exc).__name__}); replace it "
                             "with a PNG or JPEG file") from None


def _what(source: str | bytes) -> str:
    return f"{len(source)} bytes" if isinstance(source, bytes) else str(source)


def refused_image(loc: str, k: int, source: str | bytes, size: tuple[int, int], exc: Exception) -> ImageDataError:
    """The image processor's refusal of image `k` of a row (an aspect ratio over 200...) as one line."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ImageDataError(f"{loc}: image {k} ({_what(source)}, {size[0]}x{size[1]} pixels) cannot be processed: "
                          f"{reason}; crop, pad or replace it")


def processed(loc: str, image_processor, pictures: list, sources, call):
    """`call()`, a processor run on a row's decoded `pictures`; its ValueError as one line naming the row and the
    image that the image processor refuses alone (found by trying each), or the processor's reason."""
    try:
        return call()
    except ValueError as exc:
        for k, (picture, source) in enumerate(zip(pictures, sources)):
            try:
                image_processor(images=[picture], return_tensors="pt")
            except ValueError as alone:
                raise refused_image(loc, k, source, picture.size, alone) from None
        raise ImageDataError(f"{loc}: the processor refuses the row's images: {' '.join(str(exc).split())[:200]}") \
            from None


def chat_template_of(processor) -> str | None:
    """The template that renders a processor's messages: its own, else its tokenizer's (a folder may keep it in
    tokenizer_config.json alone, which the processor's own call would not find)."""
    return processor.chat_template or getattr(processor.tokenizer, "chat_template", None)


# ---- encoding: a prompt with images as the model reads it ----

def _image_spans(ids: list[int], start_id: int, end_id: int, pad_id: int) -> list[bool]:
    """Which positions belong to an image (its start and end markers and its tokens): truncation never cuts them."""
    keep, inside = [], False
    for t in ids:
        if t == start_id:
            inside = True
        keep.append(inside or t == pad_id)
        if t == end_id:
            inside = False
    return keep


def truncate_outside_images(loc: str, ids: list[int], protected: list[bool], max_len: int) -> list[int]:
    """`ids` cut to `max_len` by dropping the earliest text tokens outside image spans (the end of the prompt, its
    generation prompt, stays); ImageDataError when the image tokens alone do not fit."""
    n_image = sum(protected)
    if n_image > max_len:
        raise ImageDataError(f"{loc}: its images take {n_image} tokens, over data.max_prompt_length={max_len}: raise "
                             "data.max_prompt_length, or lower data.max_pixels so each image has fewer tokens")
    drop = len(ids) - max_len
    out = []
    for t, keep in zip(ids, protected):
        if drop > 0 and not keep:
            drop -= 1
            continue
        out.append(t)
    return out


def encode_image_prompt(tokenizer, sample, max_len: int) -> list[int]:
    """The prompt ids of `sample` with its images expanded into image tokens (an ImagePrompt), templated by the
    processor of a vision-language model's `tokenizer`; cut to `max_len` as `truncate_outside_images` says (a
    caller that refuses long prompts instead passes no limit and checks the length)."""
    loc = getattr(sample, "source", None) or "a row"
    processor = getattr(tokenizer, PROCESSOR_ATTR, None)
    if processor is None:
        raise ImageDataError(f"{loc}: its prompt has images but model.path is a text-only model; use a "
                             "vision-language model (e.g. Qwen2-VL) or data without images")
    images = [decode_image(loc, s) for s in sample.images]
    template = chat_template_of(processor)
    if not template:
        raise ImageDataError(f"{loc}: its prompt has images, which the processor's chat template places, and "
                             "model.path has no chat template; use a vision-language model with one (e.g. Qwen2-VL)")
    text = processor.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False,
                                         chat_template=template)
    enc = processed(loc, processor.image_processor, images, sample.images,
                    lambda: processor(text=[text], images=images, return_tensors="pt"))
    ids = enc["input_ids"][0].tolist()
    if len(ids) > max_len:
        t = tokenizer.convert_tokens_to_ids
        ids = truncate_outside_images(loc, ids, _image_spans(ids, t("<|vision_start|>"), t("<|vision_end|>"),
                                                             processor.image_token_id), max_len)
    return ImagePrompt(ids, PromptImages(enc["pixel_values"].float(), enc["image_grid_thw"].long()), tuple(images))


def prompt_length(tokenizer, sample) -> int:
    """The prompt's length in tokens with its images (for data.filter_overlong_prompts)."""
    return len(encode_image_prompt(tokenizer, sample, 1 << 30))


