"""Tokenisation and padding shared by the trainers and the rollout engines."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignrl.data.images import encode_image_prompt
from alignrl.errors import UserError
from alignrl.runtime.lanes import in_job_order, lanes_of, run_lanes


def prompt_ids(tokenizer, sample, tools: Sequence[dict] | None = None) -> list[int]:
    """The whole prompt of `sample` (records.Sample, or anything with `.messages`) as token ids: chat-templated, or
    its `prompt_text` tokenized as it is (no special tokens added, as OpenRLHF tokenizes its untemplated prompts).
    `tools`: OpenAI function schemas the template renders into the prompt (verl's tool loop), so that they count
    toward its length; None leaves the template's call as it is without them."""
    text = getattr(sample, "prompt_text", None)
    if text is not None:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    extra = {} if tools is None else {"tools": list(tools)}
    ids = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=True, **extra)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5 returns a BatchEncoding


class PromptTooLong(UserError):
    """A prompt over the length limit where the run asked to stop rather than truncate (data.truncation=error)."""


def encode_prompts(tokenizer, samples: Sequence, max_prompt_length: int, truncation: str = "left",
                   tools: Sequence[dict] | None = None) -> list[list[int]]:
    """Prompt ids of `samples`, truncated as `truncation` says (`truncate`; left keeps the generation prompt; a prompt
    with images loses its earliest text only); with `truncation="error"`, a longer prompt raises PromptTooLong naming
    its row instead. `tools`: the schemas templated into each text prompt (`prompt_ids`), cut with it."""
    out = []
    for s in samples:
        if getattr(s, "images", ()):  # image tokens are never cut: its own truncation (data.images)
            ids = encode_image_prompt(tokenizer, s, 1 << 30 if truncation == "error" else max_prompt_length)
        else:
            ids = prompt_ids(tokenizer, s, tools)
        if truncation == "error" and len(ids) > max_prompt_length:
            raise PromptTooLong(f"{getattr(s, 'source', None) or 'a row'}: its prompt is {len(ids)} tokens, over "
                                f"data.max_prompt_length={max_prompt_length} (data.truncation=error): raise the limit, "
                                "set data.filter_overlong_prompts=true to drop such rows, or data.truncation=left")
        out.append(truncate(ids, max_prompt_length, truncation))
    return out


def truncate(ids: list[int], max_len: int, how: str = "left") -> list[int]:
    """`ids` cut to `max_len` as verl's data.truncation: left keeps the last tokens, right the first, middle the first
    and last halves (the first half rounded down)."""
    if len(ids) <= max_len:
        return ids
    if how == "right":
        return ids[:max_len]
    if how == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    return ids[-max_len:]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and bool mask, padded on the left (prompts, so generation continues at column L)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and bool mask, padded on the right (responses, SFT targets)."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on each row's first real token (left padding aware)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padding_bounds(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column any row uses, response columns any row uses) for left/right padding."""
    p0 = int((~prompt_mask.any(0)).long().cumprod(0).sum())
    used = response_mask.any(0).nonzero()
    return p0, max(1, int(used.max()) + 1) if used.numel() else 1


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a row of each distinct prompt, the distinct prompt of each row): rows are the same prompt when their
    ids and mask agree column for column, which left padding to a common width makes exact."""
    key = torch.cat([prompt_ids.long(), prompt_mask.long()], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1 if len(rows) else 0,), len(rows), dtype=torch.long, device=rows.device)
    return first.scatter_reduce(0, inverse, rows, "amin"), inverse


def length_sorted_chunks(idx: torch.Tensor, prompt_mask: torch.Tensor, response_mask: torch.Tensor,
                         chunk: int, group: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Rows `idx` split into chunks of similar real length, so each chunk carries little padding. Given
    `group` (each row's prompt, from `prompt_groups`), the rows of one prompt are kept next to each other
    (ordered by prompt length, prompt, then response length), so a shared-prompt forward finds few distinct
    prompts in a chunk.

    Sums over chunks (token-mean losses with a global token count, per-row log-probs) do not depend
    on how rows are grouped, so this only saves compute."""
    if group is None:
        ordered = idx[torch.argsort(prompt_mask[idx].sum(-1) + response_mask[idx].sum(-1), stable=True)]
        return list(ordered.split(chunk))
    order = torch.argsort(response_mask[idx].sum(-1), stable=True)  # least significant key first
    order = order[torch.argsort(group[idx][order], stable=True)]
    order = order[torch.argsort(prompt_mask[idx][order].sum(-1), stable=True)]
    return list(idx[order].split(chunk))


def chunk_tokens(chunks: list[torch.Tensor], prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> list[float]:
    """Each chunk's real tokens (its rows' prompts and responses): the work a lane takes on with it."""
    return [float(prompt_mask[idx].sum() + response_mask[idx].sum()) for idx in chunks]


@torch.no_grad()
def per_token_in_chunks(model, fn, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                        response_mask: torch.Tensor, micro_batch: int, by_prompt: bool = False, images=None,
                        lanes: int = 1, outputs: int = 1) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """(B, R) per-token outputs of `fn(model, prompt_ids, prompt_mask, response_ids, response_mask)` in eval
    mode, `micro_batch` rows at a time, rows grouped by length (and by prompt with `by_prompt`) and each
    chunk trimmed of padding. With `images` (`data.images.ImageRows` of the B rows), `fn` also takes each
    chunk's rows of them as `images=`. `lanes` > 1 (text only): chunks run side by side (`runtime.lanes`); a batch
    of one chunk stays whole (one large forward already keeps a CPU's threads busy). `outputs` > 1: `fn` returns
    that many (rows, columns) tensors per chunk, and a tuple of that many (B, R) comes back."""
    was_training = model.training
    model.eval()
    outs = tuple(torch.zeros(response_ids.shape) for _ in range(outputs))
    group = prompt_groups(prompt_ids, prompt_mask)[1] if by_prompt else None
    chunks = length_sorted_chunks(torch.arange(outs[0].shape[0]), prompt_mask, response_mask, micro_batch, group)

    def run(idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pm, rm = prompt_mask[idx], response_mask[idx]
        p0, r1 = padding_bounds(pm, rm)
        extra = {} if images is None else {"images": images.select(idx)}
        values = fn(model, prompt_ids[idx, p0:], pm[:, p0:], response_ids[idx, :r1], rm[:, :r1], **extra)
        return (values,) if outputs == 1 else tuple(values)

    plan = lanes_of(chunk_tokens(chunks, prompt_mask, response_mask), 1 if images is not None else lanes)
    done = run_lanes([lambda part=part: [run(chunks[i]) for i in part] for part in plan])
    for idx, values in zip(chunks, in_job_order(plan, done)):  # written here, in one thread
        for out, value in zip(outs, values, strict=True):
            out[idx, :value.shape[1]] = value.to(out.device)
    model.train(was_training)
    return outs[0] if outputs == 1 else outs
