"""A prompt's images as compressed pictures for a JSON body: `/v1/generate_tokens`' picture form, which a service
processes itself (the embedded engine's processor, or vLLM's) instead of reading float32 pixel rows
(`data.images.images_to_json`, ten to twenty times the bytes).

Each picture travels as base64 of its PNG bytes (lossless, so the service's processor makes the pixel rows the
sender's made) with the grids the sender's processor made of it, which the service checks its own against: a
service that resizes images otherwise would give the prompt another number of image tokens than its ids hold.
Deliberately left out: lossy encodings (JPEG), videos.
"""

from __future__ import annotations

import io

from alignrl.data.images import ImageDataError, PromptImages, decode_image


def png_base64(picture) -> str:
    """A Pillow picture as base64 of its PNG bytes: lossless, so whoever processes it gets the pixel rows its
    sender's processor made (a JPEG's would differ)."""
    import base64

    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def pictures_to_json(prompt, encode=png_base64) -> dict | None:
    """A prompt's images as its pictures for a JSON body (/v1/generate_tokens' picture form), each `encode`d (base64
    PNG), with the grids its processor made of them; None for a prompt without images. A tenth to a twentieth of
    `images_to_json`'s pixel rows, and the form a service that processes images itself (vLLM) reads."""
    images = getattr(prompt, "images", None)
    if images is None:
        return None
    return {"pictures": [encode(p) for p in prompt.pictures], "image_grid_thw": images.image_grid_thw.tolist()}


def pictures_from_json(value: dict, what: str, max_pixels: int = 1 << 26) -> tuple[list, list]:
    """`pictures_to_json`'s form back: (RGB Pillow pictures, grids as lists); ImageDataError naming `what` and the
    picture when it is not that form, not an image, or over `max_pixels` pixels (checked before decoding)."""
    import base64
    import binascii

    from PIL import Image, UnidentifiedImageError

    form = ("send {pictures: [base64 PNG, ...], image_grid_thw: [[t, h, w], ...]}, one grid per picture, as "
            "data.images.pictures_to_json writes them")
    pictures, grids = value.get("pictures"), value.get("image_grid_thw")
    if (set(value) != {"pictures", "image_grid_thw"} or not isinstance(pictures, list) or not pictures
            or not isinstance(grids, list) or len(grids) != len(pictures)
            or not all(isinstance(g, list) and len(g) == 3 and all(type(x) is int and x > 0 for x in g)
                       for g in grids)):
        raise ImageDataError(f"{what}: images are not pictures with their grids; {form}")
    out = []
    for k, text in enumerate(pictures):
        try:
            raw = base64.b64decode(text, validate=True)
            with Image.open(io.BytesIO(raw)) as im:  # the header alone: a huge picture is refused before decoding
                size = im.size
        except (TypeError, ValueError, binascii.Error, OSError, UnidentifiedImageError) as exc:
            raise ImageDataError(f"{what}: picture {k} is not a base64 image ({type(exc).__name__}); {form}") from None
        if size[0] * size[1] > max_pixels:
            raise ImageDataError(f"{what}: picture {k} is {size[0]}x{size[1]}, over {max_pixels} pixels; send it "
                                 "resized as the trainer's processor resizes it (data.max_pixels)")
        out.append(decode_image(f"{what}: picture {k}", raw))
    return out, grids


def picture_images(processor, pictures, what: str) -> PromptImages:
    """Pictures as a vision-language model's `processor` makes them into pixel rows and grids (the images of a
    prompt that `encode_image_prompt` made); ImageDataError naming `what` when the processor cannot read one."""
    try:
        enc = processor.image_processor(images=list(pictures), return_tensors="pt")
    except Exception as exc:  # an image it cannot resize: a sliver (aspect ratio over 200), a few pixels
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise ImageDataError(f"{what}: the model's processor cannot read its pictures ({type(exc).__name__}: "
                             f"{first}); send pictures of at least a few pixels a side "
                             f"(sizes: {[p.size for p in pictures]})") from None
    return PromptImages(enc["pixel_values"].float(), enc["image_grid_thw"].long())
