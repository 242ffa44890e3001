"""Supervised fine-tuning of a vision-language model (Qwen2-VL) on rows with images (`data.sft_images`): what
`preference.sft` adds for them.

A batch's images travel beside its ids (`SFTBatch.images`) and go into the forward as the RL forwards take them
(`models.vision.vision_inputs`: pixel values, patch grids, M-RoPE position ids). Every forward of a vision-language
model runs under `models.vision.encoder_in_every_forward`, so that ranks whose micro-batches hold no image still run
the image encoder that another rank's runs (DDP's, FSDP2's and ZeRO-3's collectives pair up). The whole model
trains, image encoder included, as TRL's and verl's SFT train it (with `use_lora`, the adapters alone). The saved
folder holds the processor beside the model, so `models.vision.load_processor` and RL load it. Packing is for text
rows only, and a row cut inside its images is refused (`data.sft_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.data.sft_rows import EncodedRow, SFTBatch, SFTRow
from alignrl.models.vision import encoder_in_every_forward, processor_of, save_processor, vision_inputs


def forward_images(model, batch: SFTBatch):
    """The context of a forward of `batch`: a vision-language model's image encoder runs in it on every rank."""
    return encoder_in_every_forward(model, batch.images)


def image_inputs(model, batch: SFTBatch) -> dict:
    """The forward's keyword arguments for the batch's images ({} without images)."""
    return vision_inputs(model, batch.input_ids, batch.attention_mask, batch.images)


def with_images(rows: Sequence[EncodedRow | SFTRow]) -> int:
    """How many of the rows (read or encoded) have images."""
    return sum(bool(e.images) for e in rows)


def check_not_packed(rows: Sequence[EncodedRow | SFTRow], packed: bool, which: str) -> None:
    """Packing lays rows end to end with restarting 1-D position ids, which a row's M-RoPE image positions cannot
    take: refused in one line for rows with images (checked on the rows read, before any is encoded)."""
    if packed and with_images(rows):
        raise ConfigError(f"packing is text-only, and {with_images(rows)} {which} rows have images: set "
                          f"{'eval_packing' if which == 'held-out' else 'packing'}=false")


def images_untrained(got: tuple[list[EncodedRow], int, int]) -> tuple[list[EncodedRow], int, int]:
    """`data.sft_rows.encode_rows`' (rows, cut, dropped) with no vision token of a row with images a target
    (`RowPictures.untrained`: assistant_only_loss=false and completion_only_loss=false train every other token); a
    row left with none is dropped."""
    encoded, cut, dropped = got
    kept = [replace(e, trained=e.images.untrained(e.ids, e.trained)) if e.images is not None else e for e in encoded]
    out = [replace(e, index=i) for i, e in enumerate(k for k in kept if k.n_trained)]
    return out, cut, dropped + len(kept) - len(out)


def held_out_batch(collate, rows: list[EncodedRow]):
    """A held-out batch of `rows`: text rows collated now, rows with images when the evaluation runs it (a
    zero-argument function), so that their pixels are decoded for that forward alone, as training's are, and never
    held for the run."""
    return partial(collate, rows, 0.0) if with_images(rows) else collate(rows, 0.0)


def cut_left(e: EncodedRow, max_length: int) -> EncodedRow:
    """`e` with its first tokens dropped down to `max_length` (truncation=left); a row whose images (or their start
    and end markers) lie in the dropped part is refused in one line (its image tokens would no longer match its
    images)."""
    dropped = set(e.ids[:len(e.ids) - max_length])
    if e.images is not None and dropped & set(e.images.vision_ids or (e.images.token_id,)):
        raise ConfigError(f"{e.images.loc}: truncation=left would cut the row's image tokens (max_length="
                          f"{max_length}, the row {len(e.ids)} tokens); raise max_length, or set truncation=right")
    return replace(e, ids=e.ids[-max_length:], trained=e.trained[-max_length:])


class _ProcessorSaver:
    """What `common.save_hf_folder` saves as the tokenizer: the whole processor (tokenizer, image processor,
    chat template), naming Qwen2VLProcessor for AutoProcessor."""

    def __init__(self, processor):
        self.processor = processor

    def save_pretrained(self, folder) -> None:
        save_processor(self.processor, Path(folder))


def saved_tokenizer(tok):
    """The tokenizer to save: a vision-language model's whole processor, or the tokenizer itself."""
    processor = processor_of(tok)
    return tok if processor is None else _ProcessorSaver(processor)
