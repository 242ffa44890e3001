"""The interfaces of the one RL loop, and the argument types they share.

    producer (BatchSource)                                  trainer
    prompts -> RolloutEngine -> rewards -> RefScorer -> ScoredBatch -> channel -> PolicyTrainer -> WeightSink

Each placement (one process, torchrun ranks, HTTP services, a ZeroMQ sampler pipeline, Ray) plugs in its
own implementation of these protocols once, at start; the step itself never asks which one it has.
The records that cross between the stages live in `alignrl.data.records`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from alignrl.config import RunConfig
from alignrl.data.records import Rollout, ScoredBatch
from alignrl.data.sampler import BatchSampler
from alignrl.runtime.env import DistEnv


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0  # tokens below min_p x the likeliest one's probability are not drawn; 0 disables
    repetition_penalty: float = 1.0  # > 1: tokens already in the prompt or the response are less likely (vLLM's)
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None


def derived_seed(seed: int | None, k: int) -> int | None:
    """The seed of the k-th of several generate calls made for one seeded call (a turn, a request): each its own,
    or all would draw the same random numbers. None stays None."""
    return None if seed is None else (seed + k * 1_000_003) % 2**63


class RolloutEngine(Protocol):
    """Samples `params.n` responses per prompt (token ids); rows of one prompt are contiguous."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class RefScorer(Protocol):
    """Per-token log-probs (B, R) of the responses under the frozen reference policy."""

    def logprobs(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor) -> torch.Tensor: ...


class SequenceScorer(Protocol):
    """One score (B,) per sequence: a reward model or a cost model, local or behind a URL."""

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
              response_mask: torch.Tensor) -> torch.Tensor: ...


class BatchSource(Protocol):
    """The producer side: the next scored batch for RL step `step`, made in this process or received
    from samplers. `state_dict` holds the data position (and whatever else a resume needs)."""

    def next_batch(self, step: int) -> ScoredBatch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self, finished: bool) -> None:
        """The loop is over: `finished` when it trained every step, False when it stopped early (an
        error, an interrupt), so that producers in other processes wait for a restarted trainer."""


class WeightSink(Protocol):
    """Where the trainer's new weights go after an update (`version` counts the updates): nowhere when
    generation shares the policy's module, a local copy, a generation server, ZeroMQ samplers. Collective
    under torchrun: every rank calls it."""

    def publish(self, version: int) -> None: ...


class RemoteProducers(Protocol):
    """Producers in other processes (ZeroMQ samplers, Ray rollout engines): the sink that sends them
    weights, the BatchSource of the batches they make from the rows this trainer hands out, and the
    critics (trained here, or in workers of their own). The trainer's own objects are typed `Any` here (the
    policy's `train.actor.Actor`, the loop's `rl.trainer.PolicyTrainer` and `CriticParts`): they live above
    this module, which every stage imports."""

    def sink(self, actor: Any, env: DistEnv) -> WeightSink: ...

    def source(self, sampler: BatchSampler, trainer: Any, env: DistEnv) -> BatchSource: ...

    def critics(self, cfg: RunConfig, resume: Path | None, env: DistEnv) -> Any: ...

    def evaluator(self, pad_id: int) -> RolloutEngine | None: ...


class TrainEngine(Protocol):
    """How a trainable model gets its gradients reduced, its optimizer stepped and its full weights and training
    state saved, whatever the backend (single, DDP, FSDP2, DeepSpeed: `alignrl.train.engines`). Losses handed to
    `backward` are already normalised for the global batch."""

    name: str
    model: torch.nn.Module  # the HF model itself: save_pretrained, config, generation
    module: torch.nn.Module  # what forward is called on (a DDP wrapper, a DeepSpeed engine, or `model`)
    env: DistEnv
    whole_weights: bool  # every rank's `model` holds all the weights, unsharded (not FSDP2, not ZeRO-3)

    def micro_batch(self, last_micro: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward: before the last one of a step, DDP skips its
        gradient all-reduce (it decides so in the forward, so a context around the backward alone is too late)."""

    def backward(self, loss: torch.Tensor, last_micro: bool = True) -> None:
        """`last_micro`: the last micro-batch before `step` (backends that defer gradient reduction)."""

    # micro-batches may run side by side (`runtime.lanes`), their gradients handed to `add_gradients` instead of
    # going through `backward`: one process whose optimizer steps the model's own parameters
    parallel_micro_batches: bool

    def add_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """Adds one gradient per stepped parameter (`params`, in order; None: none), as `backward` accumulates."""

    params: list[torch.nn.Parameter]  # the parameters the optimizer steps

    skipped_steps: int  # steps skipped for a non-finite loss or gradient since the engine was built

    def step(self, skip: bool = False) -> float:
        """Clip, optimizer step, lr step; returns the pre-clip global grad norm. The next backward starts
        from zero gradients. A non-finite gradient norm, or `skip` (a non-finite loss on some rank), skips
        the optimizer and lr step instead and counts it in `skipped_steps`."""

    def lr(self) -> float: ...

    def full_state_dict(self, main_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective. The full, unsharded weights on CPU, keyed as `model.state_dict()`: on every rank, or
        with `main_only` on rank 0 alone (the others get {} and hold no host copy of the model)."""

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each weight as `full_state_dict` gives it (the model's own, where the engine keeps
        fp32 shards of a bf16 model for its optimizer)."""

    def save_state(self, folder: Path) -> None:
        """Collective. Resumable optimizer and scheduler state into `folder` (rank 0 writes)."""

    def load_state(self, folder: Path) -> bool:
        """Restores what `save_state` wrote (by this or a compatible backend); False when `folder` holds
        no state this backend can read, in which case training resumes from the weights alone."""
