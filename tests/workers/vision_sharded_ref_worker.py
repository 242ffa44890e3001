"""One rank of the sharded vision-language reference test (torchrun, two gloo ranks): the tiny Qwen2-VL model
sharded over the ranks (its image encoder's blocks too) scores image prompts in uneven shares, so one rank pads
with forwards that must run the image encoder as the other's image micro-batches do; each rank compares its rows
with a whole copy. `--mixed`: rank 1's prompts are text-only, so its forwards run the encoder on a blank patch."""

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from alignrl.config import RunConfig
from alignrl.data.collate import left_pad, right_pad
from alignrl.data.images import encode_image_prompt, prompt_images
from alignrl.data.records import Sample
from alignrl.models.loader import frozen_copy, load_model
from alignrl.placements.sharded_ref import build_sharded_ref
from alignrl.rl.producer import LocalRefScorer
from alignrl.runtime.env import barrier, init_distributed, shutdown


def image_rows(tokenizer, folder: Path, n: int):
    """`n` prompts with one picture each (different colours and sizes), and responses of varied lengths."""
    prompts, responses = [], []
    for i in range(n):
        path, part = folder / f"p{i}.png", folder / f"p{i}.png.{os.getpid()}"
        # every rank writes the same pictures: each whole through a rename, so no rank reads another's half-written one
        Image.new("RGB", (28 * (1 + i % 2), 56), (40 * i, 255 - 30 * i, 90)).save(part, format="PNG")
        os.replace(part, path)
        content = [{"type": "image"}, {"type": "text", "text": f"What is in picture {i}?"}]
        prompts.append(encode_image_prompt(tokenizer, Sample([{"role": "user", "content": content}], "x",
                                                             images=(str(path),)), 256))
        responses.append(list(range(10, 12 + i % 3)))
    pids, pmask = left_pad(prompts, tokenizer.pad_token_id)
    rids, rmask = right_pad(responses, tokenizer.pad_token_id)
    return (pids, pmask, rids, rmask), prompt_images(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixed", action="store_true")
    a = ap.parse_args()
    env = init_distributed("cpu")
    cfg = RunConfig()
    cfg = replace(cfg, model=replace(cfg.model, path=a.model, dtype="float32"),
                  actor=replace(cfg.actor, logprob_micro_batch_size=2))
    sharded = build_sharded_ref(cfg, env)
    whole, tokenizer = load_model(a.model, "float32")
    whole = frozen_copy(whole)
    local = LocalRefScorer(whole, cfg.rollout.temperature, 2)
    batch, images = image_rows(tokenizer, Path(a.out).parent, 5)
    if a.mixed:  # rank 1's rows are text: the same token ids with the image tokens replaced by plain ones
        plain = batch[0].masked_fill(batch[0] == whole.config.image_token_id, 11)
        batch, images = (batch, images) if env.rank == 0 else ((plain, *batch[1:]), None)
    worst = 0.0
    # (rank 0's rows, rank 1's rows): 3 micro-batches against 1, then none against 3
    for share in ((slice(0, 5), slice(1, 3)), (slice(0, 0), slice(0, 5))):
        idx = range(5)[share[env.rank]]
        mine = tuple(t[share[env.rank]] for t in batch)
        mine_images = images.select(idx) if images is not None and len(idx) else None
        got = sharded.logprobs(*mine, images=mine_images)
        want = local.logprobs(*mine, images=mine_images) if len(idx) else torch.zeros(mine[2].shape)
        assert got.shape == want.shape, (got.shape, want.shape)
        worst = max(worst, float((got - want).abs().max()) if got.numel() else 0.0)
    with open(f"{a.out}.{env.rank}.json", "w") as f:
        json.dump({"worst": worst}, f)
    # both ranks past their last collective before the group goes: a rank that exited while the other's gloo threads
    # still ran aborted ("terminate called without an active exception")
    barrier(env)
    shutdown()


if __name__ == "__main__":
    main()
