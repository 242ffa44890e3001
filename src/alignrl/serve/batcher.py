"""Collect concurrent requests and run them through the model as one batch, in one worker thread.

A request is `(key, payload, size)`: requests with equal keys (e.g. the same sampling parameters)
that arrive within `window_s` of each other, or while the previous batch is still running, go to
one `run(key, payloads)` call, up to `max_size` total size (sequences). `run` executes on a single
worker thread, so the model sees one batch at a time and the event loop keeps answering `/health`
and new requests meanwhile. The same thread runs weight swaps (`call`), so a swap always falls
between two batches, never inside one.

Deliberately left out: continuous batching (joining a batch mid-decode), priorities, preemption.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

P = TypeVar("P")
R = TypeVar("R")


@dataclass
class BatchStats:
    requests: int = 0  # requests answered by the engine
    batches: int = 0  # `run` calls
    items: int = 0  # total size (sequences) of all requests
    running: int = 0  # requests in the engine now (vLLM's num_requests_running): 0 while it waits for work

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "engine_batches": self.batches, "sequences": self.items,
                "running": self.running}


@dataclass
class _Pending:
    key: Hashable
    payload: Any
    size: int
    future: asyncio.Future = field(repr=False)


class Batcher(Generic[P, R]):
    def __init__(self, run: Callable[[Hashable, list[P]], list[R]], window_s: float = 0.005,
                 max_size: int = 256):
        self.run, self.window_s, self.max_size = run, window_s, max_size
        self.stats = BatchStats()
        # One thread: the model is not re-entrant, and serialising here is what keeps swaps atomic.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.lock = threading.Lock()  # held by every batch and swap; also guards direct callers
        self._pending: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, key: Hashable, payload: P, size: int) -> R:
        """Queue one request and wait for its result (exceptions from `run` propagate)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._drain())
        fut = loop.create_future()
        self._pending.append(_Pending(key, payload, size, fut))
        self._wake.set()
        return await fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between batches (weight swaps)."""
        def locked():
            with self.lock:
                return fn()
        return await asyncio.get_running_loop().run_in_executor(self._executor, locked)

    def _take_batch(self) -> list[_Pending]:
        """The oldest request plus every later one with its key, up to max_size (the first always goes)."""
        first = self._pending[0]
        batch, rest, size = [], [], 0
        for p in self._pending:
            if p.key == first.key and (not batch or size + p.size <= self.max_size):
                batch.append(p)
                size += p.size
            else:
                rest.append(p)
        self._pending = rest
        return batch

    def _run_locked(self, key: Hashable, payloads: list[P]) -> list[R]:
        with self.lock:
            return self.run(key, payloads)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)  # let requests sent at the same moment join
            while self._pending:
                batch = [p for p in self._take_batch() if not p.future.done()]  # drop cancelled
                if not batch:
                    continue
                self.stats.running = len(batch)
                try:
                    results = await loop.run_in_executor(self._executor, self._run_locked, batch[0].key,
                                                         [p.payload for p in batch])
                except Exception as e:  # noqa: BLE001 - handed to each waiting request
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(e)
                    continue
                finally:
                    self.stats.running = 0
                self.stats.batches += 1
                self.stats.requests += len(batch)
                self.stats.items += sum(p.size for p in batch)
                for p, r in zip(batch, results):
                    if not p.future.done():
                        p.future.set_result(r)
            self._wake.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def flat_pairs(jobs: list[tuple[list, list]]) -> tuple[list, list]:
    """The prompts and the responses of a batch of `(prompts, responses)` requests, each as one list."""
    return [p for j in jobs for p in j[0]], [r for j in jobs for r in j[1]]


def per_job(rows: list[R], jobs: list[tuple[list, list]]) -> list[list[R]]:
    """One result row per pair of `flat_pairs(jobs)`, handed back as each request's own list."""
    out, start = [], 0
    for prompts, _ in jobs:
        out.append(rows[start:start + len(prompts)])
        start += len(prompts)
    return out
