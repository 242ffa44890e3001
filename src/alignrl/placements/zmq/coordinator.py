"""The trainer's end of the ZeroMQ pipeline as the runner sees it: `Coordinator` (the runner's RemoteProducers:
sink, critics, evaluator, source) builds the parts, and `PipelineSource` is the BatchSource that source() returns.

    sampler --work?--> SyncServer (sync port) --lease | weights | wait | done--> sampler
    sampler --scored batch--> BatchReceiver (data port) --> next_batch --> PolicyTrainer --> publish(version)

Rank 0 owns the sockets: the sync server's thread answers samplers (sync_server), the training thread receives
batches and checks lease and staleness (batch_receiver), broadcasts the accepted batch's frames to the other
ranks, and each rank trains on its share of the prompt groups. The weights are published by the WeightBoard
(weight_publisher). Deliberately left out: several trainers per sampler set, priorities between samplers,
partial batches.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import torch

from alignrl.config import RunConfig
from alignrl.config.checks import needs_reference
from alignrl.config.schema import PipelineConfig
from alignrl.data.records import ScoredBatch
from alignrl.data.sampler import BatchSampler
from alignrl.models.folder import weights_fingerprint
from alignrl.models.loader import resolve_model_path
from alignrl.placements.build import build_critics, build_ref
from alignrl.placements.sharded_ref import build_sharded_ref, shards_reference, where_reference_lives
from alignrl.placements.zmq.batch_receiver import BatchReceiver, PipelineError
from alignrl.placements.zmq.leases import Dispatcher
from alignrl.placements.zmq.prompt_log import RowLog
from alignrl.placements.zmq.ref_share import RefShare, sampler_needs_ref, trainer_needs_ref
from alignrl.placements.zmq.sync_server import PARK_S, SyncServer, Welcome, process_of
from alignrl.placements.zmq.thread_lending import CoreLedger, ThreadLoan
from alignrl.placements.zmq.weight_publisher import WeightBoard
from alignrl.rl.rollout_ops import shard_groups
from alignrl.runtime.env import DistEnv, all_reduce_sum, broadcast_frames
from alignrl.train.actor import Actor
from alignrl.utils.tracking import console
from alignrl.wire.shared_weights import host_id
from alignrl.wire.zmq_link import InsecureBind, PortInUse, Puller, Replier, token_from_env

# imported from here by the sampler and the tests; PARK_S is read where it is defined
# (sync_server), so that is the module to patch
__all__ = ["Coordinator", "PipelineSource", "PipelineError", "process_of", "PARK_S"]


class Coordinator:
    """The runner's RemoteProducers for ZeroMQ samplers. The runner calls sink() (with the policy) before
    source() (with the data order and the trainer): the weight board comes from the first, the ports, the sync
    server and the data port from the second."""

    def __init__(self, cfg: RunConfig, config_yaml: str, log_dir: Path, data_digest: str | None = None):
        """`data_digest`: records.rows_digest of the training rows, which a sampler's own must match."""
        self.cfg, self.config_yaml, self.log_dir, self.data_digest = cfg, config_yaml, log_dir, data_digest
        self.token = token_from_env()
        self.lock = threading.Lock()  # the training thread's and the sync thread's: see SyncServer
        self.incarnation = uuid.uuid4().hex[:8]
        self.board: WeightBoard | None = None  # sink()'s
        self.cores = CoreLedger(None, "", False)  # pipeline.lend_cores: set up with the policy (sink)
        self.base_weights: str | None = None  # weights_fingerprint of the base model, where samplers score the KL
        self.server: SyncServer | None = None  # rank 0's, from source() on

    def sink(self, actor: Actor, env: DistEnv) -> WeightBoard:
        self.board = WeightBoard(actor, env, self.cfg.pipeline, self.token, self.lock, self._published,
                                 self.incarnation)
        # the base weights a sampler's reference must have: other weights of the same shapes pass the manifest
        # check, and the KL term would then be measured against another model
        self.base_weights = (weights_fingerprint(resolve_model_path(self.cfg.model.path, log=lambda *_: None))
                             if env.is_main and needs_reference(self.cfg) and sampler_needs_ref(self.cfg) else None)
        self.cores = lend_cores(actor, env, self.cfg.pipeline)
        return self.board

    def critics(self, cfg: RunConfig, resume: Path | None, env: DistEnv):
        """The critics train in this process, beside the policy."""
        return build_critics(cfg, resume, env)

    def evaluator(self, pad_id: int) -> None:
        return None  # samplers only make batches: the trainer's rank 0 evaluates on its own weights

    def source(self, sampler: BatchSampler, trainer, env: DistEnv) -> PipelineSource:
        p = self.cfg.pipeline
        dispatcher = Dispatcher(sampler, p.max_staleness, p.lease_timeout_s, self.incarnation)
        ref_share = RefShare(self.cfg, self._trainer_ref(trainer, env) if trainer_needs_ref(self.cfg) else None)
        puller, replier, failed = bind_ports(p, self.token) if env.is_main else (None, None, None)
        # rank 0 alone binds: the others learn here that it could not, and stop with it instead of failing at
        # the next collective with gloo's "connection closed" traceback
        if all_reduce_sum(env, [float(failed is not None)])[0]:
            raise failed or PipelineError("rank 0 could not bind the pipeline's ports (its error says why)")
        receiver = BatchReceiver(puller, RowLog(self.log_dir) if env.is_main else None, dispatcher, ref_share,
                                 self.lock, trainer, self.cfg, self.token)
        if env.is_main:
            welcome = Welcome(self.config_yaml, self.incarnation, self.data_digest, self.base_weights)
            self.server = SyncServer(replier, self.board, dispatcher, ref_share, self.cores, self.lock, welcome, p)
        return PipelineSource(receiver, self.server, self.board, ref_share, trainer, env)

    def _trainer_ref(self, trainer, env: DistEnv):
        """The trainer's own frozen reference, for the rows samplers leave to it (pipeline.ref_logprobs): sharded
        over the ranks beside a sharded policy (every rank then calls it once per batch: RefShare.complete), else a
        whole copy on each rank; with LoRA the policy itself, adapters off (the batches are taken in the loop's
        thread, between updates)."""
        ref = (build_sharded_ref(self.cfg, env) if shards_reference(self.cfg, env) else
               build_ref(self.cfg, env.device, policy=trainer.actor.model))
        where = where_reference_lives(self.cfg, ref, env) if env.distributed and env.is_main else None
        if where:
            console.print(where, markup=False)
        return ref

    def _published(self, version: int) -> None:
        """The board's on_publish: rank 0's training thread, under the lock, at the end of an update. The board
        is made by sink() and the server by source(); the first publish comes with the first batch, after both."""
        self.server.published(version)


def lend_cores(actor: Actor, env: DistEnv, p: PipelineConfig) -> CoreLedger:
    """pipeline.lend_cores: a one-process CPU trainer and the samplers on its host take turns on its cores."""
    if p.lend_cores and env.world_size == 1 and env.device.type == "cpu":
        loan = ThreadLoan(torch.get_num_threads())
        loan.install(actor.model)
        return CoreLedger(loan, host_id(), lend_to_samplers=p.max_staleness == 0)
    return CoreLedger(None, "", False)


def bind_ports(p: PipelineConfig, token: str) -> tuple[Puller | None, Replier | None, Exception | None]:
    """The bound data and sync ports; a taken port or an unsafe host comes back as the error to raise."""
    puller = None
    try:
        puller = Puller(p.host, p.data_port, hwm=p.hwm, token=token)
        replier = Replier(p.host, p.sync_port, token=token)
    except (OSError, PortInUse, InsecureBind) as e:  # OSError: a host that is not this machine's
        if puller is not None:
            puller.close()
        return None, None, e
    console.print(f"pipeline: waiting for samplers on {puller.addr} (data) and {replier.addr} "
                  f"(sync), max_staleness={p.max_staleness}")
    return puller, replier, None


class PipelineSource:
    """BatchSource of a trainer fed by ZeroMQ samplers, on every rank. `server` is rank 0's (None on the others).
    The first next_batch publishes the starting weights (after any resume) and starts the sync server."""

    def __init__(self, receiver: BatchReceiver, server: SyncServer | None, board: WeightBoard, ref_share: RefShare,
                 trainer, env: DistEnv):
        self.receiver, self.server, self.board = receiver, server, board
        self.ref_share, self.trainer, self.env = ref_share, trainer, env
        self.started = False

    def next_batch(self, step: int) -> ScoredBatch:
        """Collective: every rank calls it with the same step."""
        if not self.started:
            self._start()
        t0 = time.perf_counter()
        frames, msg, batch = self.receiver.receive(step) if self.env.is_main else (None, None, None)
        if self.env.distributed:
            frames = broadcast_frames(frames, self.env)
        if batch is None:  # the other ranks
            msg, batch = self.receiver.checked(frames)
        waited, sampler_wait = time.perf_counter() - t0, float(msg.meta.get("wait_s", 0.0))
        staleness, counted = self.receiver.taken(step, msg, batch, waited, sampler_wait)
        # what rank 0 alone counts (it receives, leases and checks), on every rank: the step's metrics are
        # averaged over ranks, which divided these by the number of ranks
        if self.env.distributed:
            keys = sorted(counted)
            counted = dict(zip(keys, all_reduce_sum(self.env, [counted[k] if self.env.is_main else 0.0
                                                               for k in keys])))
        batch.metrics.update({"pipeline/staleness": float(staleness), "pipeline/trainer_wait_s": waited,
                              "pipeline/sampler_wait_s": sampler_wait, "pipeline/publish_s": self.board.publish_s,
                              **counted, **self.receiver.staleness_metrics()})
        batch, ref_metrics = self.ref_share.complete(shard_groups(batch, self.env.rank, self.env.world_size))
        batch.metrics.update(ref_metrics)
        return batch

    def _start(self) -> None:
        """Publish the starting weights (after any resume: load_state_dict comes between source() and the first
        batch) and begin answering samplers."""
        self.receiver.start_log()
        self.board.publish(self.trainer.version)
        self.started = True
        if self.server is not None:
            self.server.start()

    def state_dict(self) -> dict:
        return self.receiver.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Also forgets the logged steps after the checkpoint: they are trained again."""
        self.receiver.load_state_dict(state)

    def close(self, finished: bool) -> None:
        """Releases the ports. A finished run first tells samplers it is over; a run that stopped early says
        nothing, so that they wait for the restarted trainer (SyncServer.close). A run that stops before its
        first batch (a mistake found at its resume, say) frees the ports too."""
        if self.server is not None:
            self.server.close(finished)
        self.receiver.close()
        self.board.close()
