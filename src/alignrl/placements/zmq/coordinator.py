"""The trainer's end of the ZeroMQ placement (seed 004): it hands out work and weights on the sync port,
receives scored batches on the data port, and is both the BatchSource and the WeightSink of the loop.

    sampler --work?--> Replier (sync port) --lease | weights | wait | done--> sampler
    sampler --scored batch--> Puller (data port) --> next_batch --> PolicyTrainer --> publish(version)

Rank 0 owns the sockets: a server thread answers samplers (it touches only the dispatcher and the weight
board, under one lock); the training thread receives batches, checks lease and staleness, broadcasts the
accepted batch's frames to the other ranks, and each rank trains on its share of the prompt groups.
Deliberately left out: several trainers per sampler set, priorities between samplers, partial batches.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import torch

from alignrl.placements.build import build_critics, build_ref
from alignrl.rl.rollout_ops import shard_groups
from alignrl.config.checks import needs_reference
from alignrl.config import RunConfig
from alignrl.data.records import ScoredBatch
from alignrl.data.sampler import BatchSampler
from alignrl.placements.zmq.weight_publisher import WeightBoard, other_base
from alignrl.placements.zmq.thread_lending import CoreLedger, ThreadLoan
from alignrl.placements.zmq.leases import Dispatcher, Lease, say_requeued
from alignrl.runtime.env import DistEnv, all_reduce_sum, broadcast_frames
from alignrl.wire.records import from_wire
from alignrl.placements.zmq.ref_share import RefShare, sampler_needs_ref, trainer_needs_ref
from alignrl.placements.zmq.prompt_log import RowLog
from alignrl.wire.shared_weights import host_id
from alignrl.errors import UserError
from alignrl.wire.frames import Message, WireError, decode
from alignrl.wire.zmq_link import InsecureBind, PortInUse, Puller, Replier, token_from_env
from alignrl.models.folder import weights_fingerprint
from alignrl.models.loader import resolve_model_path
from alignrl.train.actor import Actor
from alignrl.utils.tracking import console

PARK_S = 0.5  # longest a work request waits for a lease before it is answered "wait"


def process_of(meta: dict) -> str:
    """Whom the weight board deals with: one sampler process. --sampler-id names it for people, and two
    processes given the same name must not release each other's hold on a shared weight set."""
    name, proc = str(meta.get("sampler_id", "?")), meta.get("proc")
    return name if proc is None else f"{name}#{proc}"


class PipelineError(UserError):
    """The pipeline cannot go on (no sampler delivers); one line naming what to start or check."""


class Coordinator:
    """BatchSource and WeightSink of a trainer fed by ZeroMQ samplers."""

    def __init__(self, cfg: RunConfig, config_yaml: str, log_dir: Path, data_digest: str | None = None):
        """`data_digest`: records.rows_digest of the training rows, which a sampler's own must match."""
        self.cfg, self.p, self.config_yaml, self.rows = cfg, cfg.pipeline, config_yaml, RowLog(log_dir)
        self.data_digest = data_digest
        self.base_weights: str | None = None  # weights_fingerprint of the base model, where samplers score the KL
        self.token = token_from_env()
        self.lock = threading.Lock()
        self.incarnation = uuid.uuid4().hex[:8]
        self.stop = threading.Event()
        self.say_done = True  # close(): whether samplers are told the run is over
        self.dispatcher: Dispatcher | None = None
        self.ref_share: RefShare | None = None
        self.board: WeightBoard | None = None
        self.counters = {"dropped_stale": 0, "dropped_unknown": 0, "malformed": 0}
        self.staleness_hist: dict[int, int] = {}
        self.env: DistEnv | None = None
        self.started, self.thread = False, None  # the sync thread, started at the first batch
        self.puller, self.replier = None, None  # rank 0's sockets (Puller, Replier), bound by source()
        self.parked: dict[bytes, tuple[dict, float]] = {}  # work requests waiting for a lease (sync thread)
        self.seen: dict[str, float] = {}  # when each sampler process was last heard from (sync thread)
        self.delivered = 0  # steps this trainer has received batches for (resumed from checkpoints)
        self.cores = CoreLedger(None, "", False)  # pipeline.lend_cores: set up with the policy (sink)

    # --- the RemoteProducers protocol of the runner -------------------------------------------------
    def sink(self, actor: Actor, env: DistEnv) -> WeightBoard:
        self.env = env
        self.board = WeightBoard(actor, env, self.p, self.token, self.lock, self._published, self.incarnation)
        # the base weights a sampler's reference must have: other weights of the same shapes pass the manifest
        # check, and the KL term would then be measured against another model
        self.base_weights = (weights_fingerprint(resolve_model_path(self.cfg.model.path, log=lambda *_: None))
                             if env.is_main and needs_reference(self.cfg) and sampler_needs_ref(self.cfg) else None)
        if self.p.lend_cores and env.world_size == 1 and env.device.type == "cpu":
            loan = ThreadLoan(torch.get_num_threads())
            loan.install(actor.model)
            self.cores = CoreLedger(loan, host_id(), lend_to_samplers=self.p.max_staleness == 0)
        return self.board

    def critics(self, cfg: RunConfig, resume: Path | None, env: DistEnv):
        """The critics train in this process, beside the policy."""
        return build_critics(cfg, resume, env)

    def evaluator(self, pad_id: int) -> None:
        return None  # samplers only make batches: the trainer's rank 0 evaluates on its own weights

    def source(self, sampler: BatchSampler, trainer, env: DistEnv) -> Coordinator:
        self.trainer, self.env = trainer, env
        self.dispatcher = Dispatcher(sampler, self.p.max_staleness, self.p.lease_timeout_s, self.incarnation)
        # the trainer's own frozen reference, for the rows samplers leave to it (pipeline.ref_logprobs)
        self.ref_share = RefShare(self.cfg, build_ref(self.cfg, env.device)
                                  if trainer_needs_ref(self.cfg) else None)
        failed = self._bind() if env.is_main else None
        # rank 0 alone binds: the others learn here that it could not, and stop with it instead of failing at
        # the next collective with gloo's "connection closed" traceback
        if all_reduce_sum(env, [float(failed is not None)])[0]:
            raise failed or PipelineError("rank 0 could not bind the pipeline's ports (its error says why)")
        return self

    def _bind(self) -> Exception | None:
        """Binds the data and sync ports; a taken port or an unsafe host comes back as the error to raise."""
        try:
            self.puller = Puller(self.p.host, self.p.data_port, hwm=self.p.hwm, token=self.token)
            self.replier = Replier(self.p.host, self.p.sync_port, token=self.token)
        except (OSError, PortInUse, InsecureBind) as e:  # OSError: a host that is not this machine's
            if self.puller is not None:
                self.puller.close()
            return e
        console.print(f"pipeline: waiting for samplers on {self.puller.addr} (data) and {self.replier.addr} "
                      f"(sync), max_staleness={self.p.max_staleness}")
        return None

    def _start(self) -> None:
        """Publish the starting weights (after any resume) and begin answering samplers. A fresh start moves an
        earlier run's prompts.jsonl aside: the file accounts for this run's steps alone."""
        if self.env.is_main and self.delivered == 0:
            self.rows.start_fresh()
        self.board.publish(self.trainer.version)
        self.started = True
        if self.env.is_main:
            self.thread = threading.Thread(target=self._serve, name="alignrl-sync", daemon=True)
            self.thread.start()

    def close(self, finished: bool) -> None:
        """Releases the ports. A finished run first tells samplers it is over (they ask within a second or
        two) and they exit; a run that stopped early (an error, Ctrl-C) says nothing, so that samplers wait
        for the restarted trainer (up to their --peer-timeout) as they do after a kill -9. A run that stops before
        its first batch (a mistake found at its resume, say) frees the ports too."""
        if self.thread is not None:
            self.say_done = finished
            self.stop.set()
            self.thread.join(timeout=10)
        for part in (self.puller, self.replier, self.board):
            if part is not None:
                part.close()

    # --- BatchSource ---------------------------------------------------------------------------------
    def next_batch(self, step: int) -> ScoredBatch:
        """Collective: every rank calls it with the same step."""
        if not self.started:
            self._start()
        t0 = time.perf_counter()
        frames, msg, batch = self._receive(step) if self.env.is_main else (None, None, None)
        if self.env.distributed:
            frames = broadcast_frames(frames, self.env)
        if batch is None:  # the other ranks: rank 0 has checked these frames
            msg = decode(frames, self.token)
            batch = from_wire(msg)
        waited, sampler_wait = time.perf_counter() - t0, float(msg.meta.get("wait_s", 0.0))
        with self.lock:
            depth = len(self.dispatcher.outstanding) if self.dispatcher else 0
            self.ref_share.observe(waited, sampler_wait)  # the next lease's split
        staleness = self.trainer.version - batch.version
        self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1
        self.delivered = step
        if self.env.is_main:
            self.rows.write(step, batch.version, msg.meta.get("lease"), batch.sampler_id, batch.prompt_index.tolist())
        # what rank 0 alone counts (it receives, leases and checks), on every rank: the step's metrics are
        # averaged over ranks, which divided these by the number of ranks
        counted = {"pipeline/ref_groups_sampler": float(self.ref_share.groups),  # the next lease's
                   "pipeline/queue_depth": float(depth), "pipeline/leases_expired": float(self.dispatcher.expired),
                   **{f"pipeline/{k}": float(v) for k, v in self.counters.items()}}
        if self.env.distributed:
            keys = sorted(counted)
            counted = dict(zip(keys, all_reduce_sum(self.env, [counted[k] if self.env.is_main else 0.0
                                                               for k in keys])))
        batch.metrics.update({"pipeline/staleness": float(staleness), "pipeline/trainer_wait_s": waited,
                              "pipeline/sampler_wait_s": sampler_wait, "pipeline/publish_s": self.board.publish_s,
                              **counted,
                              **{f"pipeline/staleness_{k}": float(v) for k, v in self.staleness_hist.items()}})
        batch, ref_metrics = self.ref_share.complete(shard_groups(batch, self.env.rank, self.env.world_size))
        batch.metrics.update(ref_metrics)
        return batch

    def _receive(self, step: int) -> tuple[list, Message, ScoredBatch]:
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

    def _parse(self, msg: Message, lease: Lease) -> ScoredBatch:
        """The batch in `msg`, checked before it is trained: WireError if it does not answer `lease` whole."""
        batch = from_wire(msg)
        self.ref_share.check(batch)
        float(msg.meta.get("wait_s", 0.0))  # read by next_batch: a value of another kind fails here instead
        problem = lease.answered_by(batch.prompt_index.tolist(), batch.rollout.group.tolist(), self.cfg.rollout.n)
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
        if self.env.is_main:
            self.rows.keep_until(self.delivered)

    # --- the sync port (server thread, rank 0) --------------------------------------------------------
    def _published(self, version: int) -> None:
        """In the training thread (rank 0), under the lock, at the end of an update."""
        self.cores.published(time.monotonic())  # before a sampler is answered: its core is its own again
        self.dispatcher.complete()
        if self.replier is not None:  # parked work requests can be answered now: weights, then a lease
            self.replier.wake()

    def _serve(self) -> None:
        done_until = None
        while True:
            if self.stop.is_set():
                done_until = done_until or time.monotonic() + (3.0 if self.say_done else 0.0)
                if time.monotonic() > done_until:  # a finished run says "done" a little while
                    return
            try:
                got = self.replier.recv(0.2)
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
        if msg.kind == "alive":  # a sampler's heartbeat, also sent while it generates
            if not self.stop.is_set():
                self.replier.reply_msg(peer, "ok", {})
            elif self.say_done:  # a sampler still generating when the run ended stops without its batch
                self.replier.reply_msg(peer, "done", {})
            return
        if msg.kind == "hello":
            problem = self.board.check_model(meta.get("manifest")) or other_base(self.base_weights, meta.get("weights"))
            if problem is None:
                with self.lock:
                    problem = self.board.admit(process_of(meta), meta.get("can_map"))
            if problem:
                self.replier.reply_msg(peer, "error", {"message": problem})
            else:
                dtypes = {k: v[1] for k, v in self.board.manifest.items()}  # what the sampler holds them in
                self.replier.reply_msg(peer, "welcome", {"config": self.config_yaml, "incarnation": self.incarnation,
                                                         "dtypes": dtypes, "data": self.data_digest})
            return
        if msg.kind == "bye":  # a sampler stopping (Ctrl-C, kill): its prompts go to the next one now
            self.parked = {p: m for p, m in self.parked.items() if process_of(m[0]) != process_of(meta)}
            with self.lock:
                gone = self.dispatcher.release(process_of(meta))
            self.replier.reply_msg(peer, "ok", {})
            say_requeued(gone, "stopped")
            return
        if msg.kind != "work":
            self.replier.reply_msg(peer, "error", {"message": f"unknown request {msg.kind!r}"})
            return
        self.parked.pop(peer, None)  # a sampler asking again replaces its parked request
        now = time.monotonic()
        if not self._work(peer, meta, now):
            self.parked[peer] = (meta, now)

    def _work(self, peer: bytes, meta: dict, since: float) -> bool:
        """Answers a work request if it can: "done", the newest weights, or a lease. While the staleness
        bound allows no lease, the request is parked (False) and answered as soon as the next publish
        frees one, instead of the sampler sleeping and asking again: that sleep was a bubble in every
        step of a balanced pipeline. After PARK_S it is answered "wait", well within the sampler's timeout."""
        if self.stop.is_set():  # unanswered when the run stopped early: the sampler asks the next trainer
            if self.say_done:
                self.replier.reply_msg(peer, "done", {})
            return True
        sampler, now = process_of(meta), time.monotonic()
        with self.lock:
            if not self.board.knows(sampler):  # it skipped hello: its model and data were never checked
                self.replier.reply_msg(peer, "hello", {"incarnation": self.incarnation})
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
                                                        "version": lease.version, "incarnation": self.incarnation,
                                                        "ref_groups": ref_groups, "threads": lend}):
            with self.lock:  # the sampler is gone: its rows go to the next one at once
                self.dispatcher.refuse(lease.id)
        return True

