"""Messages between sampler and trainer processes as ZeroMQ multipart frames; never pickle.

A message is a list of frames:

    frame 0    msgpack map {"proto": PROTOCOL_VERSION, "kind": str, "token": str, "meta": {...},
                            "tensors": [{"name": str, "dtype": str, "shape": [int, ...], "nbytes": int}, ...]}
    frame 1..  raw tensor bytes in C order

`encode` (records, leases, requests) gives every tensor its own frame, in header order. Weights
(`alignrl.wire.weight_buckets.WeightsEncoder`) are packed into buckets instead: in place of "tensors" the
header holds "buckets": n and "layout": one msgpack blob of the entries, each with "bucket" and "offset"
(a multiple of 64 inside that bucket frame); several small tensors share a frame of up to about
`bucket_bytes`, a tensor that large travels alone in its frame, and n frames follow the header. A publisher
sends the same layout blob with every update, so `decode` checks it once and remembers it.

Only msgpack scalars, lists and maps are decoded (ext types are refused) and tensors are built with
`torch.frombuffer` over the received frames, so a message can never run code however it was crafted.
`decode` checks everything (protocol version, token, frame count, sizes against dtype x shape, bounds,
overlap, duplicates) before returning, and raises WireError with one line otherwise. The dtype table and
the served-model checks are those of the HTTP weight format (`alignrl.wire.http_weights`).

Deliberately left out: encryption and authentication beyond a shared token (the token keeps stray or
misconfigured processes out, it is sent in clear: use a trusted network or a tunnel), compression,
delta updates, and schemas for `meta` (the pipeline validates its own fields).
"""

from __future__ import annotations

import functools
import hmac
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import msgpack
import torch
import zmq

from alignrl.wire import http_weights as _weights
from alignrl.wire.http_weights import DTYPE_NAMES, DTYPES, TensorSpec, WeightUpdate, manifest_of

__all__ = ["PROTOCOL_VERSION", "WireError", "Message", "encode", "decode", "check_weights",
           "manifest_of", "TensorSpec", "DTYPES", "DTYPE_NAMES"]

PROTOCOL_VERSION = 2  # 2: a weights header carries its tensor entries as one msgpack blob, "layout"
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


def _header(kind: str, meta: Mapping, token: str, **fields) -> bytes:
    """The msgpack header frame: proto, kind, token, meta and the message's `fields` (tensors, or buckets and
    layout)."""
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise WireError(f"message kind {kind!r} must be a non-empty string of at most {MAX_KIND} characters")
    if not isinstance(meta, Mapping):
        raise WireError(f"meta must be a dict, got {type(meta).__name__}")
    if not isinstance(token, str):
        raise WireError("token must be a string (the value of ALIGNRL_ZMQ_TOKEN, or '' for none)")
    try:
        return msgpack.packb({"proto": PROTOCOL_VERSION, "kind": kind, "token": token, "meta": dict(meta),
                              **fields}, use_bin_type=True)
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
    return [_header(kind, meta, token, tensors=entries), *data]


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


class _Frames:
    """Tensors over received frames: one typed flat tensor per (frame, dtype), made on first use, and one
    as_strided view of it per tensor. For a weights bucket holding many small tensors, a frombuffer per
    tensor cost twice as much as the views themselves."""

    def __init__(self, bufs: list[memoryview] | list[torch.Tensor]):
        self.bufs, self.flat = bufs, {}  # received frames, or uint8 tensors (buffers shared_weights mapped)

    def view(self, b: int, dtype: torch.dtype, shape: tuple, strides: tuple, at: int, nbytes: int) -> torch.Tensor:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        flat = self.flat.get((b, dtype))
        if flat is None:
            buf = self.bufs[b]
            if isinstance(buf, torch.Tensor):
                flat = buf[:buf.numel() - buf.numel() % dtype.itemsize].view(dtype)
            else:
                flat = torch.frombuffer(buf, dtype=dtype, count=buf.nbytes // dtype.itemsize)
            if flat.data_ptr() % dtype.itemsize:  # libzmq may hand over a frame at an odd address: align it
                flat = flat.clone()
            self.flat[(b, dtype)] = flat
        return flat.as_strided(shape, strides, at)


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
    kind, meta = header.get("kind"), header.get("meta")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise WireError(f"header kind {kind!r} is not a non-empty string of at most {MAX_KIND} characters")
    if not isinstance(meta, dict):
        raise WireError(f"header meta of a {kind!r} message is not a map")
    if "layout" in header:
        tensors = _bucketed(kind, header["layout"], header.get("buckets"), frames)
    else:
        tensors = _framed(kind, header.get("tensors"), frames)
    if kind == "weights" and not _int(meta.get("version")):
        raise WireError(f"weights message has version {meta.get('version')!r}, not a non-negative int")
    return Message(kind, meta, tensors)


def _announced(kind: str, frames: Sequence, n: object) -> list[memoryview]:
    if not _int(n) or len(frames) != 1 + n:
        raise WireError(f"{kind!r} message has {len(frames)} frames but its header announces 1 + {n!r}: "
                        "truncated, or not built by encode()/WeightsEncoder")
    return [_buffer(f, i) for i, f in enumerate(frames[1:], 1)]


def _framed(kind: str, entries: object, frames: Sequence) -> dict[str, torch.Tensor]:
    """The tensors of a message with one frame per tensor (encode)."""
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise WireError(f"header 'tensors' of a {kind!r} message is not a list of at most {MAX_TENSORS} entries")
    bufs = _announced(kind, frames, len(entries))
    views = _Frames(bufs)
    tensors: dict[str, torch.Tensor] = {}
    for i, e in enumerate(entries):
        name, dtype, shape, nb = _entry(e, i, False)
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice in a {kind!r} message")
        if bufs[i].nbytes != nb:
            raise WireError(f"tensor {name!r}: frame {i + 1} holds {bufs[i].nbytes} bytes but {e['dtype']} "
                            f"of shape {shape} needs {nb}")
        shape = tuple(shape)
        tensors[name] = views.view(i, dtype, shape, _strides(shape), 0, nb)
    return tensors


def _bucketed(kind: str, layout: object, n: object, frames: Sequence) -> dict[str, torch.Tensor]:
    """The tensors of a weights message: views into its bucket frames where the layout blob puts them."""
    if not isinstance(layout, bytes):
        raise WireError(f"header 'layout' of a {kind!r} message is not a msgpack blob of tensor entries")
    entries, ends = _layout(layout)
    bufs = _announced(kind, frames, n)
    if len(ends) > len(bufs):
        raise WireError(f"weights layout puts tensors in bucket {len(ends) - 1}, out of bounds of the {len(bufs)} "
                        "bucket frame(s)")
    for b, buf in enumerate(bufs):
        end = ends[b] if b < len(ends) else 0
        if end > buf.nbytes:
            raise WireError(f"weights bucket frame {b} holds {buf.nbytes} bytes but its tensors run out of bounds to "
                            f"byte {end}: truncated, or not built by WeightsEncoder")
        if end != buf.nbytes or not end:
            raise WireError(f"weights bucket frame {b} holds {buf.nbytes} bytes but its tensors end at byte "
                            f"{end}: send exactly what WeightsEncoder builds")
    buckets = _Frames(bufs)
    return {name: buckets.view(b, dtype, shape, strides, at, nb) for name, dtype, shape, strides, b, at, nb in entries}


@functools.lru_cache(maxsize=16)
def _layout(raw: bytes) -> tuple[tuple, tuple]:
    """The checked entries of a weights layout, as (name, dtype, shape, strides, bucket, offset in elements,
    nbytes), and the bytes each bucket frame must hold. Cached: a publisher sends the same blob with every
    update (WeightsEncoder), so a sampler checks it once; for the demo model's 50 tensors the checks and the
    parse cost a third of decoding. A blob that fails raises every time (errors are not cached)."""
    try:
        entries = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_refuse_ext,
                                  max_bin_len=MAX_HEADER, max_str_len=MAX_HEADER)
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"weights layout is not msgpack ({type(e).__name__}): send what WeightsEncoder "
                        "builds") from None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise WireError(f"weights layout is not a list of at most {MAX_TENSORS} tensor entries")
    out, ends, seen = [], [], set()
    for i, e in enumerate(entries):
        name, dtype, shape, nb = _entry(e, i, True)
        if name in seen:
            raise WireError(f"tensor {name!r} appears twice in a 'weights' message")
        seen.add(name)
        b, off = e["bucket"], e["offset"]
        if nb:  # entries come in (bucket, offset) order, so no byte is read twice
            if b >= MAX_FRAMES or b < len(ends) - 1 or off % ALIGN or (b < len(ends) and off < ends[b]):
                raise WireError(f"tensor {name!r}: bucket {b} offset {off} (+{nb} bytes) is out of order, "
                                "misaligned or out of bounds of the bucket frames")
            ends += [0] * (b + 1 - len(ends))
            ends[b] = off + nb
        shape = tuple(shape)
        out.append((name, dtype, shape, _strides(shape), b, off // dtype.itemsize, nb))
    return tuple(out), tuple(ends)


def check_weights(msg: Message, manifest: Mapping[str, TensorSpec]) -> None:
    """A "weights" message must name every tensor of `manifest` (see manifest_of) once, with its shape and
    dtype, and hold only finite floats; raises WireError otherwise, before any parameter is touched."""
    if msg.kind != "weights":
        raise WireError(f"expected a 'weights' message, got {msg.kind!r}")
    try:
        _weights.check_against(WeightUpdate(int(msg.meta["version"]), msg.tensors), manifest)
    except _weights.WireError as e:
        raise WireError(str(e)) from None
