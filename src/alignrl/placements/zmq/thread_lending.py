"""Cores follow the work when a CPU trainer and its samplers share one machine (`pipeline.lend_cores`).

Each process has its share of the cores (trainer.threads, the sampler's --threads), and in a pipeline one side
often waits for the other: a sampler whose batch is made waits for the next lease while the trainer updates,
and at max_staleness=0 the trainer waits while the sampler generates. A waiting process's cores sit idle. So:

- the training thread runs with its own threads plus those of the samplers on its machine that are not
  generating (their batch is made; they wait for a lease), never more than the cores the others leave free;
  it checks at the policy's layers, forward and backward, so a sampler that gets its lease has its core
  back within a layer;
- on policy (max_staleness=0) the trainer waits for every batch: each lease lends it the trainer's threads,
  and the sampler generates that batch with its own plus those.

Float sums split over another number of threads may round differently, so with lending a run is not guaranteed
bit-repeatable (on this repository's CPU the on-policy test still ends with the in-process run's exact weights);
pipeline.lend_cores=false keeps each process at its own count. GPU trainers and samplers never lend.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ThreadLoan:
    """The training thread's count of intra-op threads: its own, or `want` (set by the sync thread's CoreLedger).
    torch's thread count belongs to the thread that sets it, so only the training thread calls `apply` (through
    its model's hooks) and `settle`."""

    def __init__(self, own: int, cores: int | None = None):
        self.own, self.cores = own, cores or machine_cores()
        self.want = self.now = own

    def apply(self, *_) -> None:
        if self.want != self.now:
            torch.set_num_threads(self.want)
            self.now = self.want

    def settle(self) -> None:
        """Back to its own share, at the end of an update, and wanting no more until the ledger says otherwise:
        the samplers are about to be answered."""
        self.want = self.own
        if self.now != self.own:
            torch.set_num_threads(self.own)
            self.now = self.own

    def install(self, model: torch.nn.Module) -> None:
        """Checks at each of the model's layers (the members of its ModuleLists): before its forward and, through
        a hook on its output, before its backward (CPU autograd runs in the thread that calls backward)."""
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(self.apply)
                    layer.register_forward_hook(self._watch_backward)

    def _watch_backward(self, _module, _args, out) -> None:
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(self._before_backward)

    def _before_backward(self, _grad) -> None:
        self.apply()


def local_threads(meta: dict, host: str) -> int:
    """The threads a sampler's request says it runs, if it runs on this host (else its cores are not ours)."""
    can_map, threads = meta.get("can_map"), meta.get("threads")
    if isinstance(can_map, dict) and can_map.get("host") == host and type(threads) is int and threads > 0:
        return threads
    return 0


# a sampler answered with weights (or "wait") asks again within milliseconds; one silent for longer is gone
ANSWERED_S = 2.0


@dataclass
class _Sampler:
    threads: int
    parked: bool = True  # its work request waits for an answer: its batch is made and its cores are idle
    lease: str | None = None  # the lease it generates for
    lent: int = 0  # threads that lease lends it
    answered_at: float = 0.0


class CoreLedger:
    """The sync thread's account of this host's samplers (under the coordinator's lock): their threads, and which
    of them work. A sampler is idle exactly while its work request is parked; from the answer on it works
    (loads weights, asks again, generates) until its next request. Without a loan it does nothing."""

    def __init__(self, loan: ThreadLoan | None, host: str, lend_to_samplers: bool):
        self.loan, self.host, self.lend_to_samplers = loan, host, lend_to_samplers
        self.samplers: dict[str, _Sampler] = {}

    def asked(self, sampler: str, meta: dict) -> None:
        """A request: the sampler has made its last batch (it asks only after pushing it)."""
        n = local_threads(meta, self.host) if self.loan is not None else 0
        if n:
            self.samplers[sampler] = _Sampler(n)

    def answered(self, sampler: str, now: float) -> None:
        entry = self.samplers.get(sampler)
        if entry is not None:
            entry.parked, entry.answered_at = False, now

    def leased(self, sampler: str, lease_id: str, now: float) -> int:
        """`sampler` generates for `lease_id` now; returns the threads lent to it for that batch."""
        entry = self.samplers.get(sampler)
        if entry is None:
            return 0
        self.answered(sampler, now)
        entry.lease, entry.lent = lease_id, self.loan.own if self.lend_to_samplers else 0
        return entry.lent

    def published(self, now: float) -> None:
        """In the training thread, at a publish: every parked request is about to be answered (with the new
        weights), so the samplers work again from here; the trainer goes back to its own share at once, before
        the sync thread answers them, lest its next layer take a core a sampler is taking back."""
        for sampler, entry in self.samplers.items():
            if entry.parked:  # one that died while working stays busy no longer than ANSWERED_S
                self.answered(sampler, now)
        if self.loan is not None:
            self.loan.settle()

    def update(self, outstanding: dict, now: float) -> None:
        """The training thread's share: its own plus the threads of the samplers here that are idle, within the
        cores the working ones leave free (the samplers' own counts may add up to more than the cores). A sampler
        that holds no lease and has said nothing for ANSWERED_S since its answer is gone: its cores are free."""
        if self.loan is None:
            return
        busy = sum(e.threads + e.lent for e in self.samplers.values()
                   if not e.parked and (e.lease in outstanding or now - e.answered_at < ANSWERED_S))
        pool = self.loan.own + sum(e.threads for e in self.samplers.values())
        self.loan.want = max(self.loan.own, min(pool - busy, self.loan.cores - busy))


@contextmanager
def borrowed(own: int, lent: object):
    """A sampler's threads while it makes a batch: its own plus those its lease lends (a GPU sampler, own 0,
    takes none), never more than the machine's cores."""
    more = min(lent, machine_cores() - own) if own and type(lent) is int and lent > 0 else 0
    if more > 0:
        torch.set_num_threads(own + more)
    try:
        yield
    finally:
        if more > 0:
            torch.set_num_threads(own)
