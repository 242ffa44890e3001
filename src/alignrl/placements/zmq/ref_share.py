"""Who runs the frozen reference forward of a KL term in the ZeroMQ placement (pipeline.ref_logprobs).

Either side can do it: the sampler has the rollout in hand (the ZeroMQ scripts send `ref_policy_log_probs`, the
default), and the trainer has the batch before it trains (`trainer`: a sampler then holds no reference model,
as when it is an inference engine that serves only generation). Asynchronous training (max_staleness >= 1)
is as fast as its slower side, so under `balance` the sampler computes the reference log-probs of the first
`groups` prompt groups of each batch and the trainer those of the rest; after each step one group's reference
forward moves to the side that waited more: for a sampler slower than its trainer on hardware of its own.
Strictly on-policy (max_staleness=0) the two sides take turns, so moving work between them gains nothing:
`balance` then leaves it all to the sampler.

The rows travel as a prefix: a batch's `ref_logprobs` holds the first K rows (K <= B), and since prompt
groups are contiguous, every rank's contiguous share of the groups holds a prefix of its own rows too.
"""

from __future__ import annotations

import time

import torch

from alignrl.config.checks import needs_reference
from alignrl.config import RunConfig
from alignrl.data.records import ScoredBatch
from alignrl.wire.frames import WireError
from alignrl.interfaces import RefScorer


def sampler_needs_ref(cfg: RunConfig) -> bool:
    """Whether a sampler must hold a reference model (when a KL term needs one)."""
    return cfg.pipeline.ref_logprobs != "trainer"


def trainer_needs_ref(cfg: RunConfig) -> bool:
    """Whether the trainer may be left reference rows to compute (when a KL term needs them)."""
    p = cfg.pipeline
    return p.ref_logprobs == "trainer" or (p.ref_logprobs == "balance" and p.max_staleness >= 1)


class RefShare:
    """The sampler's share of the reference forward (prompt groups per batch) and the trainer's completion
    of the rest. `ref`: the trainer's reference (None when samplers compute it all or no KL term needs it)."""

    def __init__(self, cfg: RunConfig, ref: RefScorer | None):
        self.ref, self.needed = ref, needs_reference(cfg)
        self.total, self.per_group = cfg.data.train_batch_size, cfg.rollout.n
        self.moves = cfg.pipeline.ref_logprobs == "balance" and trainer_needs_ref(cfg)
        self.groups = 0 if cfg.pipeline.ref_logprobs == "trainer" else self.total  # balance starts as sampler
        self.row_s = 0.0  # seconds of one row's reference forward here (0 until measured)

    def observe(self, trainer_wait: float, sampler_wait: float) -> None:
        """Moves one group's reference forward to the side that waited more, when the waits differ by more
        than a group's forward (a dead band: noise alone should not move the split)."""
        if not self.moves:
            return
        band = self.row_s * self.per_group
        if trainer_wait > sampler_wait + band:
            self.groups = max(0, self.groups - 1)
        elif sampler_wait > trainer_wait + band:
            self.groups = min(self.total, self.groups + 1)

    def check(self, batch: ScoredBatch) -> None:
        """Before the batch is split among ranks (so that every rank raises together): WireError if it lacks
        reference rows that this trainer has no reference to compute."""
        k = 0 if batch.ref_logprobs is None else len(batch.ref_logprobs)
        if self.needed and self.ref is None and k < len(batch):
            raise WireError(f"a sampler sent reference log-probs for {k} of {len(batch)} rows under "
                            "pipeline.ref_logprobs=sampler: run the same alignrl version on both sides")

    def complete(self, batch: ScoredBatch) -> tuple[ScoredBatch, dict[str, float]]:
        """`batch` (this rank's share, `check`ed whole) with the reference log-probs of every row: the rows
        the sampler left are computed here. `pipeline/ref_rows_trainer` counts this rank's. Collective with a
        reference sharded over the ranks (`collective`): the sampler's prefix covers some ranks' shares whole and
        others' in part, so every rank calls it once, a rank with no rows left too (it pads the others' forwards)."""
        if not self.needed:
            return batch, {}
        ro, have = batch.rollout, batch.ref_logprobs
        k, b = (0 if have is None else len(have)), len(batch)
        metrics = {"pipeline/ref_rows_trainer": float(b - k)}
        if k == b and not getattr(self.ref, "collective", False):
            return batch, metrics
        t0 = time.perf_counter()
        # prompts with images are scored with their images (the rows' `images`, sent by the sampler)
        extra = {} if ro.images is None else {"images": ro.images.select(range(k, b))}
        rest = self.ref.logprobs(ro.prompt_ids[k:], ro.prompt_mask[k:], ro.response_ids[k:], ro.response_mask[k:],
                                 **extra)
        seconds = time.perf_counter() - t0
        if k == b:  # a sharded reference's call for the others' rows: nothing of this rank's was computed
            return batch, metrics
        self.row_s = seconds / (b - k)
        batch.ref_logprobs = rest if k == 0 else torch.cat([have, rest.to(have.dtype)])
        return batch, {**metrics, "timing/ref_trainer": seconds}
