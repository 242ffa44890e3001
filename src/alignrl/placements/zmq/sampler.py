"""`alignrl sample` (the ZeroMQ pipeline's `sampling_worker.py`): a sampler process of the ZeroMQ placement.

It loads its own copy of the policy (and the frozen reference) from --model-path, says hello to the
trainer (which checks the model's parameter names and shapes and answers with the run's config), then
loops: ask for work; load newer weights when the trainer has them; make the leased rows' scored batch
with the same producer as the in-process loop; push it to the data port. Several samplers on the same
ports share the work. A trainer that goes away is waited for (up to --peer-timeout), then the sampler
stops with one line; a restarted trainer hands out its own weights and leases.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
import uuid

import torch
import zmq

from alignrl.placements.build import build_maker, build_ref, producer_prompts
from alignrl.placements.episodes import with_tools
from alignrl.data.prompts import PromptData
from alignrl.data.records import rows_digest
from alignrl.config import ConfigError, RunConfig, load_config
from alignrl.config.agent_checks import needs_chat_template
from alignrl.placements.zmq.coordinator import PipelineError
from alignrl.placements.zmq.thread_lending import borrowed
from alignrl.runtime.env import SINGLE
from alignrl.wire.records import KIND, to_wire
from alignrl.placements.zmq.ref_share import sampler_needs_ref
from alignrl.wire.shared_weights import SHARED_KIND, SharedReader, SharedUnavailable, cuda_uuids, host_id
from alignrl.wire.frames import DTYPE_NAMES, DTYPES, Message, WireError, check_weights, manifest_of
from alignrl.wire.zmq_link import PeerTimeout, Pusher, Requester, address, token_from_env
from alignrl.errors import LAUNCHER_ENV, Terminated, in_flag_words, stop_on_sigterm
from alignrl.models.folder import weights_fingerprint
from alignrl.models.loader import ModelError, load_model, resolve_model_path
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rl.scoring import plain_columns
from alignrl.utils.tracking import console

PROG = "alignrl sample"
BEAT_S = 1.0  # heartbeat period; the trainer's pipeline.heartbeat_timeout_s spans many of them
STALL_S = 5.0  # a request that took this much longer than its timeout: the process itself was stopped meanwhile
WIRE_BYTES_PER_S = 50 << 20  # the slowest link a weights reply is given time for (a 15 GB model: 5 min)


class Heartbeat:
    """Tells the trainer every BEAT_S, from a thread and socket of its own, that this sampler process lives,
    so that a generation of any length keeps its lease while a killed sampler's lease goes to another sampler
    after pipeline.heartbeat_timeout_s. `over` is set when the trainer answers "done": its run ended while
    this sampler was generating, and the batch is no longer wanted."""

    def __init__(self, addr: str, token: str, meta: dict):
        self.over, self._stop = threading.Event(), threading.Event()
        self.answered_at = 0.0  # time.monotonic() of the trainer's last answer
        self._thread = threading.Thread(target=self._beat, args=(addr, token, meta), name="alignrl-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self, addr: str, token: str, meta: dict) -> None:
        with Requester(addr, token=token) as req:  # made, used and closed in this thread
            while not self._stop.wait(BEAT_S):
                try:
                    if req.request("alive", meta, timeout_s=2 * BEAT_S).kind == "done":
                        self.over.set()
                    self.answered_at = time.monotonic()
                except (PeerTimeout, WireError):
                    pass  # the trainer is away: the main loop waits for it (--peer-timeout)

    def close(self, wait: bool = True) -> None:
        """Stops the beats; `wait` for the one in flight (at most 2 * BEAT_S), so that no late "alive" tells a
        trainer of a process that is gone. A trainer that never answered has nothing to be told."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5)


class Sampler:
    def __init__(self, args: argparse.Namespace):
        self.args, self.token = args, token_from_env()
        self.id = args.sampler_id or f"{os.uname().nodename}:{os.getpid()}"
        self.proc = uuid.uuid4().hex[:8]  # tells this process apart from another given the same --sampler-id
        self.sync = Requester(address(args.host, args.sync_port), token=self.token)
        if self.device.type == "cuda":
            if self.device.index >= torch.cuda.device_count():
                raise PipelineError(f"--gpu-id {self.device.index}: this process sees {torch.cuda.device_count()} "
                                    "CUDA device(s), numbered from 0 (CUDA_VISIBLE_DEVICES renumbers them)")
            torch.cuda.set_device(self.device)
        # the template is checked against the trainer's config once it is known (_serve): a run that templates
        # nothing may use a model without one
        self.model, self.tokenizer = load_model(args.model_path, log=console.print, chat=False)
        self.model.to(self.device)
        self.manifest = manifest_of(self.model.named_parameters())
        # the trainer checks that a reference computed here is its own base model's (same shapes is not enough)
        self.base_weights = weights_fingerprint(resolve_model_path(args.model_path, log=lambda *_: None))
        self.incarnation, self.version = None, -1  # of the weights this sampler holds
        self.trainer = None  # the incarnation of the trainer this sampler said hello to (its run config's)
        self.trainer_data = None  # the digest of that trainer's dataset rows (records.rows_digest)
        # what the trainer needs to know to hand this sampler weights in memory both map (shared_weights)
        self.can_map = {"shared": True, "host": host_id(), "cuda": cuda_uuids()}
        self.shared = SharedReader()
        self.unmappable = None  # the trainer incarnation whose buffers this process failed to map
        # the cores this process keeps busy, which a CPU trainer borrows while it waits (pipeline.lend_cores)
        self.threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        self.work_timeout = weights_timeout(sum(t.numel() * t.element_size() for t in self.model.parameters()))
        self.beat = Heartbeat(self.sync.addr, self.token, {"sampler_id": self.id, "proc": self.proc})

    def bye(self) -> None:
        """Tells the trainer this process stops, so that its prompts go to another sampler now, not after
        pipeline.heartbeat_timeout_s (a socket of its own: the main one may be mid-request)."""
        if not self.met_a_trainer:
            self.beat.close(wait=False)  # a sampler still waiting for its trainer stops at once
            return
        try:
            self.beat.close()
            with Requester(self.sync.addr, token=self.token) as req:
                req.request("bye", {"sampler_id": self.id, "proc": self.proc}, timeout_s=1.0)
        except (PeerTimeout, WireError, zmq.ZMQError, KeyboardInterrupt):
            pass  # no trainer to tell, or a second Ctrl-C: the heartbeat's silence says it

    @property
    def met_a_trainer(self) -> bool:
        """Whether a trainer welcomed this process or answered its heartbeat: one that may hold its prompts."""
        return self.trainer is not None or self.beat.answered_at > 0

    @property
    def device(self) -> torch.device:
        gpu = self.args.gpu_id
        return torch.device("cuda", gpu if gpu is not None else 0) if torch.cuda.is_available() else torch.device("cpu")

    def ask(self, kind: str, meta: dict, timeout_s: float = 5.0, first_s: float | None = None):
        """One request, retried while the trainer is absent (up to --peer-timeout); "done" once the heartbeat
        heard it. `first_s`: a shorter first wait, after which the sampler says it waits for a trainer."""
        deadline = time.monotonic() + self.args.peer_timeout
        said, wait_s = False, min(first_s or timeout_s, self.args.peer_timeout)
        while True:
            if self.beat.over.is_set():
                return Message("done", {})
            started = time.monotonic()
            try:
                return self.sync.request(kind, meta, timeout_s=wait_s)
            except PeerTimeout:
                if time.monotonic() - started > wait_s + STALL_S:
                    # this process was stopped meanwhile (SIGSTOP, a suspended machine): the trainer's silence is
                    # measured from now, or the first timeout after waking would end a sampler the trainer awaits
                    deadline = time.monotonic() + self.args.peer_timeout
                if not said:  # at once, not only when the wait ends: a wrong port or order is seen here
                    console.print(f"sampler {self.id}: waiting for a trainer on {self.sync.addr} (up to "
                                  f"{self.args.peer_timeout:g} s, --peer-timeout)")
                    said = True
                if time.monotonic() >= deadline:
                    raise PipelineError(f"no trainer answered on {self.sync.addr} for {self.args.peer_timeout:g} s: "
                                        "start training_worker.py (or alignrl train grpo pipeline.placement=zmq) "
                                        "with the same --sync-port; a trainer that runs answers on its "
                                        "--sync-port, not its --data-port (swapped?)") from None
                wait_s = min(timeout_s, deadline - time.monotonic())  # the last wait ends at --peer-timeout

    def hello(self) -> RunConfig:
        manifest = {k: [list(v.shape), v.dtype] for k, v in self.manifest.items()}
        # a sampler started before its trainer says so within a second; a trainer slower than that to answer
        # is asked again, and a second hello of the same process is answered as the first
        reply = self.ask("hello", {"sampler_id": self.id, "proc": self.proc, "manifest": manifest,
                                   "can_map": self.can_map, "weights": self.base_weights}, first_s=1.0)
        if reply.kind == "error":
            raise PipelineError(f"trainer refused this sampler: {reply.meta.get('message')}")
        if reply.kind != "welcome" or not isinstance(reply.meta.get("config"), str):
            raise PipelineError(f"the trainer answered hello with {reply.kind!r} and no run config: run the same "
                                "alignrl version on both sides")
        self.trainer, self.trainer_data = reply.meta.get("incarnation"), reply.meta.get("data")
        dtypes = reply.meta.get("dtypes")
        self.take_dtypes(dtypes if isinstance(dtypes, dict) else {})
        overrides = [f"model.path={self.args.model_path}"]
        if self.args.data_path:
            overrides.append(f"data.train_files={self.args.data_path}")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(reply.meta["config"])
            f.flush()
            return load_config(f.name, overrides)

    def take_dtypes(self, dtypes: dict) -> None:
        """Holds each parameter in the dtype the trainer publishes it in (its model.dtype, or bf16 under
        DeepSpeed's bf16 mode), so weights load without a cast and the sampler's forwards match the trainer's.
        Parameters only: buffers such as rotary frequencies stay as loaded, as they do in the trainer."""
        changed = False
        for name, p in self.model.named_parameters():
            dt = dtypes.get(name, DTYPE_NAMES[p.dtype])
            want = DTYPES.get(dt) if isinstance(dt, str) else None
            if want is None:
                raise PipelineError(f"the trainer publishes {name!r} as {dt!r}, a dtype this sampler "
                                    "does not know: run the same alignrl version on both sides")
            if p.dtype != want:
                p.data = p.data.to(want)
                changed = True
        if changed:
            self.manifest = manifest_of(self.model.named_parameters())

    def load(self, engine: HFRolloutEngine, reply: Message) -> None:
        """New weights into the engine: from the frames, or copied out of the trainer's shared buffers before
        the next request (the trainer refills them only after it). Buffers this process cannot map make it
        ask for frames instead, from then on."""
        incarnation = reply.meta.get("incarnation")
        if reply.kind == SHARED_KIND:
            try:
                reply = Message("weights", reply.meta, self.shared.tensors(reply))
            except SharedUnavailable as e:
                console.print(f"[yellow]sampler {self.id}: {e}; asking for the weights as frames[/yellow]")
                self.can_map, self.unmappable = {**self.can_map, "shared": False}, incarnation
                return
        elif self.unmappable is not None and incarnation != self.unmappable:  # a restarted trainer: try again
            self.can_map, self.unmappable = {**self.can_map, "shared": True}, None
        # a partial update (a trainer with LoRA adapters or frozen parameters) names the parameters that changed
        check_weights(reply, {n: self.manifest[n] for n in reply.tensors if n in self.manifest}
                      if reply.meta.get("partial") else self.manifest)
        engine.load_weights(reply.tensors.items())
        self.shared.synchronize()
        self.incarnation, self.version = incarnation, reply.meta["version"]

    def run(self) -> int:
        try:
            return self._run()
        finally:  # unmapped before the trainer exits: its CUDA IPC buffers are then released without a warning
            self.beat.close(wait=self.met_a_trainer)
            self.shared.close()

    def _run(self) -> int:
        """Hello, then batches until the trainer's run is over; again from hello when another trainer answers
        (one restarted from its checkpoint, perhaps with other settings: its run config, its model check, its
        dtypes; before, a sampler kept the first trainer's config for good)."""
        while not self._serve(self.hello()):
            console.print(f"sampler {self.id}: a restarted trainer answers on {self.sync.addr}; saying hello again")
        return 0

    def _serve(self, cfg: RunConfig) -> bool:
        """Makes batches for the trainer of `cfg`: True once its run is over, False when another trainer answers."""
        if needs_chat_template(cfg) and not self.tokenizer.chat_template:
            raise ModelError(f"model folder {self.args.model_path}: the tokenizer has no chat template, and the "
                             "trainer's run templates its prompts; copy chat_template.jinja from the instruct model "
                             "the folder derives from, or run with data.apply_chat_template=false")
        train, rows = producer_prompts(cfg, self.tokenizer)  # this trainer's templating, before any prompt
        if isinstance(self.trainer_data, str) and rows_digest(train) != self.trainer_data:  # same length, other rows
            raise PipelineError(f"this sampler's data ({self.args.data_path or cfg.data.train_files}) holds other rows "
                                "than the trainer's: give it the trainer's data (--data-path, or none to read what "
                                "the trainer's config names)")
        engine = with_tools(cfg, HFRolloutEngine(self.model, self.tokenizer), self.tokenizer)
        # the base weights in model.dtype, loaded as the trainer loads its own (this policy copy holds the dtypes
        # the trainer publishes in), unless the trainer runs the whole reference forward
        ref = build_ref(cfg, self.device) if sampler_needs_ref(cfg) else None
        maker = build_maker(cfg, engine, self.tokenizer, ref, SINGLE.device, SINGLE.rank)
        with Pusher(address(self.args.host, self.args.data_port), hwm=cfg.pipeline.hwm, token=self.token) as push:
            return self._batches(cfg, rows, maker, push)

    def _batches(self, cfg: RunConfig, rows: PromptData, maker, push: Pusher) -> bool:
        engine = maker.engine
        console.print(f"sampler {self.id}: connected to {self.sync.addr}; making batches of "
                      f"{cfg.data.train_batch_size} prompts × {cfg.rollout.n}")
        waited, made = 0.0, 0
        while True:
            t0 = time.perf_counter()
            reply = self.ask("work", {"sampler_id": self.id, "proc": self.proc, "incarnation": self.incarnation,
                                      "threads": self.threads, "version": self.version, "can_map": self.can_map},
                             self.work_timeout)
            if reply.kind == "done":
                self.shared.close()
                console.print(f"sampler {self.id}: the trainer finished; {made} batches made")
                return True
            if reply.kind == "error":
                raise PipelineError(f"trainer: {reply.meta.get('message')}")
            if reply.meta.get("incarnation") not in (None, self.trainer) or reply.kind == "hello":  # another trainer
                return False
            if reply.kind in ("weights", SHARED_KIND):
                self.load(engine, reply)
                waited += time.perf_counter() - t0
                continue
            if reply.kind == "wait":
                time.sleep(float(reply.meta.get("retry_s", 0.05)))
                waited += time.perf_counter() - t0
                continue
            number, leased, lease_id = lease_of(reply)
            beyond = [r for r in leased if not 0 <= r < len(rows.samples)]
            if beyond:
                where = self.args.data_path or "the trainer's data.train_files"
                raise PipelineError(f"the trainer leased dataset row {beyond[0]}, but this sampler's data ({where}) "
                                    f"has {len(rows.samples)} rows: give it the trainer's data (--data-path, or "
                                    "none to read what the trainer's config names)")
            with borrowed(self.threads, reply.meta.get("threads")):
                batch = maker.make(number, leased, rows, self.version,
                                   ref_groups=ref_groups(reply.meta, cfg.data.train_batch_size))
            if self.beat.over.is_set():  # the run ended meanwhile: nobody trains this batch
                continue
            batch.sampler_id = self.id
            # the columns TRL's reward functions logged of the rows ride along, for the trainer's rollout dumps
            meta, tensors = to_wire(batch, self.tokenizer, lease=lease_id, wait_s=waited,
                                    columns=plain_columns(batch.rollout))
            try:
                push.send(KIND, meta, tensors, timeout_s=min(30.0, self.args.peer_timeout))
                made, waited = made + 1, 0.0
            except PeerTimeout as e:
                # nothing ever went out here while the trainer answers: it reads another port (a busy trainer's full
                # queue blocks a later send too, and then the batch is dropped as below); a run that just ended
                # took nothing either
                if self.beat.over.is_set():
                    continue
                if made == 0 and time.monotonic() - self.beat.answered_at < 3 * BEAT_S:
                    raise PipelineError(f"nothing took the batch on {push.addr} (--data-port) in "
                                        f"{min(30.0, self.args.peer_timeout):g} s, though a trainer answers on "
                                        f"{self.sync.addr} (--sync-port): give the trainer's --data-port") from None
                # the trainer is gone: its lease dies with it; ask the next one for work
                console.print(f"[yellow]sampler {self.id}: batch dropped: {e}[/yellow]")


def weights_timeout(nbytes: int) -> float:
    """Seconds a work request waits for its answer, which may be the whole weights: ZeroMQ hands over a reply only
    once every frame has arrived, so a fixed few seconds would cut off a large model's weights every time."""
    return 5.0 + nbytes / WIRE_BYTES_PER_S


def lease_of(reply: Message) -> tuple[int, list[int], str]:
    """(seed number, dataset rows, lease id) of a "lease" reply; PipelineError for any other reply."""
    m = reply.meta
    number, rows, lease = m.get("number"), m.get("rows"), m.get("lease")
    if (reply.kind != "lease" or type(number) is not int or not isinstance(rows, list)
            or not all(type(r) is int for r in rows) or not isinstance(lease, str)):
        raise PipelineError(f"the trainer answered a work request with a malformed {reply.kind!r}: run the same "
                            "alignrl version on both sides")
    return number, rows, lease


def ref_groups(lease: dict, groups: int) -> int | None:
    """The prompt groups whose reference log-probs the lease asks of this sampler (None: all of them)."""
    n = lease.get("ref_groups")
    if n is None:
        return None
    if type(n) is not int or not 0 <= n <= groups:
        raise PipelineError(f"the trainer's lease asks for the reference log-probs of {n!r} prompt groups of "
                            f"{groups}: run the same alignrl version on both sides")
    return n


def run(args: argparse.Namespace, prog: str = PROG) -> int:
    """The sampler of parsed flags (alignrl.compat.zmq_pipeline.sampling_parser) until the trainer's run is over."""
    if args.threads:
        torch.set_num_threads(args.threads)
    old_term, sampler = stop_on_sigterm(), None
    try:
        sampler = Sampler(args)
        return sampler.run()
    except (PipelineError, WireError, ConfigError, ModelError, ValueError) as e:
        print(f"{prog}: {in_flag_words(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if sampler is not None:
            sampler.bye()
        if not os.environ.get(LAUNCHER_ENV):
            print(f"{prog}: {'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}; the prompts it "
                  "held go to the next sampler that asks (the same command starts it again)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
