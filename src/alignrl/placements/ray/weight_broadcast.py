"""Weight sync from actor rank 0 to the rollout engines: a bucketed collective broadcast in a process
group of its own (rank 0 = actor rank 0, ranks 1..E = the engines), over a TCPStore that actor rank 0
serves. Gloo on CPU, NCCL on GPUs. The actor group's own torch.distributed world is not touched.

Both ends derive the same bucket plan from the same parameter manifest (names, shapes, dtypes in
order), so only raw tensor bytes cross: a header tensor [version, manifest digest, buckets, partial], then one
flat tensor per bucket (one dtype each). Never one message per tensor, never pickle. A partial update (a policy with
LoRA adapters or frozen parameters sends only what a step changed) puts its names, as JSON, in the group's store
first; the engines take that part of their own manifest.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]


class SyncError(RuntimeError):
    """The engines hold another model than the actor; one line naming the difference."""


def manifest(named: Sequence[tuple[str, torch.Tensor]]) -> Manifest:
    return [(n, tuple(t.shape), t.dtype) for n, t in named]


def digest(m: Manifest) -> int:
    text = ";".join(f"{n}:{list(s)}:{d}" for n, s, d in m)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def buckets(m: Manifest, bucket_bytes: int) -> list[list[int]]:
    """Indices of the manifest, grouped into single-dtype buckets of about `bucket_bytes` (a larger
    tensor travels alone)."""
    out: list[list[int]] = []
    by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, (_, shape, dtype) in enumerate(m):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        idx, used = by_dtype.get(dtype, ([], 0))
        if idx and used + size > bucket_bytes:
            out.append(idx)
            idx, used = [], 0
        by_dtype[dtype] = (idx + [i], used + size)
    out += [idx for idx, _ in by_dtype.values() if idx]
    return out


class BroadcastGroup:
    """One end of the weight-sync group. `rank` 0 sends; the others receive."""

    def __init__(self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float,
                 device: torch.device):
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore("alignrl-weights", store)
        self.store, self.rank = store, rank  # the store lives as long as the group
        self.names_key: str | None = None  # the store's key of the last partial update's names
        self.device = device if backend == "nccl" else torch.device("cpu")  # gloo: staged through host memory
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefix, rank, size, dist.ProcessGroupNCCL.Options())
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast([t], dist.BroadcastOptions()).wait()
        return t

    def send(self, named: Sequence[tuple[str, torch.Tensor]], version: int, bucket_bytes: int,
             partial: bool = False) -> int:
        """Broadcasts `named` (rank 0): the whole model, or with `partial` some of its parameters; returns the
        number of buckets sent."""
        m = manifest(named)
        plan = buckets(m, bucket_bytes)
        if self.names_key is not None:  # every engine acknowledged the update that used it
            self.store.delete_key(self.names_key)
            self.names_key = None
        if partial:
            self.names_key = f"alignrl-weights/names/{version}"
            self.store.set(self.names_key, json.dumps([n for n, _ in named]))
        self._bcast(torch.tensor([version, digest(m), len(plan), int(partial)], dtype=torch.int64,
                                 device=self.device))
        for idx in plan:
            flat = torch.cat([named[i][1].detach().reshape(-1).to(self.device) for i in idx])
            self._bcast(flat.contiguous())
        return len(plan)

    def receive(self, m: Manifest, bucket_bytes: int) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(version, named tensors) from rank 0; `m` is this end's manifest (the same model)."""
        header = self._bcast(torch.zeros(4, dtype=torch.int64, device=self.device)).tolist()
        version, theirs, n, partial = header
        if partial:
            names = json.loads(self.store.get(f"alignrl-weights/names/{version}"))
            mine = {entry[0]: entry for entry in m}
            m = [mine[name] for name in names if name in mine]
        plan = buckets(m, bucket_bytes)
        if theirs != digest(m) or n != len(plan):
            raise SyncError("the actor's parameters differ from this rollout engine's (names, shapes or dtypes): "
                            "start every group from the same --pretrain")
        out = []
        for idx in plan:
            sizes = [torch.Size(m[i][1]).numel() for i in idx]
            flat = self._bcast(torch.empty(sum(sizes), dtype=m[idx[0]][2], device=self.device))
            for i, part in zip(idx, flat.split(sizes)):
                out.append((m[i][0], part.view(m[i][1])))
        return version, out
