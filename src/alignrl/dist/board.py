"""The trainer's weight board (rank 0 of a ZeroMQ-placed trainer): the newest weights, ready for samplers,
and the publish side of the loop's WeightSink.

How a sampler receives them is decided per sampler when it says hello (`pipeline.weight_transport`):
    zmq     bucket frames on the sync port (`weights_wire`), for every sampler
    shared  buffers that samplers on this host map (`shared_weights`: CUDA IPC for weights on a GPU, POSIX
            shared memory for weights on the CPU); a sampler that cannot is refused in one line
    auto    shared for the samplers that can map them, frames for the others (the default)
"""

from __future__ import annotations

import threading
import time

from alignrl.config.schema import PipelineConfig
from alignrl.dist.env import DistEnv, barrier
from alignrl.dist.shared_weights import SharedPublisher, host_id
from alignrl.dist.weights_wire import WeightsEncoder
from alignrl.dist.wire import manifest_of
from alignrl.train.actor import Actor
from alignrl.utils.tracking import console


class WeightBoard:
    def __init__(self, actor: Actor, env: DistEnv, p: PipelineConfig, token: str, lock: threading.Lock,
                 on_publish, incarnation: str):
        self.actor, self.env, self.lock = actor, env, lock
        self.transport = p.weight_transport
        self.shared = SharedPublisher(p.bucket_mb << 20, token, lock) if self.transport != "zmq" else None
        self.encode = WeightsEncoder(p.bucket_mb << 20, token) if self.shared is None else None
        self.incarnation = incarnation
        self.on_publish = on_publish  # called under the lock with the new version
        self.names = [n for n, _ in actor.model.named_parameters()]
        self.manifest = {k: [list(v.shape), v.dtype] for k, v in manifest_of(actor.model.named_parameters()).items()}
        self.version, self.frames, self.publish_s = 0, None, 0.0
        self.via: dict[str, tuple[str, str]] = {}  # sampler id -> (what it said it can map, "shared" | "zmq")

    def publish(self, version: int) -> None:
        """Collective (the full weights are gathered under ZeRO-3 / FSDP2); rank 0 snapshots them once. Whole
        weights are read from the live parameters: the encoder gathers them on their device, where a CPU
        state dict first cost a host copy (and fresh pages) per tensor."""
        t0 = time.perf_counter()
        if self.actor.engine.whole_weights:
            named = list(self.actor.model.named_parameters()) if self.env.is_main else []
        else:
            full = self.actor.engine.full_state_dict()
            named = [(n, full[n]) for n in self.names]
        if self.env.is_main:
            meta = {"incarnation": self.incarnation}
            if self.shared is not None:
                self.shared.publish(named, version, meta)
                frames = None
            else:
                frames = self.encode(named, version, meta=meta)
            with self.lock:
                self.version, self.frames = version, frames
                self.on_publish(version)
        barrier(self.env)
        self.publish_s = time.perf_counter() - t0

    # --- the sync thread, under the lock ---------------------------------------------------------------
    def admit(self, sampler: str, can_map: object) -> str | None:
        """Decides how `sampler` receives weights, from what it says of its host and devices (`can_map` of its
        hello and work requests: {"shared": bool, "host": host_id(), "cuda": [device uuids]}), again whenever that
        changes (a sampler that failed to map them says so); or returns the one line that refuses it
        (pipeline.weight_transport=shared, and it cannot map them)."""
        key = repr(can_map)
        if self.via.get(sampler, ("",))[0] == key:
            return None
        why = "runs an alignrl without shared weights" if not isinstance(can_map, dict) else (
            None if self.shared is None else self._cannot_map(can_map))
        if why is not None and self.transport == "shared":
            return (f"pipeline.weight_transport=shared, but this sampler {why}: run it there, or start the "
                    "trainer with pipeline.weight_transport=auto (frames where sharing is impossible)")
        via = "shared" if why is None and self.shared is not None else "zmq"
        self.via[sampler] = (key, via)
        how = ("through CUDA IPC" if self.shared.kind == "cuda" else "through shared memory") if via == "shared" \
            else "as frames on the sync port"
        console.print(f"pipeline: sampler {sampler} receives the weights {how}")
        return None

    def _cannot_map(self, can_map: dict) -> str | None:
        if can_map.get("shared") is not True:
            return "cannot map shared weights (it found it could not, or runs an alignrl without them)"
        if can_map.get("host") != host_id():
            return "runs on another host than the trainer"
        if self.shared.kind == "cuda" and self.shared.current.described[0]["uuid"] not in (can_map.get("cuda") or []):
            return "does not see the trainer's GPU (its CUDA_VISIBLE_DEVICES hides it)"
        return None

    def frames_for(self, sampler: str) -> list:
        """The newest weights for `sampler`, the way its hello decided."""
        if self.shared is None:
            return self.frames
        if self.via.get(sampler, ("", "zmq"))[1] == "shared":
            return self.shared.shared_frames(sampler)
        return self.shared.wire_frames(sampler)

    def stale(self, sampler: str, have: tuple) -> bool:
        """Whether `sampler`, holding weights `have` (incarnation, version), must be sent the newest ones.
        Any request from it also means it has copied what it was handed last."""
        if self.shared is None:
            return have != (self.incarnation, self.version)
        self.shared.release(sampler)
        return have != (self.incarnation, self.version) or sampler in self.shared.torn

    def close(self) -> None:
        if self.shared is not None:
            with self.lock:
                self.shared.close()
