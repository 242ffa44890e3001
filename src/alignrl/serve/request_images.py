"""The images of a `/v1/generate_tokens` request's prompts, in either of the two forms a client sends per prompt:

* pictures: `{"pictures": [base64 PNG, ...], "image_grid_thw": [[t, h, w], ...]}` (`data.picture_json`), what
  `RemoteRolloutEngine` sends when every image prompt carries its decoded pictures. The service processes them with
  its model's processor and checks the grids it gets against the request's; the prompt then carries both the pixel
  rows (the embedded engine, the image-token check) and the pictures (vLLM's `multi_modal_data`);
* pixel rows: `{"pixel_values": base64 float32, "shape": [rows, width], "image_grid_thw": ...}`
  (`data.images.images_to_json`), the older form, still read by the embedded engine. vLLM reads pictures only, so a
  vLLM service answers it with a one-line 400 naming the picture form.

Every mistake is a one-line 400 naming the prompt. Deliberately left out: images by URL (the OpenAI chat endpoint
takes those), videos.
"""

from __future__ import annotations

from collections.abc import Sequence

from alignrl.serve.common import RequestError

PICTURE_FORM = ("send its images as pictures, {pictures: [base64 PNG, ...], image_grid_thw: [[t, h, w], ...]} "
                "(RemoteRolloutEngine does when its prompts carry their pictures)")


def image_prompts(req, tokenizer, engine=None) -> list[list[int]]:
    """The prompts of `req` (a TokensRequest), each with its images for a vision-language model (an ImagePrompt); 400
    when images come for a text-only model, as pixel rows for an `engine` that reads only pictures (vLLM), as pictures
    the server's processor grids otherwise than the sender's, or when a prompt's image tokens are not its images'
    (image tokens without images included: the model would read the placeholders' embeddings as pictures)."""
    from alignrl.data.images import PROCESSOR_ATTR

    given = req.images
    if given is not None and len(given) != len(req.prompts):
        raise RequestError(f"images has {len(given)} entries for {len(req.prompts)} prompts; give one (or null) "
                           "per prompt")
    processor = getattr(tokenizer, PROCESSOR_ATTR, None)
    if processor is None:
        if given is not None and any(x is not None for x in given):
            raise RequestError("images need a vision-language model; this server's model is text-only")
        return req.prompts
    from alignrl.data.picture_json import PixelBudget

    pictures_only, budget = getattr(engine, "needs_pictures", False), PixelBudget()
    prompts = req.prompts if given is None else [
        p if x is None else with_images(i, p, x, processor, pictures_only, budget)
        for i, (p, x) in enumerate(zip(req.prompts, given))]
    check_image_tokens(prompts, processor)
    return prompts


def with_images(i: int, ids: list[int], value, processor, pictures_only: bool, budget=None):
    """Prompt `i`'s ids with its images (an ImagePrompt), from either form; `budget`: the request's pixels left
    (`data.picture_json.PixelBudget`). The pictures stay with the prompt only for an engine that reads them."""
    from alignrl.data.images import ImageDataError, ImagePrompt, images_from_json
    from alignrl.data.picture_json import picture_images, pictures_from_json

    what = f"prompt {i}"
    if not isinstance(value, dict):
        raise RequestError(f"{what}: images is {type(value).__name__}, not an object (or null); {PICTURE_FORM}")
    try:
        if "pictures" not in value:
            if pictures_only:
                raise RequestError(f"{what}: this server generates with vLLM, which reads images as pictures, not "
                                   f"pixel rows; {PICTURE_FORM}")
            return ImagePrompt(ids, images_from_json(value, what))
        pictures, grids = pictures_from_json(value, what, budget=budget)
        images = picture_images(processor, pictures, what)
    except ImageDataError as e:
        raise RequestError(str(e)) from None
    made = images.image_grid_thw.tolist()
    if made != grids:
        raise RequestError(f"{what}: this server's processor grids its pictures as {made}, the request's say "
                           f"{grids}: the server resizes images otherwise than the trainer; start it with the "
                           "trainer's bounds (alignrl serve generate --min_pixels/--max_pixels as data.min_pixels/"
                           "data.max_pixels)")
    return ImagePrompt(ids, images, tuple(pictures) if pictures_only else ())


def check_image_tokens(prompts: Sequence[Sequence[int]], processor) -> None:
    """400 unless each prompt holds as many image tokens as its images make (none without images)."""
    merge = processor.image_processor.merge_size ** 2
    for i, p in enumerate(prompts):
        want = 0 if getattr(p, "images", None) is None else int(p.images.image_grid_thw.prod(-1).sum()) // merge
        have = sum(t == processor.image_token_id for t in p)
        if want != have:
            raise RequestError(f"prompt {i} has {have} image tokens but its images make {want}; send the ids the "
                               "processor made with these images")
