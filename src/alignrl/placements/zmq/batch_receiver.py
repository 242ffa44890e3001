"""The trainer's data port (ZeroMQ pipeline): scored batches from samplers, each checked before it is trained.

Rank 0 receives: a batch is taken only if it answers an outstanding lease whole and lies within the staleness
bound; one that does not gives its lease's rows back to the queue, so that another sampler makes them. Every rank
keeps the account of what was taken (the counts of dropped and malformed batches, the staleness histogram, the
last step delivered, the lease book) since each checkpoints it; rank 0 alone also writes logs/prompts.jsonl.
Left out: handing batches to the other ranks and the step's metrics (coordinator.PipelineSource), the sync port
(sync_server), binding the port (the coordinator binds it and hands the bound Puller over).
"""

from __future__ import annotations

import threading
import time

from alignrl.config import RunConfig
from alignrl.data.records import ScoredBatch
from alignrl.errors import UserError
from alignrl.placements.zmq.leases import Dispatcher, Lease
from alignrl.placements.zmq.prompt_log import RowLog
from alignrl.placements.zmq.ref_share import RefShare
from alignrl.rl.scoring import put_columns
from alignrl.utils.tracking import console
from alignrl.wire.frames import Message, WireError, decode
from alignrl.wire.records import from_wire
from alignrl.wire.zmq_link import Puller


class PipelineError(UserError):
    """The pipeline cannot go on (no sampler delivers); one line naming what to start or check."""


class BatchReceiver:
    """`puller` and `rows` are rank 0's (None on the other ranks: rank 0 alone receives and logs). `trainer`
    gives the current weight version, against which a batch's staleness is measured."""

    def __init__(self, puller: Puller | None, rows: RowLog | None, dispatcher: Dispatcher, ref_share: RefShare,
                 lock: threading.Lock, trainer, cfg: RunConfig, token: str):
        self.puller, self.rows, self.trainer = puller, rows, trainer
        self.dispatcher, self.ref_share = dispatcher, ref_share
        self.lock = lock  # the sync thread's too: it grants and expires the leases this port checks batches against
        self.p, self.group_size, self.token = cfg.pipeline, cfg.rollout.n, token
        self.counters = {"dropped_stale": 0, "dropped_unknown": 0, "malformed": 0}
        self.staleness_hist: dict[int, int] = {}
        self.delivered = 0  # steps this trainer has received batches for (resumed from checkpoints)

    def receive(self, step: int) -> tuple[list, Message, ScoredBatch]:
        """The next acceptable batch (rank 0), as frames and parsed: a known lease, within the staleness bound,
        its rows those of the lease. One that is not (stale, or malformed) gives its lease's rows back to the
        queue, so that another sampler makes them."""
        deadline = time.monotonic() + self.p.peer_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineError(
                    f"no sampler delivered a batch for step {step} in {self.p.peer_timeout_s:g} s: start one with "
                    f"`python sampling_worker.py --data-port {self.p.data_port} --sync-port {self.p.sync_port}` "
                    "(or `alignrl sample`), or raise pipeline.peer_timeout_s")
            try:  # a message of absurdly many frames is dropped whole: one malformed line, as any other
                raw = self.puller.recv_frames(min(left, 1.0))
                if raw is None:
                    continue
                msg = decode(raw, self.token)
                version, lease_id = msg.meta.get("version"), str(msg.meta.get("lease"))
            except WireError as e:
                self._malformed(None, e)
                continue
            with self.lock:
                lease = self.dispatcher.outstanding.get(lease_id)
                if lease is None or lease.in_training:
                    self.counters["dropped_unknown"] += 1  # expired, or granted before a trainer restart
                    continue
                if not isinstance(version, int) or self.trainer.version - version > self.p.max_staleness:
                    self.dispatcher.refuse(lease_id)
                    self.counters["dropped_stale"] += 1
                    continue
            try:
                batch = self._parse(msg, lease)
            except (WireError, TypeError, ValueError, AttributeError, IndexError, KeyError) as e:  # a foreign batch
                self._malformed(lease_id, e)
                continue
            with self.lock:
                if self.dispatcher.take(lease_id) is None:  # expired while it was parsed
                    self.counters["dropped_unknown"] += 1
                    continue
            return raw, msg, batch

    def checked(self, frames: list) -> tuple[Message, ScoredBatch]:
        """The other ranks' copy of the batch rank 0 took: rank 0 has checked these frames."""
        msg = decode(frames, self.token)
        return msg, batch_of(msg)

    def taken(self, step: int, msg: Message, batch: ScoredBatch, waited: float,
              sampler_wait: float) -> tuple[int, dict[str, float]]:
        """Every rank, once the step's batch is taken (`waited`: seconds the trainer waited for it, `sampler_wait`:
        the sampler's own wait): the batch's staleness, and what rank 0's data port counts for the step's metrics.
        The reference split follows the step's waits; rank 0 logs the batch's rows."""
        with self.lock:
            depth = len(self.dispatcher.outstanding)
            self.ref_share.observe(waited, sampler_wait)  # the next lease's split
        staleness = self.trainer.version - batch.version
        self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1
        self.delivered = step
        if self.rows is not None:
            self.rows.write(step, batch.version, msg.meta.get("lease"), batch.sampler_id, batch.prompt_index.tolist())
        counted = {"pipeline/ref_groups_sampler": float(self.ref_share.groups),  # the next lease's
                   "pipeline/queue_depth": float(depth), "pipeline/leases_expired": float(self.dispatcher.expired),
                   **{f"pipeline/{k}": float(v) for k, v in self.counters.items()}}
        return staleness, counted

    def staleness_metrics(self) -> dict[str, float]:
        """How many batches of each staleness the run has trained (across resumes)."""
        return {f"pipeline/staleness_{k}": float(v) for k, v in self.staleness_hist.items()}

    def start_log(self) -> None:
        """Before the first batch: a fresh start (no step delivered yet) moves an earlier run's prompts.jsonl
        aside, so that the file accounts for this run's steps alone."""
        if self.rows is not None and self.delivered == 0:
            self.rows.start_fresh()

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()

    def _parse(self, msg: Message, lease: Lease) -> ScoredBatch:
        """The batch in `msg`, checked before it is trained: WireError if it does not answer `lease` whole."""
        batch = batch_of(msg)
        self.ref_share.check(batch)
        float(msg.meta.get("wait_s", 0.0))  # read by the step's metrics: a value of another kind fails here instead
        problem = lease.answered_by(batch.prompt_index.tolist(), batch.rollout.group.tolist(), self.group_size)
        if problem:
            raise WireError(f"the batch does not answer its lease: {problem}")
        return batch

    def _malformed(self, lease_id: str | None, e: Exception) -> None:
        """A batch that cannot be trained is skipped with one line; its lease's rows are handed out again."""
        self.counters["malformed"] += 1
        if lease_id is not None:
            with self.lock:
                self.dispatcher.refuse(lease_id)
        console.print(f"[yellow]pipeline: ignored a malformed message on the data port: {e}[/yellow]")

    def state_dict(self) -> dict:
        with self.lock:
            return {"dispatch": self.dispatcher.state_dict(), "step": self.delivered, "counters": dict(self.counters),
                    "staleness": dict(self.staleness_hist)}  # the run's totals go on across a resume

    def load_state_dict(self, state: dict) -> None:
        """Also forgets the logged steps after the checkpoint: they are trained again."""
        with self.lock:
            self.dispatcher.load_state_dict(state["dispatch"])
        self.delivered = int(state["step"])
        self.counters.update(state.get("counters", {}))
        self.staleness_hist = {int(k): int(v) for k, v in state.get("staleness", {}).items()}
        if self.rows is not None:
            self.rows.keep_until(self.delivered)


def batch_of(msg: Message) -> ScoredBatch:
    """The batch in `msg`, with the columns TRL's reward functions logged of its rows (for the rollout dumps)."""
    batch = from_wire(msg)
    put_columns(batch.rollout, msg.meta.get("columns"))
    return batch
