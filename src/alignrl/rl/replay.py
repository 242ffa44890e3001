"""Experience replay of scored prompt groups on the trainer side (`pipeline.replay_buffer_size`).

A group whose samples all earned the same reward has zero advantage under a group baseline, so it teaches
nothing. The replay source keeps the most recent groups that did have reward spread and puts them in place of
such groups in later batches (TRL's GRPO with a replay buffer): the batch keeps its size and its share of learning
signal. `pipeline.replay_share` can also replace a fixed share of every batch's groups.

Choices, all deterministic (no random draw, so a run repeats exactly):
  - the buffer keeps the newest `capacity` groups with a non-zero reward std (first in, first out);
  - the groups to replace are the batch's zero-std groups first, then (for `replay_share`) its lowest-std groups;
  - the stored groups used are those with the highest reward std first (ties: the newer one), and a stored group
    is used once: replaying it takes it out of the buffer.

Replayed groups were sampled by older weights: the trainer recomputes their log-probs and the rollout's own
log-probs (stored with them) enter the truncated importance-sampling correction (`algorithm.rollout_is`), which
`check_replay` requires. The buffer lives in memory: a resumed run starts with it empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from alignrl.config.checks import replay_problem
from alignrl.config import ConfigError, RunConfig
from alignrl.data.records import ScoredBatch
from alignrl.interfaces import BatchSource
from alignrl.rl.rollout_ops import concat_rollouts, group_rows, pad_cols, select_groups


@dataclass(frozen=True)
class ReplayPlan:
    """Which of a batch's groups give way (`replace`, ascending) to which stored groups (`use`, buffer slots in
    the order they join the batch), and which of the batch's groups go into the buffer (`store`, ascending)."""

    replace: list[int]
    use: list[int]
    store: list[int]


def plan_replay(group_std: list[float], stored_std: list[float], share: float = 0.0) -> ReplayPlan:
    """The pure choice of one step. `group_std`: the reward std of each group of the new batch; `stored_std`: that
    of each stored group, oldest first. Zero-std groups are replaced first, then the lowest-std ones until
    floor(share x groups) are, as far as the buffer has groups; the highest-std stored groups are used."""
    order = sorted(range(len(group_std)), key=lambda g: (group_std[g] > 0, group_std[g], g))
    wanted = max(sum(1 for s in group_std if s <= 0), int(share * len(group_std)))
    # highest std first; among equals the newest (the least stale)
    best = sorted(range(len(stored_std)), key=lambda i: (-stored_std[i], -i))
    n = min(wanted, len(best))
    return ReplayPlan(replace=sorted(order[:n]), use=best[:n],
                      store=[g for g, s in enumerate(group_std) if s > 0])


def group_reward_std(rewards: torch.Tensor, group: torch.Tensor) -> list[float]:
    """The (population) std of each group's rewards, by group id 0..G-1. rewards, group (B,) -> G floats."""
    n_groups = int(group.max()) + 1 if len(group) else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.double).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.double).index_add_(0, group, r) / count
    var = torch.zeros(n_groups, dtype=torch.double).index_add_(0, group, (r - mean[group]) ** 2) / count
    # exact zero for equal rewards (the signal test is exact, as dynamic sampling's)
    return [0.0 if v <= 0 else float(v.sqrt()) for v in var]


def take_groups(batch: ScoredBatch, keep: list[int]) -> ScoredBatch:
    """The rows of groups `keep` of a batch (renumbered 0..K-1), images and reference log-probs included."""
    rows = group_rows(batch.rollout.group, keep)
    ref = batch.ref_logprobs
    return ScoredBatch(select_groups(batch.rollout, keep), batch.scores.rows(rows), batch.loss_mask[rows],
                       None if ref is None else ref[rows], batch.prompt_index[rows], batch.version,
                       batch.sampler_id, batch.metrics)


def join_batches(a: ScoredBatch, b: ScoredBatch, pad_id: int) -> ScoredBatch:
    """Rows of `a` then rows of `b` (b's groups after a's), padded to the wider of the two; `a`'s version, sampler
    and metrics."""
    ro = concat_rollouts(a.rollout, b.rollout, pad_id)
    width = ro.response_ids.shape[1]
    both = lambda x, y, v: torch.cat([pad_cols(x, width, v, False), pad_cols(y, width, v, False)])  # noqa: E731
    ref = None if a.ref_logprobs is None else both(a.ref_logprobs, b.ref_logprobs, 0.0)
    return ScoredBatch(ro, a.scores.cat(b.scores), both(a.loss_mask, b.loss_mask, False), ref,
                       torch.cat([a.prompt_index, b.prompt_index]), a.version, a.sampler_id, a.metrics)


def check_replay(cfg: RunConfig) -> None:
    """Replayed groups are off-policy: refuse a config that would train them without the IS correction (also part
    of the config's own checks; here for configs built in code)."""
    problem = replay_problem(cfg)
    if problem:
        raise ConfigError(problem)


class ReplaySource:
    """A BatchSource around another: each batch's groups without reward spread (and `share` of the others) give
    way to stored groups that had some. Every rank of a data-parallel run keeps a buffer of its own share."""

    def __init__(self, inner: BatchSource, capacity: int, pad_id: int, share: float = 0.0):
        self.inner, self.capacity, self.pad_id, self.share = inner, capacity, pad_id, share
        self.buffer: deque[tuple[float, ScoredBatch]] = deque(maxlen=capacity)  # (reward std, one group)

    def next_batch(self, step: int) -> ScoredBatch:
        batch = self.inner.next_batch(step)
        ref = batch.ref_logprobs
        if len(batch) == 0 or (ref is not None and len(ref) != len(batch)):
            return batch  # nothing to mix (dynamic sampling kept nothing), or reference rows still to come
        std = group_reward_std(batch.scores.rewards, batch.rollout.group)
        plan = plan_replay(std, [s for s, _ in self.buffer], self.share)
        stored = list(self.buffer)
        replayed = [stored[i][1] for i in plan.use]
        for i in sorted(plan.use, reverse=True):  # a stored group is replayed once
            del self.buffer[i]
        for g in plan.store:
            self.buffer.append((std[g], take_groups(batch, [g])))
        out = batch
        if replayed:
            kept = [g for g in range(len(std)) if g not in set(plan.replace)]
            out = take_groups(batch, kept)
            for group in replayed:
                out = join_batches(out, group, self.pad_id)
        out.metrics = {**batch.metrics, "replay/groups_replaced": float(len(replayed)),
                       "replay/buffer_size": float(len(self.buffer))}
        return out

    def state_dict(self) -> dict:
        return self.inner.state_dict()  # the data position only: the buffer starts empty on resume

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def close(self, finished: bool) -> None:
        self.inner.close(finished)


def with_replay(source: BatchSource, cfg: RunConfig, pad_id: int) -> BatchSource:
    """`source` itself without a replay buffer (the batches untouched), else wrapped in one."""
    check_replay(cfg)
    p = cfg.pipeline
    if p.replay_buffer_size == 0:
        return source
    return ReplaySource(source, p.replay_buffer_size, pad_id, p.replay_share)
