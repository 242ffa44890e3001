"""One frozen reference model sharded over a process group (FSDP2), as OpenRLHF's reference group holds it
under ZeRO-3 and verl's under FSDP: each rank keeps 1/N of the weights, and every forward all-gathers them one
transformer block at a time. Without it each rank held the whole model: for a Ray cluster's 32B policy (64 GB in
bf16) that does not fit beside the actor on a GPU, and under torchrun a 7B policy's reference took 14 GB on each of 8
GPUs where a shard takes 1.75 GB.

Two placements hold one: the Ray reference group (`placements.ray.workers.RefWorker`) and the trainer's own ranks
under torchrun when the policy's engine shards its weights (fsdp2, DeepSpeed ZeRO-3; `shards_reference`), in the
in-process loop and in the ZeroMQ trainer alike; actor.ref_sync_steps moves it shard by shard
(`placements.ref_sync`). FSDP2's sharding of a frozen module needs only the process group, not the trained model's
engine, so it serves beside a DeepSpeed policy too.

The cost of sharing the weights is that every rank must make the same model calls: a forward is collective.
The rollout engines split each batch over all reference ranks (`RayRefScorer` with `every=True` calls even the
ranks whose share is empty), and the trainer's ranks each score their own share of every step once (dynamic
sampling keeps as many groups on every rank; the ZeroMQ trainer's ranks call once per batch, a rank whose rows the
sampler scored all with none: `placements.zmq.ref_share.RefShare.complete`); the ranks first agree on the largest
number of micro-batches any of them has, and those with fewer run one-token forwards until they reach it. Two
engines calling at once pair calls of different engines on different ranks; that is harmless, as each rank computes
only its own rows and every call makes the same collectives, as long as no call fails part-way: a rank whose call
fails ends its process (the run stops with that worker's death) rather than leave the others' collectives paired with
its next call.

Each rank reads only its own rows of the weights from the safetensors files (`models/sharded_load.py`); a folder
of `.bin` weights is loaded whole on every rank before it keeps its shard. Deliberately left out: CPU offload of
the shards (OpenRLHF's `--ref_reward_offload`).

A vision-language reference shards its image encoder's blocks too, so the ranks must also agree on running it: a
forward whose rows have no images (a text-only prompt, a padding forward) runs the encoder on one blank patch
(`models.vision.encoder_in_every_forward`), as another rank's image micro-batch runs it on its images.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from alignrl.config import RunConfig
from alignrl.config.checks import needs_reference
from alignrl.data.images import ImageRows
from alignrl.placements.build import forward_layout, ref_folder, shards_weights
from alignrl.rl.producer import LocalRefScorer, batched_logprobs
from alignrl.runtime.env import DistEnv
from alignrl.models.logprobs import ForwardLayout
from alignrl.models.sharded_load import held_bytes, size_text


def shards_reference(cfg: RunConfig, env: DistEnv) -> bool:
    """Whether the trainer's own ranks hold the frozen reference sharded over them: a model of its own (model.ref_path,
    or the base model.path without LoRA adapters; not the reference service), beside a policy whose engine shards its
    weights (fsdp2, DeepSpeed ZeRO-3) on more than one rank: the in-process loop's, and the ZeroMQ trainer's for the
    rows samplers leave to it. actor.ref_sync_steps then moves it shard by shard
    (`placements.ref_sync`)."""
    return (env.distributed and needs_reference(cfg) and not cfg.services.reference_url
            and (bool(cfg.model.ref_path) or cfg.model.lora_rank == 0) and shards_weights(cfg, env))


def where_reference_lives(cfg: RunConfig, ref, env: DistEnv) -> str | None:
    """The start line saying where an in-process reference model lives and its bytes per rank, or None for a
    reference without weights of its own here (the reference service, the policy with its adapters off)."""
    if isinstance(ref, ShardedRefScorer):
        return (f"reference: sharded over {env.world_size} ranks (FSDP2), {size_text(held_bytes(ref.model))} of its "
                "weights per rank, gathered a block at a time in each forward")
    if not isinstance(ref, LocalRefScorer):
        return None
    return f"reference: a whole copy on each rank, {size_text(held_bytes(ref.model))} per rank"


class ShardedRefScorer:
    """RefScorer over a reference model sharded with `shard_blocks`; `logprobs` is collective over the group."""

    collective = True  # every rank must call `logprobs` as often as the others, with no rows if it has none

    def __init__(self, model, env: DistEnv, temperature: float, micro_batch: int, layout: ForwardLayout = ForwardLayout()):
        self.model, self.env = model, env
        self.temperature, self.micro_batch, self.layout = temperature, micro_batch, layout

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask, images: ImageRows | None = None
                 ) -> torch.Tensor:
        """Reference log-probs (B, R); `images`: each row's prompt images (`data.images.ImageRows`), or None."""
        try:
            return self._logprobs(prompt_ids, prompt_mask, response_ids, response_mask, images)
        except Exception as e:
            # a rank that failed part-way (out of memory in a forward) cannot go on: its next call's collectives
            # would pair with the rest of this one's on the other ranks. Ending the process makes its death the
            # run's one line at once, where a wait would last the whole peer timeout
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"reference rank {self.env.rank}: {type(e).__name__}: {first}; a rank of a sharded reference cannot "
                  "continue alone: stopping", file=sys.stderr, flush=True)
            os._exit(1)

    def _logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask, images) -> torch.Tensor:
        rows = prompt_ids.shape[0]
        mine = -(-rows // self.micro_batch)  # per_token_in_chunks splits the rows into this many micro-batches
        most = torch.tensor([mine], device=self.env.device)  # the most micro-batches of any rank
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        out = (batched_logprobs(self.model, prompt_ids, prompt_mask, response_ids, response_mask, self.temperature,
                                self.micro_batch, self.layout, images) if rows else
               torch.zeros(response_ids.shape))
        token, mask = torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
        for _ in range(int(most) - mine):  # the same calls as one micro-batch of real rows, on one token each
            batched_logprobs(self.model, token, mask, torch.zeros_like(token), mask, self.temperature, 1, self.layout)
        return out


def build_sharded_ref(cfg, env: DistEnv) -> ShardedRefScorer:
    """The reference (`model.ref_path`, else the base `model.path`; frozen) sharded over every rank of `env`'s process
    group, each rank reading only its own rows of the weights (a folder that cannot be read by rows is loaded whole,
    then sharded)."""
    from alignrl.models.loader import DTYPES, load_model, resolve_model_path
    from alignrl.models.sharded_load import load_sharded
    from alignrl.train.engines.fsdp2 import shard_blocks

    def shard(model: torch.nn.Module) -> None:
        shard_blocks(model, env, reshard_after_forward=True)  # the root too: FSDP2 keeps a root gathered for its backward

    folder = resolve_model_path(ref_folder(cfg), lambda *_: None)
    model = load_sharded(folder, DTYPES[cfg.model.dtype], env.device, shard)
    if model is None:
        key = "model.ref_path" if cfg.model.ref_path else "model.path"
        model = load_model(str(folder), cfg.model.dtype, chat=False, key=key)[0]
        model.eval()
        model.requires_grad_(False)
        shard(model)
    return ShardedRefScorer(model, env, cfg.logprob_temperature, cfg.actor.forward_micro_batch, forward_layout(cfg))
