"""Packed micro-batches, the packed dataset and NEFTune for supervised fine-tuning (`alignrl train sft packing=true`,
`packing_strategy=bfd|bfd_split|wrapped`, `neftune_noise_alpha=5`).

The packed dataset (`pack_dataset`, TRL's `packing=True`): before batching, the training rows are packed into rows
of at most `max_length` tokens, best fit decreasing as TRL bins them (`dataset_bins`), each packed row then keeping
its rows apart by their lengths (`EncodedRow.lengths`, laid out by `collate_bins`), or wrapped: end to end, cut every
`max_length` tokens. bfd_split bins as bfd, but a row longer than `max_length` is first cut into pieces of
`max_length` tokens from its start (`split_pieces`), each binned as a row of its own, where bfd keeps only the first.
The micro-batches then take packed rows; with TRL's `eval_packing` the held-out rows are packed the same way.

Packing a micro-batch (OpenRLHF's `--packing_samples`, TRL's `padding_free`): the rows of a micro-batch are laid end
to end, best fit decreasing, into sequences of at most `max_length` tokens, and each row's position ids start again
at 0. With no attention mask, transformers (5.x, `masking_utils.find_packed_sequence_indices`) reads the restarts as
sequence boundaries and builds a block-diagonal causal mask for sdpa, eager and flex attention, so no token sees
another row; flash attention takes the same position ids as varlen boundaries when the batch is one row, so for it
every sequence of the micro-batch goes into one row. A row's first token is never a target, so no label crosses a
boundary. The micro-batch holds the same rows as unpacked, so a step's loss (the token mean over its trained tokens)
and its update are the padded step's; only padding leaves the forward (LoRA's dropout and NEFTune draw over the
packed tensors: the same in distribution, not draw for draw). Sequences shorter than the longest are filled at their
end by a segment of their own (position ids from 0, never attended to by a row, never trained). `check_packable`
runs one small forward before training to make sure the model's attention keeps packed rows apart, and refuses in
one line when it does not.

NEFTune (TRL's `neftune_noise_alpha`, Jain et al. 2023): in training, uniform noise in [-s, s] with
s = alpha / sqrt(L * d) is added to the input embeddings, L being the row's own length (no padding) and d the
hidden size; never in evaluation. The draws come from a generator seeded by the micro-batch's key (the seed
`common.train_pairs` sets before each micro-batch), so a resumed run draws what the unbroken run drew. The hook
comes off after training (`NEFTune.remove`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence

import torch

from alignrl.config import ConfigError
from alignrl.data.sft_rows import EncodedRow, SFTBatch


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Positions of `lengths` in bins of at most `capacity` tokens, best fit decreasing: longest first, each into
    the fullest bin it still fits (a longer one gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda k: (room[k], k))
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


# rows packed at a time: TRL packs through `datasets.map(batched=True)`, whose batches are 1000 rows, so its bins (and
# its wrapped cuts) never mix rows of two such blocks
PACK_BLOCK = 1000


def dataset_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Positions of `lengths` in bins of at most `capacity` tokens, as TRL's `pack_dataset(strategy="bfd")` bins
    them: longest first (equal lengths in their order), each into the bin whose room left is the least that still
    fits it, of two bins with that room the one that got to it first, a new bin when none fits."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # the rooms of the bins not full, sorted
    by_room: dict[int, deque[int]] = {}  # room -> the bins with it, in the order they got it
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[i]
        at = bisect_left(rooms, n)
        if at < len(rooms):
            room, b = rooms[at], by_room[rooms[at]].popleft()
            if not by_room[room]:
                del by_room[room], rooms[at]
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            if room - n not in by_room:
                insort(rooms, room - n)
                by_room[room - n] = deque()
            by_room[room - n].append(b)
    return bins


def split_pieces(rows: Sequence[EncodedRow], capacity: int) -> list[EncodedRow]:
    """Each row cut every `capacity` tokens from its start, its last piece the shorter, the pieces in the rows'
    order (TRL's bfd_split: a row of 10 tokens at 4 is pieces of 4, 4 and 2); each piece's trained mask its share of
    the row's, token for token."""
    return [EncodedRow(e.ids[i:i + capacity], e.trained[i:i + capacity], e.index)
            for e in rows for i in range(0, len(e.ids), capacity)]


def pack_dataset(encoded: Sequence[EncodedRow], capacity: int, strategy: str) -> tuple[list[EncodedRow], int]:
    """(the rows packed as TRL's `packing=True` packs a dataset before batching, rows left with no trained token
    dropped; how many were dropped), block by block of `PACK_BLOCK` rows. bfd: whole rows (already cut at
    `capacity`) in `dataset_bins`' bins, each keeping to itself (`EncodedRow.lengths`), its first token no target.
    bfd_split: as bfd, the pieces of `split_pieces` taking the rows' places, each a sequence of its own (position
    ids from 0, its first token no target, as TRL's collator masks every position 0). wrapped: the rows' tokens end
    to end, cut every `capacity` tokens: a row may run on into the next packed row, and attention crosses from row
    to row as in one text."""
    out: list[EncodedRow] = []
    dropped = 0
    for start in range(0, len(encoded), PACK_BLOCK):
        block = encoded[start:start + PACK_BLOCK]
        if strategy == "bfd_split":  # TRL splits within each datasets.map batch, so a block's pieces stay in it
            block = split_pieces(block, capacity)
        elif strategy == "bfd":  # a longer row keeps its first piece alone, as TRL's truncation
            block = [EncodedRow(e.ids[:capacity], e.trained[:capacity], e.index) for e in block]
        if strategy in ("bfd", "bfd_split"):
            pieces = [[block[i] for i in b] for b in dataset_bins([len(e.ids) for e in block], capacity)]
            rows = [_joined(p, tuple(len(e.ids) for e in p)) for p in pieces]
        else:
            whole = _joined(block, ())
            rows = [EncodedRow(whole.ids[i:i + capacity], whole.trained[i:i + capacity], 0)
                    for i in range(0, len(whole.ids), capacity)]
        for row in rows:
            if row.n_trained == 0:  # a wrapped piece of prompt alone, or a bin of split pieces of prompt
                dropped += 1
                continue
            out.append(EncodedRow(row.ids, row.trained, len(out), row.lengths))
    return out, dropped


def _joined(rows: Sequence[EncodedRow], lengths: tuple[int, ...]) -> EncodedRow:
    """The rows end to end; with `lengths` (they keep apart) each row's first token is no target."""
    ids = [t for e in rows for t in e.ids]
    trained = [on and not (lengths and k == 0) for e in rows for k, on in enumerate(e.trained)]
    return EncodedRow(ids, trained, 0, lengths)


def collate_packed(encoded: Sequence[EncodedRow], pad_id: int, global_tokens: float, capacity: int,
                   one_row: bool = False) -> SFTBatch:
    """The rows packed into sequences of at most `capacity` tokens (all of them into one row with `one_row`), with
    their restarting position ids; `attention_mask` marks the rows' tokens (the model gets none)."""
    seqs = [[encoded[i] for i in b] for b in best_fit([len(e.ids) for e in encoded], capacity)]
    return _laid_out([[e for s in seqs for e in s]] if one_row else seqs, pad_id, global_tokens)


def collate_bins(encoded: Sequence[EncodedRow], pad_id: int, global_tokens: float, one_row: bool = False) -> SFTBatch:
    """Rows packed before batching (`pack_dataset`'s bfd, bfd_split): each row a sequence of its own (all of them in
    one row with `one_row`), position ids restarting at each of its packed sequences."""
    return _laid_out([list(encoded)] if one_row else [[e] for e in encoded], pad_id, global_tokens)


def _positions(e: EncodedRow) -> torch.Tensor:
    """A row's position ids: from 0 at each sequence it packs (`EncodedRow.lengths`), else from 0 once."""
    return torch.cat([torch.arange(n) for n in e.lengths]) if e.lengths else torch.arange(len(e.ids))


def _laid_out(seqs: list[list[EncodedRow]], pad_id: int, global_tokens: float) -> SFTBatch:
    """Each list of rows laid end to end in one row of the batch, filled at its end by a segment of its own."""
    width = max(sum(len(e.ids) for e in s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(seqs), width), dtype=torch.long)
    real = torch.zeros((len(seqs), width), dtype=torch.bool)
    trained = torch.zeros((len(seqs), width), dtype=torch.bool)
    for r, seq in enumerate(seqs):
        at = 0
        for e in seq:
            n = len(e.ids)
            ids[r, at:at + n] = torch.tensor(e.ids, dtype=torch.long)
            pos[r, at:at + n] = _positions(e)
            real[r, at:at + n] = True
            trained[r, at + 1:at + n] = torch.tensor(e.trained[1:], dtype=torch.bool)  # nothing predicts a first
            at += n
        pos[r, at:] = torch.arange(width - at)  # the filler: a sequence of its own
    index = torch.tensor([e.index for s in seqs for e in s], dtype=torch.long)
    return SFTBatch(ids, real, trained, index, float(global_tokens), pos)


def one_row_attention(model) -> bool:
    """Whether packed sequences must share one row: flash attention finds varlen boundaries in the position ids of
    a batch of one row only."""
    return str(getattr(_config(model), "_attn_implementation", "")).startswith(("flash", "kernels-community"))


def _config(model):
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "config", None)


@torch.no_grad()
def check_packable(model, capacity: int) -> None:
    """One forward of two short rows packed into one sequence against the second alone: the second's logits must
    not change (its attention must not reach the first row). Refuses in one line when they do."""
    first = EncodedRow([3, 4, 5, 6], [True] * 4, 0)
    second = EncodedRow([7, 8, 9], [True] * 3, 1)
    packed = collate_packed([first, second], 0, 1.0, max(capacity, 7), one_row_attention(model))
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        both = model(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                     attention_mask=None, use_cache=False).logits.float()
        alone = model(input_ids=torch.tensor([second.ids], device=device),
                      position_ids=torch.arange(3, device=device)[None], use_cache=False).logits.float()
    except TypeError as e:
        raise ConfigError(f"packing=true: the model's forward takes no position ids ({e}); set packing=false") from e
    finally:
        model.train(was)
    at = packed.index.tolist().index(1)  # the second row's place in the packed sequence
    start = 0 if at == 0 else len(first.ids)
    if not torch.allclose(both[0, start:start + 3], alone[0], rtol=1e-3, atol=1e-4):
        impl = getattr(_config(model), "_attn_implementation", "?")
        raise ConfigError(f"packing=true: this model's attention (attn_implementation={impl}) lets a packed row "
                          "attend to the row before it (no block-diagonal mask from restarting position ids); "
                          "set packing=false, or load it with sdpa or eager attention")


class NEFTune:
    """NEFTune noise on the input embeddings in training: armed for one micro-batch by `arm`, spent by the next
    forward of the embedding layer in training mode (so evaluation forwards, in eval mode, never get noise)."""

    def __init__(self, model, alpha: float):
        self.alpha = float(alpha)
        self.scale: torch.Tensor | None = None  # (B, T, 1): s of each token's row, 0 on padding and filler
        self.key = 0
        self.handle = model.get_input_embeddings().register_forward_hook(self._hook)

    def arm(self, batch: SFTBatch) -> None:
        """Noise for the next training forward of `batch`; its draws are keyed by the micro-batch's seed."""
        self.scale = self.alpha * inverse_sqrt_lengths(batch)
        self.key = (torch.initial_seed() * 0x9E3779B1 + 0x7F4A7C15) % 2**63

    def remove(self) -> None:
        """Takes the hook off the embedding layer (after training)."""
        self.handle.remove()
        self.scale = None

    def _hook(self, module, _inputs, output):
        if not module.training or self.scale is None:
            return None
        scale, self.scale = self.scale.to(output.device, output.dtype) / output.shape[-1] ** 0.5, None
        gen = torch.Generator(device=output.device).manual_seed(self.key)
        noise = torch.rand(output.shape, generator=gen, device=output.device, dtype=output.dtype) * 2 - 1
        return output + noise * scale


def inverse_sqrt_lengths(batch: SFTBatch) -> torch.Tensor:
    """(B, T, 1): 1 / sqrt(L) at each of a row's tokens, L its own length (in a packed sequence, each row's), and 0
    on padding and filler."""
    real = batch.attention_mask
    if batch.position_ids is None:
        lengths = real.sum(-1, keepdim=True).expand_as(real)
    else:  # a row's length: the position id of its last token + 1, summed over the row's segment and spread back
        starts = batch.position_ids == 0
        seg = starts.cumsum(-1)
        ends = (batch.position_ids + 1) * torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], -1)
        per_seg = torch.zeros(real.shape[0], int(seg.max()) + 1, dtype=torch.long, device=real.device)
        lengths = per_seg.scatter_add_(1, seg, ends).gather(1, seg)
    return (lengths.clamp(min=1).double().rsqrt() * real).float()[..., None]
