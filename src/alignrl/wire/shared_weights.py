"""Weights handed to samplers on the trainer's own host through memory both processes map, instead of in
the sync port's frames (`pipeline.weight_transport`).

A trainer that publishes from a CUDA device fills bucket buffers on that device and hands samplers CUDA IPC
handles to them: a sampler on the same machine copies the new weights device to device, where the frames
cost a device-to-host copy on the trainer, a loopback TCP transfer and a host-to-device copy on the sampler
(on one H100, 518 MiB: under a millisecond against about 0.1 s for the trainer's copy alone). A trainer on
the CPU fills POSIX shared-memory segments, which samplers on the same host map by name (and which can be
sent as frames too, to a sampler that joins between two publishes and cannot map them).

A "weights_shared" message carries no tensor frames. Its meta holds the version, the layout blob of
`weights_wire` (the same tensor entries with bucket and offset, checked by `wire`'s cached parser) and one
description per bucket buffer, `{"shm": name, "size": n}` or `{"cuda": [IPC handle fields], "uuid": device
uuid, "size": n}`: plain msgpack (the handles are bytes), never pickle.

The trainer never refills a set that a sampler was handed and has not asked again since (a sampler copies
the weights before its next request); it fills another set meanwhile, at most MAX_SETS of them. A sampler
silent for HOLD_S after it was handed a set is taken for gone: its set may be refilled, and should it come
back it is sent the weights again before anything else (`torn`), so torn weights never generate.

Deliberately left out: sharing between hosts (the frames do that), and pinned host memory for a CUDA
trainer's frames.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from alignrl.wire import shm_segments
from alignrl.wire.weight_buckets import _Buckets, _Plan, _view
from alignrl.wire.frames import ALIGN, Message, WireError, _Frames, _header, _layout
from alignrl.errors import UserError
from alignrl.utils.tracking import console

__all__ = ["SHARED_KIND", "host_id", "cuda_uuids", "SharedPublisher", "SharedReader", "SharedUnavailable"]

SHARED_KIND = "weights_shared"
HOLD_S = 30.0
MAX_SETS = 3
_CUDA_FIELDS = (int, bytes, int, int, bytes, int, bytes, bool)  # UntypedStorage._share_cuda_()
_CREATED: set[str] = set()  # segments this process made (a reader in the same process must not untrack them)
_LINGER: list[SharedMemory] = []  # closed sets' segments that ZeroMQ was still sending from


class SharedUnavailable(UserError, RuntimeError):
    """Shared weights cannot be had here: the trainer cannot make them (a small /dev/shm, a GPU that exports
    no IPC handles), or the sampler cannot map them (a private /dev/shm, the trainer's GPU hidden from it)."""


def host_id() -> str:
    """Same host name and boot: the processes can share memory (a container with its own /dev/shm fails
    later, when the sampler maps the first segment, and falls back to frames)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def cuda_uuids() -> list[str]:
    """The uuid of every CUDA device this process sees, in its own numbering."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


class _Set:
    """One set of bucket buffers another process on this host can map, with each tensor's typed view."""

    def __init__(self, plan: _Plan, device: torch.device):
        self.plan, self.held, self._shm = plan, {}, []
        if device.type == "cuda":
            self.buffers = [torch.zeros(max(n, ALIGN), dtype=torch.uint8, device=device) for n in plan.sizes]
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            try:
                self.described = [{"cuda": list(b.untyped_storage()._share_cuda_()), "uuid": uuid, "size": n}
                                  for b, n in zip(self.buffers, plan.sizes)]
            except RuntimeError as e:  # e.g. a MIG slice, or an allocator whose blocks cannot be exported
                raise SharedUnavailable(f"cannot export CUDA IPC handles on {device} ({str(e).splitlines()[0]}): "
                                        "set pipeline.weight_transport=zmq") from None
            self.host = None
        else:
            try:
                for n in plan.sizes:
                    self._shm.append(shm_segments.create(max(n, ALIGN)))
                    _CREATED.add(self._shm[-1].name)
                    # reserve the pages now: a full /dev/shm is ENOSPC here, not SIGBUS at the first write
                    os.posix_fallocate(self._shm[-1]._fd, 0, max(n, ALIGN))
            except OSError as e:
                self.close()
                raise SharedUnavailable(f"cannot make {sum(plan.sizes)} bytes of shared memory in /dev/shm "
                                        f"({e.strerror or e}): enlarge it (docker run --shm-size) or set "
                                        "pipeline.weight_transport=zmq") from None
            # the frames for samplers elsewhere are these very buffers (zeroed by the kernel)
            self.host = _Buckets(plan, [np.ndarray((n,), np.uint8, buffer=s.buf) for s, n in zip(self._shm, plan.sizes)])
            self.buffers = self.host.frames
            self.described = [{"shm": s.name, "size": n} for s, n in zip(self._shm, plan.sizes)]
        self.views = [_view(self.buffers[slot[1]], *slot[2:]) for slot in plan.slots]

    def holding(self, now: float) -> bool:
        """A sampler it was handed to may still be copying from it."""
        return any(now - t < HOLD_S for t in self.held.values())

    def free(self, now: float) -> bool:
        return not self.holding(now) and (self.host is None or self.host.free())

    def close(self) -> None:
        """Removes the segments' names (the memory goes once every process has unmapped it) and unmaps ours
        unless ZeroMQ still sends from them (then that happens when the last frame is dropped)."""
        self.host = self.buffers = self.views = None
        for seg in self._shm:
            _CREATED.discard(seg.name)
            try:
                seg.unlink()
                seg.close()
            except (OSError, BufferError):
                _LINGER.append(seg)  # never collected mid-send: SharedMemory.__del__ would raise BufferError
        self._shm = []


class SharedPublisher:
    """The trainer's newest weights in shared sets (rank 0). `publish` runs in the training thread; the
    other methods in the sync thread, under the coordinator's lock, which `publish` takes only to pick a set
    and to make the filled one current."""

    def __init__(self, bucket_bytes: int, token: str, lock: threading.Lock):
        self.bucket_bytes, self.token, self.lock = bucket_bytes, token, lock
        self.plan: _Plan | None = None
        self.sets: list[_Set] = []
        self.retired: list[_Set] = []  # sets left to ZeroMQ's sends (no sampler holds them), closed once free
        self.current: _Set | None = None
        self.head = b""  # the "weights_shared" message of the current version (header only)
        self.meta: dict = {}
        self.torn: set[str] = set()  # samplers whose set was refilled while they may still have been copying
        self._wire: tuple[int, list] | None = None  # (version, frames) made for samplers elsewhere
        self._host: list[_Buckets] = []  # host bucket sets for a CUDA set's frames, reused once unheld
        self._stream = None
        gone = shm_segments.sweep()  # a trainer's whole process group killed (its resource tracker too) left them
        if gone:
            console.print(f"pipeline: removed {gone} shared-memory segment(s) that a killed trainer left in /dev/shm")

    def publish(self, named: list, version: int, meta: dict) -> None:
        src = [t for _, t in named]
        dev = next((t.device for t in src if not t.is_cpu), torch.device("cpu"))
        with self.lock:
            if self.plan is None or not self.plan.fits(named):  # the current set stays readable until the swap
                self.plan, self._host = _Plan(named, self.bucket_bytes), []
                self.retired += self.sets
                self.sets = []
            target = self._pick(dev)
        with torch.no_grad():
            picked = [src[slot[0]] for slot in target.plan.slots]
            if picked:
                torch._foreach_copy_(target.views, picked)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # a sampler's copy must see the whole update
        meta = {**meta, "version": version, "nbytes": target.plan.nbytes}
        head = _header(SHARED_KIND, {**meta, "layout": target.plan.layout, "buffers": target.described}, self.token,
                       tensors=[])
        with self.lock:
            self.current, self.head, self.meta, self._wire = target, head, meta, None

    def _pick(self, dev: torch.device) -> _Set:
        """A set no sampler is copying from and ZeroMQ is not sending, else a new one (up to MAX_SETS), else
        a new one in place of a set only ZeroMQ still sends (it is closed once sent), else the one whose
        samplers have been silent longest once they pass HOLD_S (they are sent the weights again)."""
        said, since = False, time.monotonic()
        while True:
            now = time.monotonic()
            for s in [s for s in self.retired if s is not self.current and s.free(now)]:
                s.close()
                self.retired.remove(s)
            for s in self.sets:
                if s is not self.current and s.free(now):
                    return self._reset(s)
            sending = [s for s in self.sets if s is not self.current and not s.holding(now)]
            if len(self.sets) >= MAX_SETS and sending:
                self.sets.remove(sending[0])
                self.retired.append(self._reset(sending[0]))
            if len(self.sets) < MAX_SETS:
                self.sets.append(_Set(self.plan, dev))
                return self.sets[-1]
            if not said and now - since > 5.0:
                console.print("[yellow]pipeline: every shared weight set is still being copied by a sampler; "
                              f"waiting (a sampler silent for {HOLD_S:g} s is taken for gone)[/yellow]")
                said = True
            self.lock.release()  # let the sync thread take the holders' next requests
            try:
                time.sleep(0.002)
            finally:
                self.lock.acquire()

    def _reset(self, s: _Set) -> _Set:
        self.torn.update(s.held)
        s.held = {}
        return s

    def shared_frames(self, sampler: str) -> list:
        """The current version as handles; the set stays untouched until `sampler` asks again."""
        self.current.held[sampler] = time.monotonic()
        self.torn.discard(sampler)
        return [self.head]

    def wire_frames(self, sampler: str) -> list:
        """The current version as bucket frames, for a sampler that cannot map the sets: a CPU set's own
        buffers; a CUDA set's copied to the host once per version (on a side stream, beside training)."""
        self.torn.discard(sampler)
        plan = self.current.plan
        if self.current.host is not None:
            host = self.current.host
        elif self._wire is not None and self._wire[0] == self.meta["version"]:
            return self._wire[1]
        else:  # rare (the board encodes frames at the publish while it knows such samplers): under the lock
            host = next((b for b in self._host if b.free()), None) or _Buckets(plan)
            self._host = [host, *[b for b in self._host if b is not host]][:2]
            dev = self.current.buffers[0].device
            self._stream = self._stream or torch.cuda.Stream(dev)
            with torch.cuda.stream(self._stream):
                for frame, buf in zip(host.frames, self.current.buffers):
                    frame.copy_(buf[:frame.numel()])
            self._stream.synchronize()
        frames = [_header("weights", self.meta, self.token, buckets=len(plan.sizes), layout=plan.layout),
                  *(memoryview(a) for a in host.arrays)]
        if self.current.host is None:
            self._wire = (self.meta["version"], frames)
        return frames

    def release(self, sampler: str) -> None:
        """`sampler` asked again: it has copied whatever it was handed."""
        for s in self.sets:
            s.held.pop(sampler, None)

    def close(self) -> None:
        for s in self.sets + self.retired:
            s.close()
        self.sets, self.retired, self.current, self._wire, self._host = [], [], None, None, []


class SharedReader:
    """The sampler's side: maps the trainer's buffers (once each, per trainer incarnation) and gives the
    tensors of a "weights_shared" message as views into them, to be copied before the next request."""

    def __init__(self):
        self.incarnation: object = None
        self._mapped: dict[object, torch.Tensor] = {}
        self._shm: list[SharedMemory] = []
        self.devices: set[torch.device] = set()

    def tensors(self, msg: Message) -> dict[str, torch.Tensor]:
        meta = msg.meta
        if meta.get("incarnation") != self.incarnation:  # a restarted trainer: its buffers are new
            self.close()
            self.incarnation = meta.get("incarnation")
        layout, described = meta.get("layout"), meta.get("buffers")
        if not isinstance(layout, bytes) or not isinstance(described, list):
            raise WireError("a weights_shared message needs a 'layout' blob and a 'buffers' list: run the same "
                            "alignrl version on both sides")
        entries, ends = _layout(layout)
        if len(ends) > len(described):
            raise WireError(f"weights_shared layout puts tensors in buffer {len(ends) - 1} of {len(described)}")
        bufs = _Frames([self._map(d, ends[b] if b < len(ends) else 0) for b, d in enumerate(described)])
        return {name: bufs.view(b, dtype, shape, strides, at, nb) for name, dtype, shape, strides, b, at, nb in entries}

    def _map(self, d: object, need: int) -> torch.Tensor:
        if not isinstance(d, dict) or type(d.get("size")) is not int or d["size"] < need:
            raise WireError(f"a weights_shared buffer description {_short(d)} is malformed or smaller than the "
                            f"{need} bytes its tensors need")
        key = repr(sorted(d.items()))
        buf = self._mapped.get(key)
        if buf is None:
            buf = self._open_cuda(d) if "cuda" in d else self._open_shm(d)
            self._mapped[key] = buf
            self.devices.add(buf.device)
        return buf[:d["size"]]

    def _open_shm(self, d: dict) -> torch.Tensor:
        name = d.get("shm")
        if not isinstance(name, str) or not 0 < len(name) < 250 or "/" in name.lstrip("/"):
            raise WireError(f"shared-memory name {name!r} is not a plain segment name")
        try:
            seg = SharedMemory(name=name)
        except OSError as e:
            raise SharedUnavailable(f"cannot map the trainer's shared memory {name!r} ({e.strerror or e})") from None
        # attaching registers the segment with this process's resource tracker, which would remove the
        # trainer's segment when this sampler exits (Python < 3.13 has no track=False)
        if seg.name not in _CREATED:
            resource_tracker.unregister(seg._name, "shared_memory")
        self._shm.append(seg)
        if seg.size < d["size"]:
            raise WireError(f"shared-memory segment {name!r} holds {seg.size} bytes, not the {d['size']} announced")
        return torch.from_numpy(np.ndarray((d["size"],), np.uint8, buffer=seg.buf))

    def _open_cuda(self, d: dict) -> torch.Tensor:
        fields, uuid = d.get("cuda"), d.get("uuid")
        if (not isinstance(fields, list) or len(fields) != len(_CUDA_FIELDS)
                or not all(type(v) is t for v, t in zip(fields, _CUDA_FIELDS))):
            raise WireError(f"a CUDA IPC buffer description {_short(d)} does not hold the handle fields")
        uuids = cuda_uuids()
        if uuid not in uuids:
            raise SharedUnavailable(f"the trainer's weights are on CUDA device {uuid}, which this process does "
                                    f"not see (CUDA_VISIBLE_DEVICES={_visible()})")
        fields = [uuids.index(uuid), *fields[1:]]
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
        except RuntimeError as e:
            raise SharedUnavailable(f"cannot open the trainer's CUDA IPC handle ({str(e).splitlines()[0]})") from None
        if storage.nbytes() < d["size"]:
            raise WireError(f"CUDA IPC buffer holds {storage.nbytes()} bytes, not the {d['size']} announced")
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))

    def synchronize(self) -> None:
        """Waits for the copies out of mapped CUDA buffers: the trainer may refill them after our next request."""
        for dev in self.devices:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def close(self) -> None:
        self._mapped.clear()
        for seg in self._shm:
            try:
                seg.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
        self._shm, self.devices = [], set()


def _short(d: object) -> str:
    text = repr(d)
    return text if len(text) <= 80 else text[:77] + "..."


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")

