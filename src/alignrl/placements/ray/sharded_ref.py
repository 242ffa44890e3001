"""One frozen reference model sharded over a process group (FSDP2), as OpenRLHF's reference group holds it
under ZeRO-3 and verl's under FSDP: each rank keeps 1/N of the weights, and every forward all-gathers them one
transformer block at a time. Without it each reference rank held the whole model, which for a Ray cluster's 32B
policy (64 GB in bf16) does not fit beside the actor on a GPU.

The cost of sharing the weights is that every rank must make the same model calls: a forward is collective.
The rollout engines split each batch over all reference ranks (`RayRefScorer` with `every=True` calls even the
ranks whose share is empty), the ranks first agree on the largest number of micro-batches any of them has, and
those with fewer run one-token forwards until they reach it. Two engines calling at once pair calls of different
engines on different ranks; that is harmless, as each rank computes only its own rows and every call makes the
same collectives, as long as no call fails part-way: a rank whose call fails ends its process (the run stops
with that worker's death) rather than leave the others' collectives paired with its next call.

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
from torch.distributed.tensor import DTensor

from alignrl.data.images import ImageRows
from alignrl.rl.producer import batched_logprobs
from alignrl.runtime.env import DistEnv
from alignrl.models.logprobs import ForwardLayout


def held_elements(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards, or the whole model when unsharded)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


class ShardedRefScorer:
    """RefScorer over a reference model sharded with `shard_blocks`; `logprobs` is collective over the group."""

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
    from alignrl.placements.build import forward_layout, ref_folder
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
