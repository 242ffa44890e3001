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

MAX_PICTURE_PIXELS = 1 << 26  # one picture's pixels (a 8192 x 8192 one decodes to 200 MB of RGB)
MAX_REQUEST_PIXELS = 1 << 27  # all pictures of one request: what it may make the service decode (400 MB of RGB)


class PixelBudget:
    """The pixels a request's pictures may still decode to, counted from their headers before any is decoded: a
    PNG of one colour is a few hundred kB for 8000 x 8000 pixels, so the body's size does not bound them."""

    def __init__(self, pixels: int = MAX_REQUEST_PIXELS):
        self.total = self.left = pixels

    def take(self, pixels: int, what: str) -> None:
        if pixels > self.left:
            raise ImageDataError(f"{what}: the request's pictures exceed {self.total} pixels in all; send "
                                 "them resized as the trainer's processor resizes them (data.max_pixels), or fewer "
                                 "prompts a request")
        self.left -= pixels


def png_base64(picture) -> str:
    """A Pillow picture as base64 of its PNG bytes: lossless, so whoever processes it gets the pixel rows its
    sender's processor made (a JPEG's would differ)."""
    import base64

    buf = io.BytesIO()
    picture.save(buf, format="PNG", compress_level=1)  # fast: a lower level costs seconds a photo, saves little
    return base64.b64encode(buf.getvalue()).decode()


def pictures_to_json(prompt, encode=png_base64) -> dict | None:
    """A prompt's images as its pictures for a JSON body (/v1/generate_tokens' picture form), each `encode`d (base64
    PNG), with the grids its processor made of them; None for a prompt without images. A tenth to a twentieth of
    `images_to_json`'s pixel rows, and the form a service that processes images itself (vLLM) reads."""
    images = getattr(prompt, "images", None)
    if images is None:
        return None
    return {"pictures": [encode(p) for p in prompt.pictures], "image_grid_thw": images.image_grid_thw.tolist()}


def pictures_from_json(value: dict, what: str, max_pixels: int = MAX_PICTURE_PIXELS,
                       budget: PixelBudget | None = None) -> tuple[list, list]:
    """`pictures_to_json`'s form back: (RGB Pillow pictures, grids as lists); ImageDataError naming `what` and the
    picture when it is not that form, not a PNG, over `max_pixels` pixels or over the request's `budget` (both
    checked from the header, before decoding)."""
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
    out, budget = [], budget or PixelBudget()
    for k, text in enumerate(pictures):
        try:
            raw = base64.b64decode(text, validate=True)
            # the header alone: a huge picture is refused before decoding (Pillow's own bomb check raises on some)
            with Image.open(io.BytesIO(raw), formats=["PNG"]) as im:
                size = im.size
        except Image.DecompressionBombError:
            size = (max_pixels + 1, 1)
        except (TypeError, ValueError, binascii.Error, OSError, UnidentifiedImageError) as exc:
            raise ImageDataError(f"{what}: picture {k} is not a base64 PNG ({type(exc).__name__}); {form}") from None
        if size[0] * size[1] > max_pixels:
            raise ImageDataError(f"{what}: picture {k} is over {max_pixels} pixels; send it resized as the trainer's "
                                 "processor resizes it (data.max_pixels)")
        budget.take(size[0] * size[1], f"{what}: picture {k}")
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
