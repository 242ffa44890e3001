"""Micro-batches side by side on a CPU ("lanes").

With a small model, much of a forward and backward is element-wise kernels and Python dispatch that gain little
from a second OpenMP thread, while the matmuls gain almost twice. So instead of giving every op all T torch
threads, L lanes take T // L threads each and each lane runs its own share of the micro-batches, one after
the other; torch releases the GIL inside its ops, so the lanes overlap. A lane is a thread of a pool kept for
the process (its OpenMP team is made once).

Results are the same whatever the timing: which micro-batch runs in which lane depends on their sizes alone
(`lanes_of`), each lane runs its own in order, and what the lanes return is summed in lane order (`lane_sums`).
Grad mode is per thread in torch, so each lane takes the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch
import torch.distributed

T = TypeVar("T")
_POOLS: dict[int, ThreadPoolExecutor] = {}


def lane_count(wanted: int, device: torch.device | str) -> int:
    """Lanes to use now: `wanted` (trainer.cpu_lanes) on a CPU, no more than this process's torch threads (a
    process fitted to one free core runs one lane); 1 on an accelerator and in a rank of a distributed group."""
    if torch.device(device).type != "cpu" or wanted <= 1:
        return 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 1  # a rank's forwards may hold collectives (FSDP2, ZeRO-3), which must come in one order
    return max(1, min(wanted, torch.get_num_threads()))


def lanes_of(sizes: Sequence[float], lanes: int) -> list[list[int]]:
    """The job indices each lane runs, in order, for jobs of `sizes` (their tokens): the largest job first to the
    least loaded lane, so the lanes end together; the same sizes always give the same plan."""
    lanes = max(1, min(lanes, len(sizes)))
    plan: list[list[int]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: equal sizes keep their order
        lane = min(range(lanes), key=lambda j: load[j])
        plan[lane].append(i)
        load[lane] += sizes[i]
    return [sorted(p) for p in plan]


def run_lanes(work: Sequence[Callable[[], T]]) -> list[T]:
    """Runs each of `work` in a lane of its own, side by side, each on an equal share of the caller's torch
    threads; their results in order. One item runs in the calling thread as it is. Every lane finishes before
    an error of any is raised, so none is left running."""
    if len(work) <= 1:
        return [w() for w in work]
    threads = max(1, torch.get_num_threads() // len(work))
    grad = torch.is_grad_enabled()

    def lane(w: Callable[[], T]) -> T:
        torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread: the caller keeps its own
        with torch.set_grad_enabled(grad):
            return w()

    pool = _POOLS.get(len(work))
    if pool is None:
        pool = _POOLS[len(work)] = ThreadPoolExecutor(len(work), thread_name_prefix="alignrl-lane")
    futures = [pool.submit(lane, w) for w in work]
    wait(futures)
    return [f.result() for f in futures]


def in_job_order(plan: list[list[int]], per_lane: list[list[T]]) -> list[T]:
    """Each lane's results (in its jobs' order, as `lanes_of` planned them) back in the jobs' own order."""
    placed: dict[int, T] = {}
    for jobs, results in zip(plan, per_lane):
        placed.update(zip(jobs, results))
    return [placed[i] for i in range(len(placed))]


def lane_sums(per_lane: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Element-wise sums of each lane's tensors (None: no gradient there), added in lane order."""
    total = list(per_lane[0])
    for other in per_lane[1:]:
        total = [b if a is None else a if b is None else a + b for a, b in zip(total, other)]
    return total
