"""The trainer's weight board (rank 0 of a ZeroMQ-placed trainer): the newest weights, ready for samplers,
and the publish side of the loop's WeightSink.

How a sampler receives them is decided per sampler from what it says of its host and devices
(`pipeline.weight_transport`):
    zmq     bucket frames on the sync port (`weights_wire`), for every sampler
    shared  buffers that samplers on this host map (`shared_weights`: CUDA IPC for weights on a GPU, POSIX
            shared memory for weights on the CPU); a sampler that cannot is refused in one line
    auto    shared for the samplers that can map them, frames for the others (the default). Each publish
            makes only what the samplers known so far need, so a GPU trainer whose samplers are all on other
            hosts keeps no shared copies on its device.
"""

from __future__ import annotations

import threading
import time

import torch

from alignrl.config.schema import PipelineConfig
from alignrl.models.lora import plain_name
from alignrl.placements.weight_sync import Outgoing
from alignrl.runtime.env import DistEnv, barrier
from alignrl.wire.shared_weights import SharedPublisher, SharedUnavailable, host_id
from alignrl.wire.weight_buckets import WeightsEncoder
from alignrl.wire.frames import DTYPE_NAMES
from alignrl.train.actor import Actor
from alignrl.utils.tracking import console


class WeightBoard:
    def __init__(self, actor: Actor, env: DistEnv, p: PipelineConfig, token: str, lock: threading.Lock,
                 on_publish, incarnation: str):
        self.actor, self.env, self.lock = actor, env, lock
        self.transport = p.weight_transport
        self.shared = SharedPublisher(p.bucket_mb << 20, token, lock) if self.transport != "zmq" else None
        self.encode = WeightsEncoder(p.bucket_mb << 20, token) if self.transport != "shared" else None
        self.incarnation = incarnation
        self.on_publish = on_publish  # called under the lock with the new version
        # the plain model's names (LoRA adapters are merged in), all at the first publish, then those that change
        self.out = Outgoing(actor.model)
        # the full shapes (ZeRO-3 leaves each parameter an empty shard here, its own shape in ds_shape) and the
        # published dtypes (FSDP2 keeps a bf16 model's shards in fp32 and publishes bf16): a sampler checks both
        dtypes = actor.engine.weight_dtypes()
        self.manifest = {plain_name(n): [list(getattr(t, "ds_shape", t.shape)), DTYPE_NAMES[dtypes[n]]]
                         for n, t in actor.model.named_parameters() if "lora_" not in n}
        # where the published weights live: whole weights are read off the parameters' device, gathered
        # ones (ZeRO-3, FSDP2) come as CPU tensors
        dev = next(actor.model.parameters()).device
        self.uuid = (str(torch.cuda.get_device_properties(dev).uuid)
                     if dev.type == "cuda" and actor.engine.whole_weights else None)
        self.version, self.frames, self.shared_version, self.publish_s = 0, None, -1, 0.0
        self.via: dict[str, tuple[str, str]] = {}  # sampler id -> (what it said it can map, "shared" | "zmq")

    def publish(self, version: int) -> None:
        """Collective (the full weights are gathered under ZeRO-3 / FSDP2); rank 0 snapshots them once. Whole
        weights are read from the live parameters: the encoder gathers them on their device, where a CPU
        state dict first cost a host copy (and fresh pages) per tensor."""
        t0 = time.perf_counter()
        names = self.out.names()
        if self.actor.engine.whole_weights:  # the live tensors (state_dict() copies nothing)
            named = self.out.tensors(self.actor.model.state_dict(), names) if self.env.is_main else []
        else:
            full = self.actor.engine.full_state_dict(main_only=True)
            named = self.out.tensors(full, names) if self.env.is_main else []
        if self.env.is_main:
            # partial: the parameters a step can change; the sampler keeps the rest as it holds them
            meta = {"incarnation": self.incarnation, **({"partial": True} if self.out.partial(names) else {})}
            with self.lock:
                ways = self._ways()
            if "shared" in ways:
                try:
                    self.shared.publish(named, version, meta)
                except SharedUnavailable as e:
                    if self.transport == "shared":
                        raise
                    self._give_up_sharing(e)
                    ways = {"zmq"}
            frames = self.encode(named, version, meta=meta) if "zmq" in ways else None
            with self.lock:
                self.version, self.frames = version, frames
                self.shared_version = version if "shared" in ways else -1
                self.on_publish(version)
        barrier(self.env)
        self.publish_s = time.perf_counter() - t0

    def _ways(self) -> set[str]:
        """What this publish makes: frames while any known sampler takes them (or none is known yet, under
        auto), shared sets while any maps them (always, under shared)."""
        if self.shared is None:
            return {"zmq"}
        if self.transport == "shared":
            return {"shared"}
        ways = {via for _, via in self.via.values()}
        return ways or {"zmq"}

    def _give_up_sharing(self, why: Exception) -> None:
        console.print(f"[yellow]pipeline: {why}; every sampler gets the weights as frames instead[/yellow]")
        with self.lock:
            self.shared.close()
            self.shared, self.transport = None, "zmq"
            self.via = {k: (key, "zmq") for k, (key, _) in self.via.items()}

    # --- the sync thread, under the lock ---------------------------------------------------------------
    def check_model(self, manifest) -> str | None:
        """What keeps a sampler's model (its hello's manifest: name -> [shape, dtype]) from taking these
        weights, or None."""
        mine = self.manifest
        if not isinstance(manifest, dict):
            return "hello without a model manifest: the sampler runs another alignrl version"
        theirs = {k: [list(v[0]), v[1]] for k, v in manifest.items()}
        if theirs.keys() != mine.keys():
            extra, missing = sorted(theirs.keys() - mine.keys()), sorted(mine.keys() - theirs.keys())
            return (f"the sampler's model has other parameters than the trainer's ({len(missing)} missing, e.g. "
                    f"{(missing or extra)[0]!r}): start it with the trainer's --model-path")
        for k, v in mine.items():  # shapes only: the welcome tells the sampler the trainer's dtypes
            if theirs[k][0] != v[0]:
                return (f"the sampler's model differs from the trainer's at {k!r} (shape {theirs[k][0]} vs {v[0]}): "
                        "start it with the trainer's --model-path")
        return None

    def knows(self, sampler: str) -> bool:
        """Whether `sampler` was admitted at its hello, where its model was checked."""
        return sampler in self.via

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
            return f"pipeline.weight_transport=shared, but this sampler {why} (or set pipeline.weight_transport=auto)"
        via = "shared" if why is None and self.shared is not None else "zmq"
        self.via[sampler] = (key, via)
        how = ("through CUDA IPC" if self.uuid else "through shared memory") if via == "shared" \
            else "as frames on the sync port"
        console.print(f"pipeline: sampler {sampler.partition('#')[0]} receives the weights {how}")  # its --sampler-id
        return None

    def _cannot_map(self, can_map: dict) -> str | None:
        if can_map.get("shared") is not True:
            return "could not map them: see its log for why"
        if can_map.get("host") != host_id():
            return "runs on another host than the trainer: start it on the trainer's host"
        if self.uuid is not None and self.uuid not in (can_map.get("cuda") or []):
            return "does not see the trainer's GPU: let it see that device too (CUDA_VISIBLE_DEVICES)"
        return None

    def frames_for(self, sampler: str) -> list:
        """The newest weights for `sampler`: handles where it maps the shared set of this version, else frames
        (made at the publish, or, for a sampler new since, out of the shared set)."""
        if self.via.get(sampler, ("", "zmq"))[1] == "shared" and self.shared_version == self.version:
            return self.shared.shared_frames(sampler)
        if self.frames is not None:
            return self.frames
        return self.shared.wire_frames(sampler)

    def stale(self, sampler: str, have: tuple) -> bool:
        """Whether `sampler`, holding weights `have` (incarnation, version), must be sent the newest ones.
        Any request from it also means it has copied what it was handed last."""
        if self.shared is not None:
            self.shared.release(sampler)
            if sampler in self.shared.torn:
                return True
        return have != (self.incarnation, self.version)

    def close(self) -> None:
        if self.shared is not None:
            with self.lock:
                self.shared.close()


def other_base(ours: str | None, theirs) -> str | None:
    """Why a sampler whose base weights have digest `theirs` may not score reference log-probs against a trainer
    whose have `ours`, or None (None also when either side has no digest: a .bin model, or an older alignrl)."""
    if ours is None or not isinstance(theirs, str) or theirs == ours:
        return None
    return ("the sampler's model has the trainer's parameter shapes but other weights; the sampler computes the "
            "reference log-probs of the KL term from them, so they would be another model's: start it with the "
            "trainer's --model-path")
