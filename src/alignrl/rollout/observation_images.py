"""Observations that carry images (verl's tools returning `ToolResponse(image=[...])`): the checks of what an
environment or tool returned, and the observation's ids with its images' tokens, as a vision-language model's
processor expands them.

An observation's text holds one image placeholder per image (the chat template renders a `{"type": "image"}` item of
the tool message as Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`); the processor widens each placeholder
to that image's tokens and returns its patches and grid. The row then reads its prompt's images followed by its
observations' in order (`agent._Row.images`), for the next turns and for the trainer's forwards alike.
"""

from __future__ import annotations

from typing import Any

from alignrl.data.images import PromptImages, to_rgb
from alignrl.errors import UserError
from alignrl.models.vision import processor_of

RETURN_IMAGES = "return Pillow images (PIL.Image.Image), as verl's tools do, e.g. ToolResponse(image=[image])"


def given_media(media: Any) -> bool:
    """Whether a response's image or video field holds something: None and an empty list are nothing, as in verl; an
    array or tensor (whose truth value is ambiguous) is something, for the check that names what to return."""
    return media is not None and not (isinstance(media, (list, tuple, str)) and not media)


def pictures_of(value: Any, what: str, error: type[UserError]) -> list:
    """`value` (the images an observation returned) as a list of RGB Pillow images; `error` naming `what` (the tool
    or the environment's step) for anything else: verl's tools return a list of Pillow images."""
    from PIL import Image

    items = [value] if isinstance(value, Image.Image) else value
    if not isinstance(items, (list, tuple)):
        raise error(f"{what} returned image {type(value).__name__} {str(value)[:60]!r}; {RETURN_IMAGES}")
    bad = next((v for v in items if not isinstance(v, Image.Image)), None)
    if bad is not None:
        raise error(f"{what} returned image {type(bad).__name__} {str(bad)[:60]!r}, not a Pillow image; "
                    f"{RETURN_IMAGES}")
    return [to_rgb(v) for v in items]  # as the prompts' images are decoded


def needs_vision(tokenizer, what: str, error: type[UserError]) -> None:
    """`error` naming `what` when the policy (its `tokenizer`) is a text-only model: it cannot read images."""
    if processor_of(tokenizer) is None:
        raise error(f"{what} returned image, but the policy is a text-only model: set model.path to a vision-language "
                    "model (e.g. Qwen2-VL), or return the response as text")


def observation_ids(tokenizer, text: str, pictures: list, what: str,
                    error: type[UserError]) -> tuple[list[int], PromptImages]:
    """The ids of observation `text` with each of its image placeholders widened to its picture's image tokens, and
    those pictures as the model reads them. `error` naming `what` when the policy is text-only or the text's
    placeholders do not match the pictures (a chat template that drops image items, a tool text holding one)."""
    needs_vision(tokenizer, what, error)
    processor = processor_of(tokenizer)
    check_placeholders(tokenizer, text, len(pictures), what, error)
    try:  # no special tokens: the observation follows the response's ids, as text feedback is encoded
        enc = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
    except Exception as exc:  # an image the processor cannot resize: a sliver (aspect ratio over 200), 0 pixels
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise error(f"{what} returned an image the model's processor cannot read ({type(exc).__name__}: {first}); "
                    f"return images of at least a few pixels a side (sizes: {[p.size for p in pictures]})") from None
    images = PromptImages(enc["pixel_values"].float(), enc["image_grid_thw"].long())
    return enc["input_ids"][0].tolist(), images


def check_placeholders(tokenizer, text: str, count: int, what: str, error: type[UserError]) -> None:
    """`error` naming `what` unless observation `text` holds exactly `count` image placeholders (none for a text
    observation): a placeholder without its image would fail a turn later, in a forward that cannot say whose it is."""
    processor = processor_of(tokenizer)
    marks = text.count(processor.image_token) if processor is not None else 0
    if marks != count:
        raise error(f"{what} returned {count} image(s) but its observation text holds {marks} image "
                    f"placeholder(s) ({processor.image_token}); the chat template must render each "
                    "{'type': 'image'} item once, and the text itself must hold no placeholder")
