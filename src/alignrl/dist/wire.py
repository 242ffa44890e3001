"""Messages between sampler and trainer processes as ZeroMQ multipart frames; never pickle.

A message is a list of frames:

    frame 0    msgpack map {"proto": PROTOCOL_VERSION, "kind": str, "token": str, "meta": {...},
                            "tensors": [{"name": str, "dtype": str, "shape": [int, ...], "nbytes": int}, ...]}
    frame 1..  raw tensor bytes in C order

`encode` (records, leases, requests) gives every tensor its own frame, in header order. `encode_weights`
packs the tensors into buckets instead: the header also holds "buckets": n, each entry holds "bucket" and
"offset" (a multiple of 64 inside that bucket frame), several small tensors share a frame of up to about
`bucket_bytes` and a tensor that large travels alone in its frame; n frames follow the header.

Only msgpack scalars, lists and maps are decoded (ext types are refused) and tensors are built with
`torch.frombuffer` over the received frames, so a message can never run code however it was crafted.
`decode` checks everything (protocol version, token, frame count, sizes against dtype x shape, bounds,
overlap, duplicates) before returning, and raises WireError with one line otherwise. The dtype table and
the served-model checks are those of the HTTP weight format (`alignrl.serve.weights`).

Deliberately left out: encryption and authentication beyond a shared token (the token keeps stray or
misconfigured processes out, it is sent in clear: use a trusted network or a tunnel), compression,
delta updates, and schemas for `meta` (the pipeline validates its own fields).
"""

from __future__ import annotations

import functools
import hmac
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import msgpack
import numpy as np
import torch
import zmq

from alignrl.serve import weights as _weights
from alignrl.serve.weights import DTYPE_NAMES, DTYPES, TensorSpec, WeightUpdate, manifest_of

__all__ = ["PROTOCOL_VERSION", "WireError", "Message", "encode", "encode_weights", "decode", "check_weights",
           "manifest_of", "TensorSpec", "DTYPES", "DTYPE_NAMES"]

PROTOCOL_VERSION = 1
TOKEN_ENV = "ALIGNRL_ZMQ_TOKEN"
ALIGN = 64  # tensor offsets inside a weight bucket: keeps every dtype aligned for frombuffer
MAX_HEADER = 64 << 20  # a header this large would list about a million tensors: refuse it
MAX_FRAMES = 1 << 16  # 2 TiB of 32 MiB weight buckets; far beyond any record
MAX_TENSORS = 1 << 20
MAX_DIMS = 8
MAX_NAME = 1024
MAX_KIND = 64
# Tensors over received frames are read-only views (documented on Message), so torch's warning about
# non-writable buffers says nothing new. A filter for that one message, set once (catch_warnings() per
# call would race between threads decoding at once); torch warns only once per process, so that one
# warning is also used up here, which keeps it away even where warnings are turned into errors.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class WireError(_weights.WireError):  # a ValueError; `except serve.weights.WireError` catches both
    """A message is malformed or comes from a peer that must not be trusted; one line says what to do."""

    peer: bytes | None = None  # set by zmq_link.Replier: the routing identity of the sender


@dataclass
class Message:
    """A decoded message. The tensors are views over the received frames, not copies (and may not be
    writable): clone them, or copy_ them into your own tensors, before modifying them in place."""

    kind: str
    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _pad(n: int) -> int:
    return -n % ALIGN


def _header(kind: str, meta: Mapping, token: str, entries: list, **extra) -> bytes:
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise WireError(f"message kind {kind!r} must be a non-empty string of at most {MAX_KIND} characters")
    if not isinstance(meta, Mapping):
        raise WireError(f"meta must be a dict, got {type(meta).__name__}")
    if not isinstance(token, str):
        raise WireError("token must be a string (the value of ALIGNRL_ZMQ_TOKEN, or '' for none)")
    try:
        return msgpack.packb({"proto": PROTOCOL_VERSION, "kind": kind, "token": token, "meta": dict(meta),
                              "tensors": entries, **extra}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"meta of a {kind!r} message is not plain msgpack data ({e}): send str/int/float/bool/"
                        "None/bytes/lists/dicts with str keys, and tensors as tensors") from None


def _spec(name: object, t: object, seen: set) -> dict:
    # Runs once per tensor of every publish: one lookup per check, no helper calls
    if type(name) is not str or not 0 < len(name) <= MAX_NAME:
        raise WireError(f"tensor name {name!r} must be a non-empty string of at most {MAX_NAME} characters")
    if name in seen:
        raise WireError(f"tensor {name!r} appears twice; names must be unique")
    seen.add(name)
    if not isinstance(t, torch.Tensor):
        raise WireError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    dtype, shape = DTYPE_NAMES.get(t.dtype), t.shape
    if dtype is None:
        raise WireError(f"tensor {name!r} has dtype {t.dtype}, which the wire format does not carry "
                        f"(one of {', '.join(DTYPES)}): cast it first")
    if len(shape) > MAX_DIMS:
        raise WireError(f"tensor {name!r} has {len(shape)} dimensions; the wire format carries at most {MAX_DIMS}")
    return {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": t.nbytes}


def encode(kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None, token: str = "") -> list:
    """Frames of one message: a msgpack header, then each tensor's bytes in its own frame.

    A CPU tensor that is already contiguous is not copied: its frame is a memoryview of the tensor's
    memory, so ZeroMQ can send it without a copy. Do not modify such tensors in place until the frames
    have been sent (Pusher.send, Requester.request and Replier.reply_msg copy them into ZeroMQ, which makes
    that moot there). Other tensors are made contiguous on the CPU first (one copy)."""
    entries, data, seen = [], [], set()
    for name, t in (tensors or {}).items():
        entries.append(_spec(name, t, seen))
        t = t.detach().cpu().contiguous()
        data.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # the array keeps t alive
    return [_header(kind, meta, token, entries), *data]


def encode_weights(named: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int = 32 << 20,
                   token: str = "", meta: Mapping | None = None) -> list:
    """Frames of a "weights" message (meta {"version", "nbytes"} plus `meta`) with the tensors in buckets.

    Every tensor is copied into a bucket this function owns (CPU tensors straight in; tensors on an
    accelerator are gathered there first, so each bucket is one transfer), so the frames are a snapshot:
    send them zero-copy to any number of peers and keep training meanwhile. A tensor of at least
    `bucket_bytes` gets a bucket of its own."""
    if type(version) is not int or version < 0:
        raise WireError(f"weights version {version!r} must be a non-negative int")
    if type(bucket_bytes) is not int or bucket_bytes < ALIGN:
        raise WireError(f"bucket_bytes {bucket_bytes!r} must be an int of at least {ALIGN}")
    entries, runs, sizes, seen, closed = [], [], [], set(), True
    with torch.no_grad():  # flat views of parameters that require grad
        for name, t in named:
            e = _spec(name, t, seen)
            nb = e["nbytes"]
            entries.append(e)
            if nb == 0:  # nothing to carry: the entry alone rebuilds it
                e["bucket"] = e["offset"] = 0
                continue
            pad = 0 if closed else -sizes[-1] % ALIGN
            if closed or sizes[-1] + pad + nb > bucket_bytes:
                sizes.append(0)
                runs.append([])
                pad = 0
            bucket, at = runs[-1], sizes[-1] + pad
            e["bucket"], e["offset"] = len(sizes) - 1, at
            if not bucket or bucket[-1][1] is not t.dtype:  # a run of one dtype starts at an aligned offset
                bucket.append([at, t.dtype, [], at])  # [start, dtype, parts, end]
            elif pad:  # zeroed, so no stale process memory goes out on the wire
                bucket[-1][2].append(_zeros(t.dtype, pad))
            bucket[-1][2].append(t.view(-1) if t.is_contiguous() else t.reshape(-1))  # a copy only if needed
            bucket[-1][3] = sizes[-1] = at + nb
            closed = nb >= bucket_bytes  # a big tensor keeps its frame to itself
    # One copy per run of same-dtype tensors, in one call: torch.cat writes their values straight into a
    # typed view of a buffer this function owns (so the frames are a snapshot). Per-tensor work is one
    # flat view: building a uint8 view of each tensor, or copying tensor by tensor, cost more than the
    # memcpy itself for the demo model's 50 tensors (3 MiB). The buffers come uninitialised from numpy's
    # malloc, not torch.empty: torch maps fresh pages for every large allocation, and faulting them in cost
    # four times the copy itself on each publish (3 MiB: 1.4 vs 0.3 ms).
    arrays = [np.empty(n, dtype=np.uint8) for n in sizes]
    with torch.no_grad():
        for a, bucket_runs in zip(arrays, runs):
            frame = torch.from_numpy(a)
            for i, (begin, dtype, parts, used) in enumerate(bucket_runs):
                gap_end = bucket_runs[i + 1][0] if i + 1 < len(bucket_runs) else used
                if used < gap_end:  # the alignment gap before the next run (zeroed too)
                    frame[used:gap_end].zero_()
                _cat_into(frame[begin:used].view(dtype), parts)
    total = sum(e["nbytes"] for e in entries)
    head = _header("weights", {**(meta or {}), "version": version, "nbytes": total}, token, entries,
                   buckets=len(sizes))
    return [head, *(memoryview(a) for a in arrays)]


@functools.cache
def _zeros(dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """Zero padding of `nbytes` (a multiple of the dtype's size, below ALIGN) in a run of `dtype` tensors."""
    return torch.zeros(nbytes // dtype.itemsize, dtype=dtype)


def _cat_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Concatenates flat tensors of out's dtype (and the CPU zero pads) into the CPU `out`: directly when
    all are on the CPU, else on the device of the first accelerator tensor, then one transfer for the
    whole run (at most `bucket_bytes` of device memory for the gathered copy)."""
    dev = next((p.device for p in parts if p.device.type != "cpu"), None)
    if dev is None:
        torch.cat(parts, out=out)
    elif len(parts) == 1:  # a tensor alone in its bucket goes straight to the host, no device-side copy
        out.copy_(parts[0])
    else:
        out.copy_(torch.cat([p.to(dev) for p in parts]))


def _buffer(f: object, i: int) -> memoryview:
    try:
        mv = f.buffer if isinstance(f, zmq.Frame) else memoryview(f)
        return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
    except (TypeError, ValueError):
        raise WireError(f"frame {i} is a {type(f).__name__}, not a bytes-like frame") from None


def _refuse_ext(code: int, data: bytes) -> None:
    raise WireError(f"header uses msgpack extension type {code}, which alignrl never sends")


def _int(v: object) -> bool:
    return type(v) is int and v >= 0


def _entry(e: object, i: int, packed: bool) -> tuple[str, torch.dtype, list, int]:
    # Runs once per tensor of every message: plain lookups and inline checks, no helper calls per dimension
    if type(e) is not dict:
        raise WireError(f"tensor entry {i} of the header is not a map")
    name, dtype, shape, nb = e.get("name"), e.get("dtype"), e.get("shape"), e.get("nbytes")
    if type(name) is not str or not 0 < len(name) <= MAX_NAME:
        raise WireError(f"tensor entry {i} has no valid name (a non-empty string of at most {MAX_NAME} chars)")
    dt = DTYPES.get(dtype) if type(dtype) is str else None
    if dt is None:
        raise WireError(f"tensor {name!r}: unknown dtype {dtype!r}; the wire format carries {', '.join(DTYPES)}")
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < 2**40 for d in shape):
        raise WireError(f"tensor {name!r}: bad shape {shape!r}; send a list of at most {MAX_DIMS} "
                        "non-negative ints")
    need = prod(shape) * dt.itemsize
    if type(nb) is not int or nb != need:
        raise WireError(f"tensor {name!r}: nbytes {nb!r} does not match {dtype} of shape {shape} ({need} bytes)")
    if packed and not (_int(e.get("bucket")) and _int(e.get("offset"))):
        raise WireError(f"tensor {name!r}: a weights entry needs non-negative int 'bucket' and 'offset'")
    return name, dt, shape, need


def _view(mv: memoryview, dtype: torch.dtype, shape: list, offset: int, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(mv, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
    if t.data_ptr() % dtype.itemsize:  # libzmq may hand over a frame at an odd address: align it (a copy)
        t = t.clone()
    return t.view(shape)


class _Buckets:
    """Tensors over the bucket frames of a weights message: one typed flat tensor per (bucket, dtype),
    made on first use, and one as_strided view of it per tensor. A frombuffer per tensor cost twice as
    much as the views themselves, for a model's many small tensors."""

    def __init__(self, bufs: list[memoryview]):
        self.bufs, self.flat = bufs, {}

    def view(self, b: int, dtype: torch.dtype, shape: list, offset: int) -> torch.Tensor:
        flat = self.flat.get((b, dtype))
        if flat is None:
            mv = self.bufs[b]
            flat = torch.frombuffer(mv, dtype=dtype, count=mv.nbytes // dtype.itemsize)
            if flat.data_ptr() % dtype.itemsize:  # libzmq may hand over a frame at an odd address: align it
                flat = flat.clone()
            self.flat[(b, dtype)] = flat
        return flat.as_strided(shape, _strides(tuple(shape)), offset // dtype.itemsize)


@functools.lru_cache(maxsize=4096)
def _strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def decode(frames: Sequence, token: str = "") -> Message:
    """Checks and decodes the frames of one message (bytes, zmq.Frame or any bytes-like object).

    When `token` is set the peer must have sent the same token. The tensors are read-only views over
    the frames (they keep the frames alive): copy them before modifying them in place."""
    if not isinstance(frames, Sequence) or not frames:
        raise WireError("empty message: expected a msgpack header frame followed by tensor frames")
    if len(frames) > MAX_FRAMES + 1:
        raise WireError(f"message has {len(frames)} frames, more than the limit of {MAX_FRAMES + 1}")
    head = _buffer(frames[0], 0)
    if head.nbytes > MAX_HEADER:
        raise WireError(f"header frame is {head.nbytes} bytes, more than the {MAX_HEADER}-byte limit: "
                        "not an alignrl message, or split it into smaller ones")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                                 max_bin_len=MAX_HEADER, max_str_len=MAX_HEADER)
    except WireError:
        raise
    except Exception as e:  # msgpack raises ValueError subclasses, TypeError for unhashable keys, ...
        raise WireError(f"header frame is not msgpack ({type(e).__name__}): the peer is not an alignrl "
                        "process, or not one speaking this wire format") from None
    if not isinstance(header, dict):
        raise WireError(f"header frame is msgpack {type(header).__name__}, not a map: the peer is not an "
                        "alignrl process")
    proto = header.get("proto")
    if type(proto) is not int:
        raise WireError("header has no protocol version: the peer is not an alignrl process")
    if proto != PROTOCOL_VERSION:
        raise WireError(f"peer speaks alignrl wire protocol {proto}, this process speaks {PROTOCOL_VERSION}: "
                        "run the same alignrl version on both sides")
    if token:
        sent = header.get("token")
        if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), token.encode()):
            raise WireError(f"peer did not present the shared token ({TOKEN_ENV}): set the same "
                            f"{TOKEN_ENV} for every sampler and trainer process")
    kind, meta, entries = header.get("kind"), header.get("meta"), header.get("tensors")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise WireError(f"header kind {kind!r} is not a non-empty string of at most {MAX_KIND} characters")
    if not isinstance(meta, dict):
        raise WireError(f"header meta of a {kind!r} message is not a map")
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise WireError(f"header 'tensors' of a {kind!r} message is not a list of at most {MAX_TENSORS} entries")
    packed = "buckets" in header
    nframes = header["buckets"] if packed else len(entries)
    if not _int(nframes) or len(frames) != 1 + nframes:
        raise WireError(f"{kind!r} message has {len(frames)} frames but its header announces 1 + {nframes!r}: "
                        "truncated, or not built by encode()/encode_weights()")
    bufs = [_buffer(f, i) for i, f in enumerate(frames[1:], 1)]
    tensors: dict[str, torch.Tensor] = {}
    ends = [0] * len(bufs)  # packed: bytes of each bucket used so far
    buckets = _Buckets(bufs)
    last = 0  # packed: entries come in (bucket, offset) order, so no byte is read twice
    for i, e in enumerate(entries):
        name, dtype, shape, nb = _entry(e, i, packed)
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice in a {kind!r} message")
        if not packed:
            if bufs[i].nbytes != nb:
                raise WireError(f"tensor {name!r}: frame {i + 1} holds {bufs[i].nbytes} bytes but {e['dtype']} "
                                f"of shape {shape} needs {nb}")
            tensors[name] = _view(bufs[i], dtype, shape, 0, nb)
            continue
        b, off = e["bucket"], e["offset"]
        if nb:
            if b >= len(bufs) or b < last or off % ALIGN or off < ends[b] or off + nb > bufs[b].nbytes:
                raise WireError(f"tensor {name!r}: bucket {b} offset {off} (+{nb} bytes) is out of order, "
                                f"misaligned or out of bounds of the {len(bufs)} bucket frame(s)")
            last, ends[b] = b, off + nb
        tensors[name] = buckets.view(b, dtype, shape, off) if nb else torch.empty(shape, dtype=dtype)
    for b, buf in enumerate(bufs if packed else ()):
        if ends[b] != buf.nbytes or not ends[b]:
            raise WireError(f"weights bucket frame {b} holds {buf.nbytes} bytes but its tensors end at byte "
                            f"{ends[b]}: send exactly what encode_weights() builds")
    if kind == "weights" and not _int(meta.get("version")):
        raise WireError(f"weights message has version {meta.get('version')!r}, not a non-negative int")
    return Message(kind, meta, tensors)


def check_weights(msg: Message, manifest: Mapping[str, TensorSpec]) -> None:
    """A "weights" message must name every tensor of `manifest` (see manifest_of) once, with its shape and
    dtype, and hold only finite floats; raises WireError otherwise, before any parameter is touched."""
    if msg.kind != "weights":
        raise WireError(f"expected a 'weights' message, got {msg.kind!r}")
    try:
        _weights.check_against(WeightUpdate(int(msg.meta["version"]), msg.tensors), manifest)
    except _weights.WireError as e:
        raise WireError(str(e)) from None
