"""The trainer's sync port (rank 0 of a ZeroMQ-placed trainer): a thread that answers samplers' requests.

    hello  -> "welcome" (the run config, this trainer's incarnation, the training rows' digest) or "error"
    work   -> "done" | the newest weights | a lease | "wait" (after PARK_S parked) | "hello" (it skipped hello)
    alive  -> "ok", or "done" once a finished run stops (a heartbeat, also sent while a sampler generates)
    bye    -> "ok"; the sampler's leases go to the next sampler at once

What the thread shares with the training thread (the dispatcher, the weight board's account of samplers, the
core ledger, the reference split) it touches under the one lock both take; between requests it expires the leases
of samplers gone silent and re-counts the threads lent to samplers on this host.
Left out: the data port (batch_receiver), publishing the weights (weight_publisher: the training thread publishes,
then calls `published` here), binding the port (the coordinator binds it and hands the bound Replier over).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from alignrl.config.schema import PipelineConfig
from alignrl.placements.zmq.leases import Dispatcher, say_requeued
from alignrl.placements.zmq.ref_share import RefShare
from alignrl.placements.zmq.thread_lending import CoreLedger
from alignrl.placements.zmq.weight_publisher import WeightBoard, other_base
from alignrl.wire.frames import WireError
from alignrl.wire.zmq_link import Replier

PARK_S = 0.5  # longest a work request waits for a lease before it is answered "wait"
POLL_S = 0.2  # longest the serve loop sleeps before it re-checks parked requests and expired leases


def process_of(meta: dict) -> str:
    """Whom the weight board deals with: one sampler process. --sampler-id names it for people, and two
    processes given the same name must not release each other's hold on a shared weight set."""
    name, proc = str(meta.get("sampler_id", "?")), meta.get("proc")
    return name if proc is None else f"{name}#{proc}"


@dataclass(frozen=True)
class Welcome:
    """What the trainer tells a sampler that says hello, and the base weights it checks the sampler's against."""
    config_yaml: str  # the run config, which the sampler runs under
    incarnation: str  # this trainer process: a sampler holding another's weights or lease asks again
    data_digest: str | None = None  # records.rows_digest of the training rows, which a sampler's own must match
    base_weights: str | None = None  # weights_fingerprint of the base model, where samplers score the KL


class SyncServer:
    """Answers samplers on the sync port from a thread of its own (`start` .. `close`). It owns the bound
    Replier from construction on and closes it; `published` is called by the training thread at each publish."""

    def __init__(self, replier: Replier, board: WeightBoard, dispatcher: Dispatcher, ref_share: RefShare,
                 cores: CoreLedger, lock: threading.Lock, welcome: Welcome, p: PipelineConfig):
        self.replier, self.board, self.dispatcher, self.ref_share = replier, board, dispatcher, ref_share
        self.cores = cores  # pipeline.lend_cores: which of this host's samplers work, and the threads lent them
        self.lock = lock  # shared with the training thread, which publishes weights and takes batches' leases
        self.welcome, self.p = welcome, p
        self.stop = threading.Event()
        self.say_done = True  # once stopped: whether samplers are told the run is over
        self.parked: dict[bytes, tuple[dict, float]] = {}  # work requests waiting for a lease (sync thread)
        self.seen: dict[str, float] = {}  # when each sampler process was last heard from (sync thread)
        self.stopped_at = 0.0  # when close() stopped the server: a request answered after it was told "done"
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="alignrl-sync", daemon=True)
        self.thread.start()

    def close(self, finished: bool) -> None:
        """Stops answering and frees the port. A finished run first tells samplers it is over (they ask within a
        second or two) and they exit; a run that stopped early (an error, Ctrl-C) says nothing, so that samplers
        wait for the restarted trainer (up to their --peer-timeout) as they do after a kill -9."""
        if self.thread is not None:
            self.say_done = finished
            self.stopped_at = time.monotonic()
            self.stop.set()
            self.replier.wake()  # not a poll period later
            self.thread.join(timeout=10 + self.p.heartbeat_timeout_s)  # a finished run's "done" window
        self.replier.close()

    def published(self, version: int) -> None:
        """In the training thread, under the lock, at the end of an update."""
        self.cores.published(time.monotonic())  # before a sampler is answered: its core is its own again
        self.dispatcher.complete()
        self.replier.wake()  # parked work requests can be answered now: weights, then a lease

    def _serve(self) -> None:
        while True:
            if self.stop.is_set():
                self.stopped_at = self.stopped_at or time.monotonic()  # close() sets it as it stops; a bare stop: now
                if not self.say_done or self._all_told(self.stopped_at):
                    return
            try:
                got = self.replier.recv(POLL_S)
            except WireError as e:
                if getattr(e, "peer", None) is not None:
                    self.replier.reply_msg(e.peer, "error", {"message": str(e)})
                got = None
            if got is not None:
                self._guarded(got[0], got[1].kind, self._answer, *got)
            for peer, (meta, since) in list(self.parked.items()):
                if self._guarded(peer, "work", self._work, peer, meta, since) is not False:
                    del self.parked[peer]
            with self.lock:  # the cores of samplers that wait are the training thread's meanwhile
                now = time.monotonic()
                lost = self.dispatcher.expire_lost(self.seen, now, self.p.heartbeat_timeout_s)
                self.dispatcher.expire(now)
                late, self.dispatcher.late = self.dispatcher.late, []
                self.cores.update(self.dispatcher.outstanding, now)
            say_requeued(lost, f"not heard from in {self.p.heartbeat_timeout_s:g} s")
            say_requeued(late, f"past pipeline.lease_timeout_s={self.p.lease_timeout_s:g} s")

    def _all_told(self, stopped_at: float) -> bool:
        """Whether a finished run has said "done" long enough: 3 s, and on until every sampler process heard from in
        the heartbeat window before the end has asked since (each such request is answered "done"), at most a
        heartbeat window more: on a loaded machine a live sampler may not be scheduled within the 3 s, and would then
        wait --peer-timeout for a trainer that is gone."""
        waited = time.monotonic() - stopped_at
        live = [t for t in self.seen.values() if stopped_at - t < self.p.heartbeat_timeout_s]
        return waited > 3.0 + self.p.heartbeat_timeout_s or (waited > 3.0 and all(t >= stopped_at for t in live))

    def _guarded(self, peer: bytes, kind: str, answer, *args):
        """`answer(*args)`; a request whose fields are not what this version sends is answered with one line
        instead of ending the sync thread (which would leave every sampler unanswered)."""
        try:
            return answer(*args)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            self.replier.reply_msg(peer, "error", {"message": f"malformed {kind!r} request ({type(e).__name__}: {e}): "
                                                              "run the same alignrl version on both sides"})
            return None

    def _answer(self, peer: bytes, msg) -> None:
        meta = msg.meta
        self.seen[process_of(meta)] = time.monotonic()
        if msg.kind == "alive":
            self._alive(peer, meta)
        elif msg.kind == "hello":
            self._hello(peer, meta)
        elif msg.kind == "bye":
            self._bye(peer, meta)
        elif msg.kind == "work":
            self.parked.pop(peer, None)  # a sampler asking again replaces its parked request
            now = time.monotonic()
            if not self._work(peer, meta, now):
                self.parked[peer] = (meta, now)
        else:
            self.replier.reply_msg(peer, "error", {"message": f"unknown request {msg.kind!r}"})

    def _alive(self, peer: bytes, meta: dict) -> None:
        """A sampler's heartbeat, also sent while it generates."""
        if not self.stop.is_set():
            self.replier.reply_msg(peer, "ok", {})
        elif self.say_done:  # a sampler still generating when the run ended stops without its batch
            self._done(peer, meta)

    def _done(self, peer: bytes, meta: dict) -> None:
        """Tells a sampler the run is over. It counts as told (`_all_told`) from now, however close to the stop its
        request came: it exits and never asks again, and a finished run would otherwise wait its window out."""
        self.seen[process_of(meta)] = time.monotonic()
        self.replier.reply_msg(peer, "done", {})

    def _hello(self, peer: bytes, meta: dict) -> None:
        """A sampler's first request: its model and reference are checked before it is told the run config."""
        problem = (self.board.check_model(meta.get("manifest"))
                   or other_base(self.welcome.base_weights, meta.get("weights")))
        if problem is None:
            with self.lock:
                problem = self.board.admit(process_of(meta), meta.get("can_map"))
        if problem:
            self.replier.reply_msg(peer, "error", {"message": problem})
            return
        dtypes = {k: v[1] for k, v in self.board.manifest.items()}  # what the sampler holds them in
        self.replier.reply_msg(peer, "welcome", {"config": self.welcome.config_yaml,
                                                 "incarnation": self.welcome.incarnation, "dtypes": dtypes,
                                                 "data": self.welcome.data_digest})

    def _bye(self, peer: bytes, meta: dict) -> None:
        """A sampler stopping (Ctrl-C, kill): its prompts go to the next one now."""
        self.parked = {p: m for p, m in self.parked.items() if process_of(m[0]) != process_of(meta)}
        self.seen.pop(process_of(meta), None)  # gone: a finished run need not wait to tell it so
        with self.lock:
            gone = self.dispatcher.release(process_of(meta))
        say_requeued(gone, "stopped")  # said before the reply: whoever reads the log after the "ok" finds it there
        self.replier.reply_msg(peer, "ok", {})

    def _work(self, peer: bytes, meta: dict, since: float) -> bool:
        """Answers a work request if it can: "done", the newest weights, or a lease. While the staleness
        bound allows no lease, the request is parked (False) and answered as soon as the next publish
        frees one, instead of the sampler sleeping and asking again: that sleep was a bubble in every
        step of a balanced pipeline. After PARK_S it is answered "wait", well within the sampler's timeout."""
        if self.stop.is_set():  # unanswered when the run stopped early: the sampler asks the next trainer
            if self.say_done:
                self._done(peer, meta)
            return True
        sampler, now, incarnation = process_of(meta), time.monotonic(), self.welcome.incarnation
        with self.lock:
            if not self.board.knows(sampler):  # it skipped hello: its model and data were never checked
                self.replier.reply_msg(peer, "hello", {"incarnation": incarnation})
                return True
            self.cores.asked(sampler, meta)
            problem = self.board.admit(sampler, meta.get("can_map"))  # a restarted trainer meets it here
            if problem:
                self.cores.answered(sampler, now)
                self.replier.reply_msg(peer, "error", {"message": problem})
                return True
            if self.board.stale(sampler, (meta.get("incarnation"), meta.get("version"))):
                self.cores.answered(sampler, now)  # it maps the weights and asks again at once
                self.replier.reply(peer, self.board.frames_for(sampler))  # the newest weights first
                return True
            lease = self.dispatcher.grant(sampler, self.board.version, now)
            if lease is None and now - since < PARK_S:
                return False
            ref_groups = self.ref_share.groups
            lend = self.cores.leased(sampler, lease.id, now) if lease is not None else 0
            if lease is None:
                self.cores.answered(sampler, now)
        if lease is None:
            self.replier.reply_msg(peer, "wait", {"retry_s": 0.0})
        elif not self.replier.reply_msg(peer, "lease", {"lease": lease.id, "number": lease.number, "rows": lease.rows,
                                                        "version": lease.version, "incarnation": incarnation,
                                                        "ref_groups": ref_groups, "threads": lend}):
            with self.lock:  # the sampler is gone: its rows go to the next one at once
                self.dispatcher.refuse(lease.id)
        return True
