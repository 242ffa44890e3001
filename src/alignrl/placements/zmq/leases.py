"""Which dataset rows each sampler works on next, with a staleness bound and nothing lost.

The trainer owns the data order (the checkpointed BatchSampler) and hands it out as leases: a lease is
one step's rows, the weight version they must be generated with, and a seed number. A lease comes back
as a scored batch, or expires (its sampler died), or its batch is refused (too stale): then its rows go
to the front of the queue and the next lease takes them. So every row the sampler draws is trained
exactly once, however samplers and trainer come and go, and a resumed trainer re-issues what its
checkpoint had not trained.

Staleness: a lease granted while L others are outstanding is trained at least L updates later, so at
most `max_staleness` + 1 leases are outstanding at any time (0: strictly on-policy, one at a time).
Pure bookkeeping, no sockets and no clocks of its own: the coordinator passes `now` and holds the lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config import ConfigError
from alignrl.data.sampler import BatchSampler
from alignrl.utils.tracking import console


@dataclass
class Lease:
    id: str  # "<trainer incarnation>:<grant>": unique across trainer restarts
    # 1, 2, ... in the order its rows were drawn: the sampling seed (the in-process step of the same rows); rows
    # handed out again (a dead sampler's, a refused batch's, a checkpoint's outstanding ones) keep theirs
    number: int
    rows: list[int]
    version: int  # weight version the sampler must generate with
    sampler: str
    granted_at: float
    in_training: bool = False  # its batch arrived; it stays outstanding until the update is published

    def answered_by(self, prompt_index: list[int], group: list[int], n: int) -> str | None:
        """What keeps a batch (its rows' prompt indices and group ids) from answering this lease, or None: n
        samples of each leased row, one group per row, so that nothing is trained twice or lost."""
        rows, want = sorted(prompt_index), sorted(r for r in self.rows for _ in range(n))
        if rows != want:
            return (f"it holds {len(rows)} samples of rows {sorted(set(rows))[:8]}, but lease {self.id} is for "
                    f"{n} samples of each of rows {sorted(self.rows)[:8]}")
        if any(not 0 <= g < len(self.rows) for g in group):
            return f"its group ids run outside 0..{len(self.rows) - 1}"
        return None


class Dispatcher:
    def __init__(self, sampler: BatchSampler, max_staleness: int, lease_timeout_s: float, incarnation: str):
        self.sampler, self.max_staleness, self.lease_timeout_s = sampler, max_staleness, lease_timeout_s
        self.incarnation = incarnation
        self.outstanding: dict[str, Lease] = {}
        self.requeue: list[tuple[list[int], int]] = []  # (rows, number) of refused or expired leases, handed out first
        self.issued = 0  # row batches drawn from the sampler: the number of the next one is issued + 1
        self.granted = 0
        self.expired = 0
        self.late: list[Lease] = []  # expired since the coordinator last said so (grant expires leases too)

    def grant(self, sampler_id: str, version: int, now: float) -> Lease | None:
        """A new lease for `sampler_id` at `version`, or None while the staleness bound is reached."""
        self.expire(now)
        if len(self.outstanding) > self.max_staleness:
            return None
        if self.requeue:
            rows, number = self.requeue.pop(0)
        else:
            rows, number = self.sampler.next(), self.issued + 1
            self.issued += 1
        self.granted += 1
        lease = Lease(f"{self.incarnation}:{self.granted}", number, list(rows), version, sampler_id, now)
        self.outstanding[lease.id] = lease
        return lease

    def expire(self, now: float) -> list[Lease]:
        """Leases older than lease_timeout_s (their sampler died or hangs): their rows go back in the queue."""
        old = [lease for lease in self.outstanding.values()
               if not lease.in_training and now - lease.granted_at > self.lease_timeout_s]
        for lease in old:
            self.refuse(lease.id)
            self.expired += 1
        self.late += old
        return old

    def expire_lost(self, last_seen: dict[str, float], now: float, timeout_s: float) -> list[Lease]:
        """Leases of sampler processes not heard from in `timeout_s` (killed, or cut off): their rows go back
        in the queue long before lease_timeout_s, which bounds a sampler that is alive but never delivers."""
        lost = [lease for lease in self.outstanding.values()
                if not lease.in_training and now - last_seen.get(lease.sampler, lease.granted_at) > timeout_s]
        for lease in lost:
            self.refuse(lease.id)
            self.expired += 1
        return lost

    def release(self, sampler_id: str) -> list[Lease]:
        """The leases of a sampler process that said it stops: back in the queue at once."""
        gone = [lease for lease in self.outstanding.values() if lease.sampler == sampler_id and not lease.in_training]
        for lease in gone:
            self.refuse(lease.id)
        return gone

    def take(self, lease_id: str) -> Lease | None:
        """The lease a batch answers, now in training; None if it is unknown (expired, or granted before a
        restart). It still counts as outstanding until `complete`: a lease granted meanwhile would be
        generated with the weights this update is about to replace."""
        lease = self.outstanding.get(lease_id)
        if lease is not None:
            lease.in_training = True
        return lease

    def complete(self) -> list[Lease]:
        """The update on the leases in training is published: they are done."""
        done = [lease for lease in self.outstanding.values() if lease.in_training]
        for lease in done:
            del self.outstanding[lease.id]
        return done

    def refuse(self, lease_id: str) -> None:
        """Its batch will not be trained (too stale, expired): the rows are handed out again first."""
        lease = self.outstanding.pop(lease_id, None)
        if lease is not None:
            self.requeue.insert(0, (lease.rows, lease.number))

    def state_dict(self) -> dict:
        """Outstanding leases count as not trained: a restarted trainer hands their rows out again."""
        queued = sorted(((lease.rows, lease.number) for lease in self.outstanding.values()), key=lambda q: q[1])
        return {"sampler": self.sampler.state_dict(), "issued": self.issued, "expired": self.expired,
                "requeue": [{"rows": list(rows), "number": n} for rows, n in queued + self.requeue]}

    def load_state_dict(self, state: dict) -> None:
        """ConfigError when the checkpoint's queued leases hold another number of prompts than a step now takes: they
        would be handed out, refused and queued again for ever (every row is trained exactly once, in its lease)."""
        # (rows, number); a checkpoint of an older alignrl kept the rows alone: they take numbers as new rows did
        queued = [(q["rows"], int(q["number"])) if isinstance(q, dict) else (q, None) for q in state["requeue"]]
        sizes = sorted({len(rows) for rows, _ in queued} - {self.sampler.batch_size})
        if sizes:
            raise ConfigError(f"the checkpoint holds leased work of {sizes[0]} prompts per step, made with "
                              f"data.train_batch_size={sizes[0]} (--batch-size {sizes[0]}); a step now takes "
                              f"{self.sampler.batch_size}: resume with that batch size, or set "
                              "trainer.resume_mode=disable to start afresh")
        self.sampler.load_state_dict(state["sampler"])
        self.issued, self.expired = int(state["issued"]), int(state.get("expired", 0))  # the run's count goes on
        self.requeue = []
        for rows, number in queued:
            if number is None:
                self.issued += 1
                number = self.issued
            self.requeue.append((list(rows), number))
        self.outstanding = {}


def say_requeued(leases: list[Lease], why: str) -> None:
    """One line for each lease whose prompts went back in the queue, and `why`."""
    for lease in leases:
        console.print(f"pipeline: sampler {lease.sampler} {why}: its {len(lease.rows)} prompts (lease {lease.id}) go "
                      "to the next sampler that asks", markup=False)
