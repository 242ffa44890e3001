"""Row-level operations on Rollouts: keep some prompt groups, merge rollouts of different widths.

Dynamic sampling (DAPO) drops groups that carry no learning signal and tops the batch up with
fresh generations; these helpers keep the Rollout invariants while doing so: prompts left-padded,
responses right-padded, and `group` numbering the prompts 0..G-1 so it indexes the step's list of
samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from alignrl.data.images import join_rows
from alignrl.data.records import Rollout, ScoredBatch


def mixed_reward_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Ids of the groups whose rewards are not all equal, ascending. rewards, group (B,) -> (K,) long.

    A group whose samples all earned the same reward has zero advantage under every group baseline
    (GRPO, RLOO, REINFORCE++ with group baseline), so it gives no policy-gradient signal, only
    diluting the batch: DAPO's dynamic sampling filters those out. Exact float equality is intended: rewards are computed, not measured."""
    ids, inv = torch.unique(group, return_inverse=True)
    r = rewards.float()
    lo = torch.full((len(ids),), float("inf")).scatter_reduce(0, inv, r, "amin")
    hi = torch.full((len(ids),), float("-inf")).scatter_reduce(0, inv, r, "amax")
    return ids[hi > lo]


def reward_band_groups(rewards: torch.Tensor, group: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Ids of the groups whose mean reward lies strictly between `low` and `high`, ascending. rewards, group
    (B,) -> (K,) long.

    OpenRLHF's dynamic filtering (--dynamic_filtering_reward_range): a group at either bound, all wrong or all
    right under a reward in [low, high], is dropped; a band inside the reward's range also drops groups that are
    nearly always right or wrong. Strict on both sides, as OpenRLHF compares."""
    ids, inv = torch.unique(group, return_inverse=True)
    total = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inv, rewards.double())
    mean = total / torch.bincount(inv, minlength=len(ids)).double()
    return ids[(mean > low) & (mean < high)]


def kept_groups(rewards: torch.Tensor, group: torch.Tensor, band: Sequence[float] = ()) -> torch.Tensor:
    """The groups dynamic sampling keeps: with `band` ([low, high], algorithm.dynamic_sampling_range) those whose
    mean reward is strictly inside it, else (DAPO's rule) those whose rewards differ."""
    if band:
        return reward_band_groups(rewards, group, float(band[0]), float(band[1]))
    return mixed_reward_groups(rewards, group)


def group_rows(group: torch.Tensor, keep_group_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Row indices (ascending) of the rows whose group is in `keep_group_ids`. group (B,) -> (K,) long."""
    keep = torch.as_tensor(keep_group_ids, dtype=torch.long)
    return torch.isin(group, keep).nonzero().squeeze(-1)


def select_groups(ro: Rollout, keep_group_ids: Sequence[int] | torch.Tensor) -> Rollout:
    """The rows of the groups in `keep_group_ids`, in their original order, with groups renumbered
    0..K-1 by ascending old id (so `[samples[g] for g in sorted(keep_group_ids)]` is the matching
    sample list). Widths are kept: padding columns are trimmed later, per micro-batch."""
    rows = group_rows(ro.group, keep_group_ids)
    kept = ro.group[rows]
    return take_rows(ro, rows, torch.searchsorted(torch.unique(kept), kept))


def take_rows(ro: Rollout, rows: torch.Tensor, group: torch.Tensor) -> Rollout:
    """`ro`'s rows `rows` (indices, in that order), numbered into the prompt groups `group` (one per row)."""
    return Rollout(prompt_ids=ro.prompt_ids[rows], prompt_mask=ro.prompt_mask[rows],
                   response_ids=ro.response_ids[rows], response_mask=ro.response_mask[rows],
                   logprobs=ro.logprobs[rows], truncated=ro.truncated[rows], group=group,
                   loss_mask=None if ro.loss_mask is None else ro.loss_mask[rows],
                   stats={k: v[rows] for k, v in ro.stats.items()},
                   images=None if ro.images is None else ro.images.select(rows),
                   reward_extras=None if ro.reward_extras is None else [ro.reward_extras[i] for i in rows.tolist()])


def pad_cols(t: torch.Tensor, width: int, value: float | int | bool, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    return F.pad(t, (extra, 0) if left else (0, extra), value=value) if extra else t


def concat_rollouts(a: Rollout, b: Rollout, pad_id: int) -> Rollout:
    """Rows of `a` then rows of `b`. Prompts are left-padded and responses right-padded to the wider
    of the two (ids with `pad_id`, masks with False, log-probs with 0); `b`'s groups follow `a`'s
    (b.group + number of groups in a), so the sample lists concatenate in the same order."""
    p, r = max(a.prompt_ids.shape[1], b.prompt_ids.shape[1]), max(a.response_ids.shape[1], b.response_ids.shape[1])
    offset = group_count(a.group)

    def both(name: str, width: int, value: float | int | bool, left: bool) -> torch.Tensor:
        return torch.cat([pad_cols(getattr(x, name), width, value, left) for x in (a, b)])

    return Rollout(prompt_ids=both("prompt_ids", p, pad_id, True), prompt_mask=both("prompt_mask", p, False, True),
                   response_ids=both("response_ids", r, pad_id, False),
                   response_mask=both("response_mask", r, False, False), logprobs=both("logprobs", r, 0.0, False),
                   truncated=torch.cat([a.truncated, b.truncated]), group=torch.cat([a.group, b.group + offset]),
                   loss_mask=None if a.loss_mask is None and b.loss_mask is None else torch.cat(
                       [pad_cols(x.generated_mask, r, False, False) for x in (a, b)]),
                   stats={k: torch.cat([a.stats[k], b.stats[k]]) for k in a.stats if k in b.stats},
                   images=join_rows([a.images, b.images], [len(a.group), len(b.group)]),
                   reward_extras=None if a.reward_extras is None and b.reward_extras is None else
                   [x for r in (a, b) for x in (r.reward_extras or [{} for _ in r.group])])


def interleave_pairs(first: Rollout, second: Rollout, pad_id: int) -> Rollout:
    """One rollout of P groups of two rows from two of P rows each (one per prompt, in the same prompt order): each
    group's first row from `first`, its second from `second`."""
    both = concat_rollouts(first, second, pad_id)
    prompts = len(first.group)
    rows = torch.arange(2 * prompts).view(2, prompts).t().reshape(-1)  # 0, P, 1, P+1, ...
    return take_rows(both, rows, torch.arange(prompts).repeat_interleave(2))


def group_count(group: torch.Tensor) -> int:
    """The prompt groups of rows numbered 0..K-1 (`Rollout.group`): K, 0 for no rows."""
    return int(group.max()) + 1 if len(group) else 0


def groups_in(batch: ScoredBatch) -> int:
    return group_count(batch.rollout.group)


def shard_groups(batch: ScoredBatch, rank: int, world: int) -> ScoredBatch:
    """Rank `rank` of `world`'s contiguous share of the batch's prompt groups: an equal share each, so the groups
    past the last multiple of `world` (a filtered batch's) are left out."""
    if world == 1:
        return batch
    per = groups_in(batch) // world
    return batch_groups(batch, torch.arange(rank * per, (rank + 1) * per))


def keep_first_groups(batch: ScoredBatch, k: int) -> ScoredBatch:
    return batch if groups_in(batch) == k else batch_groups(batch, torch.arange(k))


def batch_groups(batch: ScoredBatch, keep: torch.Tensor) -> ScoredBatch:
    """The batch's rows of the prompt groups `keep` (ascending), renumbered from 0."""
    rows = group_rows(batch.rollout.group, keep)
    ref = batch.ref_logprobs  # its first K rows: a prefix of the kept contiguous rows too (ref_share)
    return ScoredBatch(select_groups(batch.rollout, keep), batch.scores.rows(rows), batch.loss_mask[rows],
                       None if ref is None else ref[rows[rows < len(ref)]], batch.prompt_index[rows],
                       batch.version, batch.sampler_id, batch.metrics)
