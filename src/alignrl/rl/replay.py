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
`check_replay` requires.

The buffer is part of the source's checkpointed state (under REPLAY_KEY, beside the data position): each stored
group as tensors and plain values, every rank's buffer in rank order (the ranks exchange theirs as wire messages,
never pickle), so a resumed run replays what the uninterrupted run would. A checkpoint written without replay, or
by another number of ranks, resumes with the buffer empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from alignrl.config.checks import replay_problem
from alignrl.config import ConfigError, RunConfig
from alignrl.data.images import ImageRows, PromptImages
from alignrl.data.records import Rollout, ScoredBatch, Scores
from alignrl.interfaces import BatchSource
from alignrl.rl.rollout_ops import concat_rollouts, group_rows, pad_cols, select_groups
from alignrl.runtime.env import SINGLE, DistEnv, gather_values
from alignrl.utils.tracking import console

REPLAY_KEY = "replay"  # the buffer's entry in the source's checkpointed state
_ROLLOUT = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "truncated", "group",
            "loss_mask")
_SCORES = ("rewards", "correct", "costs", "baseline")


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
        self.env: DistEnv = getattr(inner, "env", SINGLE)  # the placements' sources know their rank

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
        """The inner source's state and, under REPLAY_KEY, every rank's buffer (collective on several ranks: the
        checkpoint is written from rank 0's state, and each rank resumes with its own buffer)."""
        mine = [group_state(std, group) for std, group in self.buffer]
        ranks = gather_groups(self.env, mine) if self.env.distributed else [mine]
        return {**self.inner.state_dict(), REPLAY_KEY: {"ranks": ranks}}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict({k: v for k, v in state.items() if k != REPLAY_KEY})
        self.buffer.clear()
        saved = state.get(REPLAY_KEY)
        if saved is None:  # written without a replay buffer: this run's starts empty
            return
        from alignrl.train.checkpoint import CheckpointError

        try:
            ranks = saved["ranks"]
            if len(ranks) != self.env.world_size:  # the groups were drawn for other shares of the batches
                if self.env.is_main:
                    console.print(f"replay buffer: the checkpoint holds the buffers of {len(ranks)} rank(s), this "
                                  f"run has {self.env.world_size}: it starts empty", markup=False)
                return
            for g in ranks[self.env.rank]:  # oldest first; a smaller capacity keeps the newest
                self.buffer.append(group_from_state(g))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            self.buffer.clear()
            raise CheckpointError(f"the checkpoint's replay buffer is damaged ({type(e).__name__}: {e}): resume "
                                  "from an earlier checkpoint, or set trainer.resume_mode=disable") from None

    def close(self, finished: bool) -> None:
        self.inner.close(finished)


def data_order_keys(state: dict) -> set[str]:
    """The keys of a source's checkpointed state that tell its placement (the replay buffer's left out): a resume
    may turn replay on or off, but not change the placement that keeps the data order."""
    return set(state) - {REPLAY_KEY}


def group_state(std: float, batch: ScoredBatch) -> dict:
    """One stored group as tensors and plain values (what a checkpoint holds and ranks exchange); the parts a run
    has not got (reference log-probs, images, costs) are left out. A prompt's images shared by its rows are kept
    once: `image_of` names the row that holds each row's (-1: none)."""
    ro, s = batch.rollout, batch.scores
    t = {f"rollout.{k}": getattr(ro, k) for k in _ROLLOUT}
    t.update({f"scores.{k}": getattr(s, k) for k in _SCORES})
    t.update({f"stats.{k}": v for k, v in ro.stats.items()})
    t.update({"loss_mask": batch.loss_mask, "ref_logprobs": batch.ref_logprobs, "prompt_index": batch.prompt_index})
    image_of = None
    if ro.images is not None:
        first: dict[int, int] = {}
        image_of = [-1 if r is None else first.setdefault(id(r), i) for i, r in enumerate(ro.images.rows)]
        for i, j in enumerate(image_of):
            if i == j:
                img = ro.images.rows[i]
                t[f"image.{i}.pixels"], t[f"image.{i}.grid"] = img.pixel_values, img.image_grid_thw
    return {"std": float(std), "version": int(batch.version), "sampler_id": str(batch.sampler_id),
            "metrics": {k: float(v) for k, v in batch.metrics.items()}, "image_of": image_of,
            "tensors": {k: v.detach().cpu() for k, v in t.items() if v is not None}}


def group_from_state(g: dict) -> tuple[float, ScoredBatch]:
    """`group_state`'s (reward std, group) back."""
    t = g["tensors"]
    images = None
    if g.get("image_of") is not None:
        made: dict[int, PromptImages] = {}
        for j in g["image_of"]:
            if j >= 0 and j not in made:
                made[j] = PromptImages(t[f"image.{j}.pixels"], t[f"image.{j}.grid"])
        images = ImageRows([None if j < 0 else made[j] for j in g["image_of"]])
    stats = {k[len("stats."):]: v for k, v in t.items() if k.startswith("stats.")}
    ro = Rollout(**{k: t.get(f"rollout.{k}") for k in _ROLLOUT}, stats=stats, images=images)
    for k in _ROLLOUT[:-1]:  # all but loss_mask are always there
        if getattr(ro, k) is None:
            raise KeyError(f"rollout.{k}")
    scores = Scores(t["scores.rewards"], t["scores.correct"], t.get("scores.costs"), t.get("scores.baseline"))
    return float(g["std"]), ScoredBatch(ro, scores, t["loss_mask"], t.get("ref_logprobs"), t["prompt_index"],
                                        int(g["version"]), str(g["sampler_id"]), dict(g["metrics"]))


def gather_groups(env: DistEnv, groups: list[dict]) -> list[list[dict]]:
    """Collective: every rank's `group_state`s, in rank order, on every rank. Each rank's are one wire message
    (msgpack and raw tensor bytes, never pickle); the bytes are summed into place over ranks (each rank fills its
    own stretch of zeros), as gloo's all_gather wants equal shapes."""
    import torch.distributed as dist

    from alignrl.wire.frames import decode, encode

    tensors = {f"{i}/{k}": v for i, g in enumerate(groups) for k, v in g["tensors"].items()}
    meta = {"groups": [{k: v for k, v in g.items() if k != "tensors"} for g in groups]}
    frames = [bytes(memoryview(f)) for f in encode("replay_buffer", meta, tensors)]
    counts = [int(n) for n in gather_values(env, [float(len(frames))])]
    sizes = [int(n) for n in gather_values(env, [float(len(f)) for f in frames])]
    start = sum(sizes[:sum(counts[:env.rank])])
    data = torch.zeros(sum(sizes), dtype=torch.uint8)
    mine = b"".join(frames)
    if mine:
        data[start:start + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    dev = env.device if env.backend == "nccl" else torch.device("cpu")
    data = data.to(dev)
    dist.all_reduce(data)
    blob = data.cpu().numpy().tobytes()
    out, at, frame = [], 0, 0
    for n in counts:
        parts = []
        for size in sizes[frame:frame + n]:
            parts.append(blob[at:at + size])
            at += size
        frame += n
        msg = decode(parts)
        rank_groups = [dict(g, tensors={}) for g in msg.meta["groups"]]
        for name, v in msg.tensors.items():  # views over the received bytes: copied out
            i, key = name.split("/", 1)
            rank_groups[int(i)]["tensors"][key] = v.clone()
        out.append(rank_groups)
    return out


def with_replay(source: BatchSource, cfg: RunConfig, pad_id: int) -> BatchSource:
    """`source` itself without a replay buffer (the batches untouched), else wrapped in one."""
    check_replay(cfg)
    p = cfg.pipeline
    if p.replay_buffer_size == 0:
        return source
    return ReplaySource(source, p.replay_buffer_size, pad_id, p.replay_share)
