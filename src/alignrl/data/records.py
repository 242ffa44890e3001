"""Typed records passed between the stages of a run.

Shapes: B = number of sequences, P = padded prompt length, R = padded response length.
Prompts are left-padded and responses right-padded, so `cat([prompt_ids, response_ids], 1)` is a
well-formed batch whose last prompt token sits at column P-1 for every row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from alignrl.data.collate import padding_bounds
from alignrl.data.images import ImageRows


@dataclass(frozen=True)
class Sample:
    """One task instance as loaded from a dataset, before tokenisation."""

    messages: list[dict[str, str]]  # chat messages ending with the user turn
    # reference answer as the dataset gives it: "72" for GSM8K, {"target": ["Paris"]} for Search-R1
    ground_truth: str | list[Any] | dict[str, Any]
    data_source: str = "gsm8k"  # selects the reward function (verl's `data_source`)
    extra: dict[str, Any] = field(default_factory=dict)
    # the prompt exactly as the policy reads it, tokenized without a chat template (OpenRLHF without
    # --apply_chat_template); None: `messages` go through the chat template. `messages` still hold the
    # question as a user turn, for what reads it as text (evaluation rooms, logs)
    prompt_text: str | None = None
    # its place in the data file ("train.parquet row 17"), for messages; not part of the sample's value
    source: str | None = field(default=None, compare=False)
    # the prompt's images in the order of the messages' {"type": "image"} items: file paths or encoded bytes
    # (`data.images`); () for a text prompt
    images: tuple[str | bytes, ...] = ()


def rows_digest(samples: list[Sample]) -> str:
    """A digest of a dataset's rows (prompt, answer, data source), in order: two processes that index the same rows
    agree on it, whatever file or path they read them from."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for s in samples:
        digest.update(json.dumps([s.messages, s.prompt_text, s.ground_truth, s.data_source], sort_keys=True,
                                 default=str).encode())
        for image in s.images:  # a path, or the image's bytes
            digest.update(image if isinstance(image, bytes) else image.encode())
    return digest.hexdigest()[:16]


@dataclass
class Rollout:
    """What a RolloutEngine returns for a batch of prompts (n samples each, grouped contiguously)."""

    prompt_ids: torch.Tensor  # (B, P) long, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor  # (B, R) long, right-padded with pad_token_id
    response_mask: torch.Tensor  # (B, R) bool, True on generated tokens (incl. the final eos)
    logprobs: torch.Tensor  # (B, R) float, log-prob of each sampled token under the sampling distribution
    truncated: torch.Tensor  # (B,) bool, hit max_new_tokens before eos/stop
    group: torch.Tensor  # (B,) long, index of the prompt each row was sampled from
    # (B, R) bool, True on the tokens the policy generated (within response_mask); a multi-turn rollout
    # leaves its tool observations out. None: every response token was generated (single-turn)
    loss_mask: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row (B,) float counts (agent/...)
    images: ImageRows | None = None  # each row's prompt images (B rows); None: no row has any
    # (B,) what each row's episode adds to the reward function's extra_info, which is per episode and may hold lists
    # (verl's tool loop: num_turns, turn_scores, tool_rewards); None: nothing, the rows' own extra_info is read
    reward_extras: list[dict[str, Any]] | None = None

    @property
    def generated_mask(self) -> torch.Tensor:  # (B, R) bool, the policy's own tokens
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P+R)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P+R)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:  # (B,)
        return self.response_mask.sum(-1)


@dataclass
class Scores:
    """The reward stage's verdict on each row of a rollout (B rows)."""

    rewards: torch.Tensor  # (B,) float training reward (task reward or reward-model score, plus shaping)
    correct: torch.Tensor  # (B,) bool, full correctness reward earned
    costs: torch.Tensor | None = None  # (B,) safety cost (PPO-Lagrangian); None without one
    baseline: torch.Tensor | None = None  # (B,) reward of the row's prompt's greedy response (ReMax)
    # (B,) what dynamic sampling's range tests when it is not the reward: an environment's "scores" (OpenRLHF filters
    # on them); None: the reward. Used in the producer only, so never sent to a trainer
    filter_scores: torch.Tensor | None = None
    # (B,) the reward the logs show where the training reward is normalized per group (GDPO: the plain score or the
    # functions' weighted sum); None: the reward. Producer-only too
    shown: torch.Tensor | None = None

    @property
    def for_filtering(self) -> torch.Tensor:
        return self.rewards if self.filter_scores is None else self.filter_scores

    def rows(self, idx: torch.Tensor) -> Scores:
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Scores(self.rewards[idx], self.correct[idx], pick(self.costs), pick(self.baseline),
                      pick(self.filter_scores), pick(self.shown))

    def cat(self, other: Scores) -> Scores:
        join = lambda a, b: None if a is None else torch.cat([a, b])  # noqa: E731
        return Scores(torch.cat([self.rewards, other.rewards]), torch.cat([self.correct, other.correct]),
                      join(self.costs, other.costs), join(self.baseline, other.baseline),
                      join(self.filter_scores, other.filter_scores), join(self.shown, other.shown))


@dataclass
class ScoredBatch:
    """One step's experience before advantages: what the producer hands the trainer, in one process
    or across the ZeroMQ channel (`alignrl.wire.records` gives the seed's field names on the wire).

    `rollout.response_mask` is the attention mask of the response; `loss_mask` is the subset the policy
    generated and is trained on (a multi-turn rollout attends to tool observations but never trains on
    them). Group g of `rollout.group` answers dataset row `prompt_index[row]` for every row of g."""

    rollout: Rollout
    scores: Scores
    loss_mask: torch.Tensor  # (B, R) bool, within rollout.response_mask
    # (B, R) frozen reference log-probs; None without a KL term. In transit from a ZeroMQ sampler it may hold
    # only the first K rows: the trainer computes the rest before it trains (dist.ref_share)
    ref_logprobs: torch.Tensor | None
    prompt_index: torch.Tensor  # (B,) long, dataset row of each sequence's prompt
    version: int = 0  # weight version that generated the rollout (trainer updates before it)
    sampler_id: str = "inline"
    metrics: dict[str, float] = field(default_factory=dict)  # the producer's own (reward/..., timing/gen, ...)

    def __len__(self) -> int:
        return len(self.rollout.group)

    @property
    def sample_index(self) -> torch.Tensor:  # (B,) long, 0..n-1 within each prompt's group
        g = self.rollout.group
        starts = torch.searchsorted(g, g) if len(g) else g  # groups are contiguous and ascending
        return torch.arange(len(g)) - starts


@dataclass
class Experience:
    """A scored rollout ready for policy updates (OpenRLHF's `Experience`). Shapes as in `Rollout`."""

    prompt_ids: torch.Tensor  # (B, P)
    prompt_mask: torch.Tensor  # (B, P) bool
    response_ids: torch.Tensor  # (B, R)
    response_mask: torch.Tensor  # (B, R) bool, tokens that enter the loss
    old_logprobs: torch.Tensor  # (B, R) behaviour-policy log-probs for the PPO ratio
    ref_logprobs: torch.Tensor | None  # (B, R) frozen reference log-probs; None without a KL term
    advantages: torch.Tensor  # (B,) sequence-level or (B, R) token-level
    is_weight: torch.Tensor | None = None  # (B, R) rollout-correction weight on the token losses; None: all 1
    # (B, R) bool, the response tokens the forward attends to when they are more than the trained ones
    # (tool observations under state masking); None: response_mask
    response_attention: torch.Tensor | None = None
    images: ImageRows | None = None  # each row's prompt images (B rows); None: no row has any

    @property
    def attended(self) -> torch.Tensor:  # (B, R) bool, the response's attention mask
        return self.response_mask if self.response_attention is None else self.response_attention

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device: torch.device) -> Experience:
        """A copy on `device` (records live on the CPU; a micro-batch moves to the trainer's device)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        # images stay on the CPU: the forward's vision inputs move them (models.vision)
        return Experience(*(move(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "images"),
                          images=self.images)

    def select(self, idx: torch.Tensor) -> Experience:
        """Rows `idx`, with the padding columns that no selected row trains on trimmed off (attended-only
        columns after the last trained one go too: a causal model's earlier outputs never see them)."""
        pm, rm = self.prompt_mask[idx], self.response_mask[idx]
        p0, r1 = padding_bounds(pm, rm)
        cut = lambda t: None if t is None else (t[idx][:, :r1] if t.dim() == 2 else t[idx])  # noqa: E731
        return Experience(prompt_ids=self.prompt_ids[idx][:, p0:], prompt_mask=pm[:, p0:],
                          response_ids=cut(self.response_ids), response_mask=cut(self.response_mask),
                          old_logprobs=cut(self.old_logprobs), ref_logprobs=cut(self.ref_logprobs),
                          advantages=cut(self.advantages), is_weight=cut(self.is_weight),
                          response_attention=cut(self.response_attention),
                          images=None if self.images is None else self.images.select(idx))
