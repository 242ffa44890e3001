"""Where each rank's part of the policy's moving average (train.ema) lives, by how the engine holds the weights.

- `WholeWeights` (single, ddp, DeepSpeed ZeRO-1/2): every rank holds every weight, so rank 0 alone keeps the whole
  average, in host memory (the whole model in fp32 would not fit beside it on one GPU); it reads the fp32 master
  weights of a bf16/fp16 model where the engine keeps them (single, ddp), else the weights themselves, upcast.
- `FSDP2Shards`: each rank keeps its own dim-0 shard (the DTensor parameters' local tensors, fp32 since the engine
  shards a bf16 model's weights in fp32), on the shard's device.
- `ZeroPartitions` (DeepSpeed ZeRO-3): each rank keeps its own flat partition, read from the optimizer's fp32 master
  partition (`deepspeed.utils.safe_get_local_fp32_param`), or, for a weight the optimizer does not step, from the
  parameter's own partition (`ds_tensor`) upcast.

Each layout's `local` is this rank's part of a weight now, with no communication; `gather` (a collective) puts an
average's parts back together on rank 0 for a checkpoint, and `read` takes this rank's part of a saved full tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard


class SavedTensors:
    """The tensors of a folder's safetensors files (a large model's are split over several), opened lazily: a rank
    reads the rows of its own part, not the whole model."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as opened:
                self.where.update({k: f for k in opened.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        with safe_open(str(self.where[name]), framework="pt", device="cpu") as opened:
            return opened.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def full(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt", device="cpu") as opened:
            return opened.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop along dim 0."""
        return self._slice(name)[start:stop]

    def flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements start:stop of the flattened tensor, read as the whole rows that hold them."""
        shape = self.shape(name)
        if not shape:
            return self.full(name).reshape(-1)[start:stop]
        row = math.prod(shape[1:])
        first, last = start // row, -(-stop // row)
        return self.rows(name, first, last).reshape(-1)[start - first * row:stop - first * row]


class WholeWeights:
    sharded = False

    def __init__(self, engine):
        self.keeps = engine.env.is_main
        master = getattr(engine, "master", None)  # fp32 copies a bf16/fp16 model steps (train.engines.master)
        self.fp32 = {id(p): m for m, p in master.pairs} if master is not None else {}

    def local(self, p: torch.Tensor) -> torch.Tensor:
        return self.fp32.get(id(p), p)

    def start(self, p: torch.Tensor) -> torch.Tensor:
        return self.local(p).detach().to("cpu", torch.float32, copy=True)

    def shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return tuple(p.shape)

    def read(self, saved: SavedTensors, name: str, p: torch.Tensor) -> torch.Tensor:
        return saved.full(name)

    def gather(self, p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return part  # rank 0 already keeps the whole average


class FSDP2Shards:
    sharded = True
    keeps = True

    def local(self, p: DTensor) -> torch.Tensor:
        return p.to_local()

    def start(self, p: DTensor) -> torch.Tensor:
        return p.to_local().detach().to(torch.float32, copy=True)

    def shape(self, p: DTensor) -> tuple[int, ...]:
        return tuple(p.shape)

    def read(self, saved: SavedTensors, name: str, p: DTensor) -> torch.Tensor:
        """This rank's dim-0 rows, as FSDP2 splits a weight: torch.chunk's pieces, the last ranks' maybe empty."""
        (placement,) = p.placements
        if isinstance(placement, Replicate):
            return saved.full(name)
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise RuntimeError(f"{name}: the moving average reads FSDP2 shards of dim 0, not {placement}")
        rows = -(-p.shape[0] // p.device_mesh.size())
        first = min(p.device_mesh.get_local_rank() * rows, p.shape[0])
        part = saved.rows(name, first, min(first + rows, p.shape[0]))
        if part.shape != p.to_local().shape:
            raise RuntimeError(f"{name}: rows {first}:{first + len(part)} of the saved average do not match this "
                               f"rank's shard {tuple(p.to_local().shape)}")
        return part

    def gather(self, p: DTensor, part: torch.Tensor) -> torch.Tensor | None:
        """Collective: the whole average of `p` in rank 0's host memory (None elsewhere), one weight at a time."""
        whole = DTensor.from_local(part, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None


class ZeroPartitions:
    sharded = True
    keeps = True

    def local(self, p: torch.Tensor) -> torch.Tensor:
        if p.requires_grad and hasattr(p, "_z3_optimizer"):
            from deepspeed.utils import safe_get_local_fp32_param

            master = safe_get_local_fp32_param(p)
            if master is not None:
                return master
        return p.ds_tensor

    def start(self, p: torch.Tensor) -> torch.Tensor:
        return self.local(p).detach().to(torch.float32, copy=True)

    def shape(self, p: torch.Tensor) -> tuple[int, ...]:
        return tuple(p.ds_shape)

    @staticmethod
    def _group(p: torch.Tensor):
        return getattr(p, "ds_process_group", None)

    def read(self, saved: SavedTensors, name: str, p: torch.Tensor) -> torch.Tensor:
        """This rank's flat partition: elements rank·P to (rank + 1)·P of the flattened weight (P the partition
        size), zeros past its end (the last partition's padding)."""
        size = p.ds_tensor.numel()
        first = min(dist.get_rank(self._group(p)) * size, p.ds_numel)
        stop = min(first + size, p.ds_numel)
        part = torch.zeros(size, dtype=torch.float32)
        part[:stop - first] = saved.flat(name, first, stop)
        return part

    def gather(self, p: torch.Tensor, part: torch.Tensor) -> torch.Tensor | None:
        """Collective over the weight's partition group: the whole average in rank 0's host memory (None elsewhere),
        the padding dropped."""
        group = self._group(p)
        # on the weight's device: a frozen weight's partition under offload_param sits in host memory, which NCCL
        # does not gather
        part = part.to(p.device).contiguous()
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part, group=group)
        if dist.get_rank() != 0:
            return None
        return torch.cat(parts)[:p.ds_numel].view(p.ds_shape).cpu()


def layout_of(engine):
    """How `engine` holds its weights, and so where the average's parts live."""
    params = [p for p in engine.model.parameters()]
    if any(isinstance(p, DTensor) for p in params):
        return FSDP2Shards()
    if any(hasattr(p, "ds_tensor") for p in params):
        return ZeroPartitions()
    return WholeWeights(engine)
