"""Supervised fine-tuning rows with images, for a vision-language model (Qwen2-VL): reading them, and rendering
them with the images' tokens in place.

A row has images when its image column (`image_key`, `images` by default; TRL's one-image `image` column too) holds
some, or its messages' content items name them (`{"type": "image", "image": "file:///..."}`). The layouts are
`data.images.with_row_images`'s: verl's `<image>` placeholders in the text, one image of the column each; TRL's and
OpenRLHF's `{"type": "image"}` items filled from the column in order; no placeholder at all (TRL's
prompt-completion rows): the column's images go first in the first user turn. Images belong to the prompt: an image
in an assistant (or tool) turn is refused, as trained text it would be a picture the model is asked to write.

A row with images is rendered by the processor's chat template (`ImageRenderer`): each image becomes its
`<|vision_start|><|image_pad|>...<|vision_end|>` span, widened to the image's count of tokens, as the processor
itself widens it (counted from the image's size, no pixels processed). The trained tokens are then found as for
text rows (`data.sft_rows`), the images' own tokens never among them (`RowPictures.untrained`). The pixels are not
kept: a row holds its images' sources and token counts (`RowPictures`), and each batch decodes them
(`RowPictures.load`), so a large data set costs no memory for its pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignrl.data.images import (PLACEHOLDER, PROCESSOR_ATTR, ImageDataError, PromptImages, chat_template_of,
                                 decode_image, image_size, processed, refused_image, with_row_images)
from alignrl.data.loaders import DataError

TRL_IMAGE = "image"  # TRL's column of a row's one image
DEFAULT_KEY = "images"  # image_key's default: verl's and TRL's column of a row's images


@dataclass(frozen=True)
class _Conversation:
    """What `with_row_images` reads and returns: messages, no pre-rendered prompt text, the images' sources."""

    messages: list
    prompt_text: None = None
    images: tuple = ()


def image_column(row: dict[str, Any], image_key: str) -> Any:
    """The row's images: its `image_key` column, else TRL's one-image `image` column as a list of one."""
    value = row.get(image_key)
    if value is None and row.get(TRL_IMAGE) is not None:
        return [row[TRL_IMAGE]]
    return value


def names_images(messages: Any) -> bool:
    """Whether chat messages hold content items that are images (a list content with an image item)."""
    if isinstance(messages, str) or not hasattr(messages, "__iter__"):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if content is None or isinstance(content, str):
            continue
        # parquet rows give every item every key: a text item's "image" is None there
        if any(isinstance(i, dict) and (i.get("type") in ("image", "image_url") or
                                        (i.get("type") is None and i.get("image") is not None)) for i in content):
            return True
    return False


def _checked(loc: str, key: str, value: Any) -> list[dict]:
    """Chat messages whose content is a string or a list of content items; one line naming the row otherwise."""
    if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
        raise ImageDataError(f"{loc}: {key} must be a list of chat messages ({{'role': ..., 'content': ...}}), "
                             f"got {type(value).__name__}")
    out = []
    for m in value:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or "role" not in m or content is None or \
                not (isinstance(content, str) or hasattr(content, "__iter__")):
            raise ImageDataError(f"{loc}: a message in {key} lacks role/content (each message must be {{'role': "
                                 "..., 'content': '...' or a list of text and image items}})")
        # its other keys stay for the caller's checks (tool_calls...); with_row_images keeps role and content
        out.append({**m, "role": str(m["role"]), "content": content if isinstance(content, str) else list(content)})
    if not out:
        raise ImageDataError(f"{loc}: {key} is an empty list of messages")
    return out


def as_messages(loc: str, key: str, value: Any, role: str) -> list[dict]:
    """A prompt or completion column as messages: a string is one `role` turn, a message or a list as given."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _checked(loc, key, [value] if isinstance(value, dict) else value)


def with_images(loc: str, messages: list[dict], row: dict[str, Any], image_key: str, base: Path | None
                ) -> tuple[list[dict], tuple]:
    """(the messages with content item lists, the sources of their images in order) by `with_row_images`; a row
    whose images land in a turn other than a user's (or system's) is one line."""
    got = with_row_images(loc, _Conversation(messages), row, image_key, base)
    for k, m in enumerate(got.messages):
        if m["role"] not in ("user", "system") and not isinstance(m["content"], str) and \
                any(i.get("type") == "image" for i in m["content"]):
            raise ImageDataError(f"{loc}: message {k} ({m['role']}) holds an image; images go in the prompt's user "
                                 f"turns only (move its {PLACEHOLDER} or image item into a user message)")
    return got.messages, tuple(got.images)


@dataclass(frozen=True)
class PicturedRow:
    """A row with images, read: the whole conversation (content item lists), where its prompt ends (None: a
    conversation trained on its assistant turns), and its images' sources in order."""

    messages: list
    prompt_len: int | None
    images: tuple


def read_image_row(loc: str, row: dict[str, Any], keys, base: Path | None) -> PicturedRow | None:
    """The row's conversation with its images (`keys`: `data.sft_rows.SFTKeys`), rendered by the processor's
    template: its messages (a response column appended as the last turn), or its prompt (a string: a user turn) and
    completion (an assistant turn; string ones with `keys.chat_template` alone). None: the row has no images."""
    column = image_column(row, keys.image)
    if column is None and keys.image != DEFAULT_KEY and _holds(row.get(DEFAULT_KEY)):
        raise ImageDataError(f"{loc}: the row has no {keys.image} column (image_key) but has {DEFAULT_KEY}; set "
                             f"image_key={DEFAULT_KEY}, or rename the column")
    listed = (row.get(k) for k in (keys.messages, keys.prompt, keys.response))
    if not _holds(column) and not any(names_images(v) for v in listed if v is not None):
        return None
    if keys.input_template is not None and not keys.chat_template:
        raise ImageDataError(f"{loc}: the row has images, which the processor's chat template places, and "
                             "input_template (OpenRLHF's text) has no place for them: set apply_chat_template=true, "
                             "or drop input_template")
    if keys.messages not in row and all(isinstance(row.get(k), str) for k in (keys.prompt, keys.response)) and \
            not keys.chat_template:
        # a text prompt and completion train as text (TRL's way), which has no place for an image; templating this
        # row alone would train one file two ways, so the one switch that templates them all is asked for, as
        # verl's SFT templates every row (its lines set it) and the RL side asks it for prompts with images
        raise ImageDataError(f"{loc}: rows with images go through the chat template, and this string prompt and "
                             "completion would train as text: set apply_chat_template=true")
    key = keys.messages if keys.messages in row else keys.prompt
    if keys.messages in row or (keys.prompt in row and keys.response in row):
        head = as_messages(loc, key, row[key], "user")
        tail = as_messages(loc, keys.response, row[keys.response], "assistant") if keys.response in row else []
    elif keys.prompt in row and not isinstance(row[keys.prompt], str):  # OpenRLHF: the last message the completion
        head = as_messages(loc, key, row[key], "user")
        head, tail = head[:-1], head[-1:]
        if tail[0]["role"] != "assistant":
            raise ImageDataError(f"{loc}: {key} holds messages and the row has no response column, so its last "
                                 f"message is the completion, but that one is {tail[0]['role']!r}, not 'assistant'")
    else:
        raise ImageDataError(f"{loc}: the row has images; images go with chat messages ({keys.messages}) or a prompt "
                             f"and completion ({keys.prompt}+{keys.response}), a plain text row has no place for them")
    for m in head + tail:
        check_message_keys(loc, key, m)
    if not any(m["role"] == "assistant" for m in head + tail):
        raise ImageDataError(f"{loc}: the row has no assistant message, so nothing to train on")
    messages, images = with_images(loc, head + tail, {keys.image: column}, keys.image, base)
    return PicturedRow(messages, None if keys.messages in row else len(head), images)


def _holds(value: Any) -> bool:
    """Whether an image column holds something (not None, not an empty list or array)."""
    return value is not None and (len(value) > 0 if hasattr(value, "__len__") else True)


def check_message_keys(loc: str, key: str, m: dict, tool_calls: bool = False) -> None:
    """A message marked untrained is refused, and one with a tool call unless `tool_calls` (the rows of text, which
    render them: `data.sft_tools`): trained on its role and content alone, it would be another row."""
    unread = ("tool_calls" if _holds(m.get("tool_calls")) and not tool_calls else
              "trainable" if "trainable" in m and m["trainable"] in (False, 0) else None)
    if unread is not None:
        raise DataError(f"{loc}: a message in {key} has {unread}, which alignrl train sft does not read (it "
                        "trains each message's role and content); drop it from the messages")


# ---- rendering with the images' tokens ----

VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>")  # Qwen2-VL's markers, which its processor does not name


def vision_ids(processor) -> tuple[int, ...]:
    """The ids only images may hold (image and video pads, their start and end markers): never a target, as the
    model's config names them (`models.vision.config_vision_token_ids`, from the processor here)."""
    named = [getattr(processor, k, None) for k in VISION_IDS]
    vocab = processor.tokenizer.get_vocab()
    return tuple(sorted({int(i) for i in named + [vocab.get(t) for t in VISION_TOKENS] if i is not None}))


@dataclass(frozen=True)
class RowPictures:
    """A row's images as a batch reads them: their sources and token counts, and the image processor that turns
    them into pixels again (`load`)."""

    loc: str
    sources: tuple
    counts: tuple  # each image's count of image tokens in the row
    image_processor: Any
    token_id: int  # the image token, whose copies in the row stand for these images
    vision_ids: tuple = ()  # `vision_ids`: never trained

    def load(self) -> PromptImages:
        """The row's pixel values, decoded and processed again; each image must give the tokens it was encoded
        with."""
        pictures = [decode_image(self.loc, s) for s in self.sources]
        got = processed(self.loc, self.image_processor, pictures, self.sources,
                        lambda: self.image_processor(images=pictures, return_tensors="pt"))
        grid = got["image_grid_thw"].long()
        counts = tuple((grid.prod(-1) // self.image_processor.merge_size ** 2).tolist())
        if counts != self.counts:  # the file changed since the row was encoded
            raise ImageDataError(f"{self.loc}: an image's size changed while training ({list(self.counts)} image "
                                 f"tokens are now {list(counts)}); keep the images unchanged during a run")
        return PromptImages(got["pixel_values"].float(), grid)

    def untrained(self, ids: list[int], trained: list[bool]) -> list[bool]:
        """`trained` with no vision token a target: with assistant_only_loss=false or completion_only_loss=false
        every other token of the row trains, but an image's tokens are the picture itself, which the model is never
        asked to write (TRL's vision-language SFT example masks them the same way)."""
        return [t and i not in self.vision_ids for i, t in zip(ids, trained)]

class ImageRenderer:
    """A tokenizer's `apply_chat_template(messages, add_generation_prompt, tokenize=True)` for one row with images:
    the processor's chat template renders the text, the tokenizer tokenises it, and the i-th image token becomes the
    i-th image's count of tokens (as the processor widens it). `data.sft_rows` finds the trained tokens through it
    as through a tokenizer."""

    def __init__(self, processor, counts: list[int], loc: str):
        self.processor, self.counts, self.loc = processor, counts, loc
        self.chat_template = chat_template_of(processor)
        self.image_id = processor.image_token_id

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True) -> list[int]:
        # named: a template kept on the tokenizer alone is one the processor's own call would not find
        text = self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, chat_template=self.chat_template)
        ids = list(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        out, seen = [], 0
        for t in ids:
            if t != self.image_id:
                out.append(t)
                continue
            if seen >= len(self.counts):
                raise self.mismatch(ids.count(self.image_id))
            out += [t] * self.counts[seen]
            seen += 1
        return out

    def mismatch(self, found: int) -> ImageDataError:
        return ImageDataError(f"{self.loc}: the chat template renders {found} image token(s) for the row's "
                              f"{len(self.counts)} image(s) (an image token in the text itself, or a template that "
                              "drops image items); give one image item or <image> per image")

    def check(self, ids: list[int]) -> None:
        """The whole row holds every image's tokens (a template may drop an image item it does not render)."""
        have = sum(t == self.image_id for t in ids)
        if have != sum(self.counts):
            raise ImageDataError(f"{self.loc}: the chat template renders {have} image tokens where the row's "
                                 f"{len(self.counts)} image(s) make {sum(self.counts)}; give one image item or "
                                 "<image> per image, in a user turn the template renders")


def renderer_for(tokenizer, loc: str, sources: tuple) -> tuple[ImageRenderer, RowPictures]:
    """The renderer of a row with images and its pictures; one line when the model is text-only or an image cannot be
    read or processed."""
    processor = getattr(tokenizer, PROCESSOR_ATTR, None)
    if processor is None:
        raise ImageDataError(f"{loc}: the row has images, but model_path is a text-only model; train a "
                             "vision-language model (e.g. Qwen2-VL), or drop the images from the data")
    counts = tuple(image_tokens(loc, processor.image_processor, k, s) for k, s in enumerate(sources))
    return ImageRenderer(processor, list(counts), loc), RowPictures(
        loc, tuple(sources), counts, processor.image_processor, processor.image_token_id, vision_ids(processor))


def image_tokens(loc: str, image_processor, k: int, source) -> int:
    """Image `k`'s count of tokens, from its size alone where the image processor tells it (Qwen2-VL's
    `get_number_of_image_patches`: the patches of the image resized within its min and max pixels), as the
    processor itself widens it; else by processing the image. Its pixels are decoded for each batch (`RowPictures`),
    as TRL's and verl's loaders decode them, so a file that is readable here but broken further in stops the run
    there, naming it."""
    merge = image_processor.merge_size ** 2
    if not hasattr(image_processor, "get_number_of_image_patches"):
        picture = decode_image(loc, source)
        got = processed(loc, image_processor, [picture], [source],
                        lambda: image_processor(images=[picture], return_tensors="pt"))
        return int(got["image_grid_thw"].long().prod(-1).sum()) // merge
    width, height = image_size(loc, source)
    try:
        return image_processor.get_number_of_image_patches(height, width, {}) // merge
    except ValueError as exc:  # an aspect ratio over 200...
        raise refused_image(loc, k, source, (width, height), exc) from None
