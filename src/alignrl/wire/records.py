"""A ScoredBatch as a wire message, under the field names the ZeroMQ pipeline's users know.

Tensors (B rows, P prompt columns left-padded, R response columns right-padded):

    prefix_token_ids (B, P) long, prefix_mask (B, P) bool      the prompt
    generated_token_ids (B, R) long, generated_mask (B, R) bool  the response (attention mask)
    loss_mask (B, R) bool                                        the tokens trained on (within generated_mask)
    policy_mask (B, R) bool                                      the tokens the policy sampled (absent: all of
                                                                 generated_mask; a multi-turn rollout's
                                                                 tool observations are not)
    old_policy_log_probs (B, R) float                            the sampler's log-probs of its own tokens
    ref_policy_log_probs (K, R) float                            reference log-probs of the first K <= B rows
                                                                 (absent without a KL term; the trainer computes
                                                                 the other rows: pipeline.ref_logprobs)
    reward (B,) float, correct (B,) bool, cost (B,), baseline (B,)  the reward stage (cost/baseline optional)
    is_finished (B,) bool                                        ended with eos/stop (not truncated)
    group (B,) long, prompt_index (B,) long, sample_index (B,) long
    image_counts (B,) long, image_grid_thw (N, 3) long,          the prompts' images (absent: none has any):
    image_pixel_values (M, D) float                              row i's are the next image_counts[i] grids,
                                                                 and their t*h*w patch rows, in row order

meta: lease, step, version, sampler_id, metrics (the sampler's own), wait_s, and `prefix` / `text` (the
decoded prompt and response of each row, for people and logs; the trainer trains on the ids, never on text).
`seed_rows` rebuilds the seed's per-sample dicts (`prefix_tokens`, `whole_token_ids`, `reward_info`...).
"""

from __future__ import annotations

import torch

from alignrl.data.images import ImageRows, PromptImages
from alignrl.data.records import Rollout, ScoredBatch, Scores
from alignrl.wire.frames import Message, WireError

KIND = "scored_batch"
REQUIRED = ("prefix_token_ids", "prefix_mask", "generated_token_ids", "generated_mask", "loss_mask",
            "old_policy_log_probs", "reward", "correct", "is_finished", "group", "prompt_index")


def to_wire(batch: ScoredBatch, tokenizer, **meta) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of `batch`; extra `meta` (lease, step, wait_s...) rides along."""
    ro, s = batch.rollout, batch.scores
    tensors = {"prefix_token_ids": ro.prompt_ids, "prefix_mask": ro.prompt_mask,
               "generated_token_ids": ro.response_ids, "generated_mask": ro.response_mask,
               "loss_mask": batch.loss_mask, "old_policy_log_probs": ro.logprobs, "reward": s.rewards,
               "correct": s.correct, "is_finished": ~ro.truncated, "group": ro.group,
               "prompt_index": batch.prompt_index, "sample_index": batch.sample_index}
    for name, t in (("ref_policy_log_probs", batch.ref_logprobs), ("cost", s.costs), ("baseline", s.baseline),
                    ("policy_mask", ro.loss_mask)):
        if t is not None:
            tensors[name] = t
    if ro.images is not None:
        tensors.update(images_to_wire(ro.images))
    pad = tokenizer.pad_token_id
    prefix: dict[int, str] = {}  # a group's rows share their prompt: decode it once
    for i, g in enumerate(ro.group.tolist()):
        if g not in prefix:
            prefix[g] = tokenizer.decode(ro.prompt_ids[i][ro.prompt_mask[i]])
    texts = {"prefix": [prefix[g] for g in ro.group.tolist()],
             "text": tokenizer.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, pad),
                                            skip_special_tokens=True)}
    return {"version": batch.version, "sampler_id": batch.sampler_id, "metrics": batch.metrics, **texts,
            **meta}, tensors


def from_wire(msg: Message) -> ScoredBatch:
    """The batch in `msg` (tensors copied out of the receive buffers); WireError if it is not one."""
    if msg.kind != KIND:
        raise WireError(f"expected a {KIND!r} message on the data port, got {msg.kind!r}")
    t = msg.tensors
    missing = [k for k in REQUIRED if k not in t]
    if missing:
        raise WireError(f"scored batch lacks tensor(s) {', '.join(missing)}: the sampler runs another alignrl version")
    for name in ("prefix_token_ids", "generated_token_ids"):
        if t[name].dim() != 2:
            raise WireError(f"scored batch tensor {name!r} has shape {list(t[name].shape)}, expected [rows, tokens]")
    b = int(t["reward"].shape[0]) if t["reward"].dim() == 1 else -1
    p, r = (t["prefix_token_ids"].shape[-1], t["generated_token_ids"].shape[-1])
    want = {"prefix_token_ids": (b, p), "prefix_mask": (b, p), "generated_token_ids": (b, r), "generated_mask": (b, r),
            "loss_mask": (b, r), "policy_mask": (b, r), "old_policy_log_probs": (b, r),
            "correct": (b,),
            "is_finished": (b,), "group": (b,), "prompt_index": (b,), "cost": (b,), "baseline": (b,)}
    for name, shape in want.items():
        if name in t and tuple(t[name].shape) != shape:
            raise WireError(f"scored batch tensor {name!r} has shape {list(t[name].shape)}, expected {list(shape)}")
    ref = t.get("ref_policy_log_probs")  # the first K <= B rows; the trainer computes the rest (ref_share)
    if ref is not None and (ref.dim() != 2 or ref.shape[0] > b or ref.shape[1] != r):
        raise WireError(f"scored batch tensor 'ref_policy_log_probs' has shape {list(ref.shape)}, expected "
                        f"[K, {r}] with K <= {b}")
    version = msg.meta.get("version")
    if type(version) is not int or version < 0:
        raise WireError(f"scored batch has version {version!r}, not a non-negative int")
    c = {k: v.clone() for k, v in t.items()}  # own the memory: the frames go back to ZeroMQ
    opt = lambda k, dtype=torch.float32: c[k].to(dtype) if k in c else None  # noqa: E731
    ro = Rollout(c["prefix_token_ids"].long(), c["prefix_mask"].bool(), c["generated_token_ids"].long(),
                 c["generated_mask"].bool(), c["old_policy_log_probs"].float(), ~c["is_finished"].bool(),
                 c["group"].long(), loss_mask=c["policy_mask"].bool() if "policy_mask" in c else None,
                 images=images_from_wire(c, b) if "image_counts" in c else None)
    scores = Scores(c["reward"].float(), c["correct"].bool(), opt("cost"), opt("baseline"))
    metrics = msg.meta.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise WireError(f"scored batch has metrics of type {type(metrics).__name__}, not a map of names to numbers")
    return ScoredBatch(ro, scores, c["loss_mask"].bool(), opt("ref_policy_log_probs"), c["prompt_index"].long(),
                       version, str(msg.meta.get("sampler_id", "?")),
                       {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})


def images_to_wire(images: ImageRows) -> dict[str, torch.Tensor]:
    """The rows' images as three flat tensors (the module docstring); rows without images count 0."""
    counts = torch.tensor([0 if r is None else len(r.image_grid_thw) for r in images.rows], dtype=torch.long)
    if not images.any():
        return {"image_counts": counts}
    pixels, grid = images.batch()
    return {"image_counts": counts, "image_grid_thw": grid.long(), "image_pixel_values": pixels.contiguous()}


def images_from_wire(t: dict[str, torch.Tensor], rows: int) -> ImageRows:
    """`images_to_wire`'s tensors back as per-row images; WireError when they do not add up."""
    counts = t["image_counts"]
    if counts.dim() != 1 or counts.shape[0] != rows or bool((counts < 0).any()):
        raise WireError(f"scored batch tensor 'image_counts' has shape {list(counts.shape)} or negative counts, "
                        f"expected [{rows}] counts")
    n = int(counts.sum())
    grid = t.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.long)).long()
    pixels = t.get("image_pixel_values", torch.zeros((0, 0)))
    if grid.dim() != 2 or grid.shape != (n, 3) or bool((grid < 1).any()) or pixels.dim() != 2:
        raise WireError(f"scored batch image tensors do not match image_counts ({n} images; grid "
                        f"{list(grid.shape)}, pixels {list(pixels.shape)})")
    patches = grid.prod(-1)
    if int(patches.sum()) != pixels.shape[0]:
        raise WireError(f"scored batch image_pixel_values has {pixels.shape[0]} rows, its grids make "
                        f"{int(patches.sum())}")
    out, image, patch = [], 0, 0
    for k in counts.tolist():
        if k == 0:
            out.append(None)
            continue
        size = int(patches[image:image + k].sum())
        out.append(PromptImages(pixels[patch:patch + size].float(), grid[image:image + k]))
        image, patch = image + k, patch + size
    return ImageRows(out)


def seed_rows(msg: Message, tokenizer) -> list[dict]:
    """The batch as the ZeroMQ pipeline's per-sample dicts (what `communication_test.py` prints)."""
    t, meta = msg.tensors, msg.meta
    rows = []
    for i in range(int(t["reward"].shape[0])):
        prefix_ids = t["prefix_token_ids"][i][t["prefix_mask"][i].bool()].tolist()
        gen_mask = t["generated_mask"][i].bool()
        gen_ids = t["generated_token_ids"][i][gen_mask].tolist()
        info = {"correct": float(t["correct"][i])}
        for k in ("cost", "baseline"):
            if k in t:
                info[k] = float(t[k][i])
        ref = t.get("ref_policy_log_probs")
        rows.append({"prefix": meta["prefix"][i], "prefix_tokens": tokenizer.convert_ids_to_tokens(prefix_ids),
                     "prefix_token_ids": prefix_ids, "generated_token_ids": gen_ids,
                     "whole_token_ids": prefix_ids + gen_ids, "is_finished": bool(t["is_finished"][i]),
                     "text": meta["text"][i], "reward": float(t["reward"][i]), "reward_info": info,
                     "old_policy_log_probs": t["old_policy_log_probs"][i][gen_mask].numpy(),
                     "ref_policy_log_probs": ref[i][gen_mask].numpy() if ref is not None and i < len(ref)
                     else None})
    return rows
