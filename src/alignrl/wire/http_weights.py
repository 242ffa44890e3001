"""Weight-sync wire format: every named tensor of one sync in a single body, no pickle.

Layout (all integers little-endian):

    offset 0   8 bytes   magic b"ALRLWT01"
    offset 8   8 bytes   u64 H = length of the header
    offset 16  H bytes   msgpack map {"version": int >= 0,
                                      "tensors": [{"name": str, "dtype": str, "shape": [int, ...],
                                                   "offset": int, "nbytes": int}, ...]}
               padding   zero bytes up to the next multiple of 64 (the payload start)
    payload              raw tensor bytes in C order; `offset` is relative to the payload start and
                         a multiple of 64; the body ends exactly at the end of the last tensor

dtype is one of DTYPES' keys. Only msgpack scalars, lists and maps are decoded and tensors are
built with `torch.frombuffer` over the received bytes, so a body can never run code
(pickle, `torch.load` of network bytes) however it was crafted. `decode` checks the whole body
(bounds, sizes, overlap, truncation) and `check_against` checks it against the served model
(names, shapes, dtypes) before any parameter is touched, so a bad update leaves the old weights.

Deliberately left out: compression, deltas, sharded pushes over several requests.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod

import msgpack
import torch

from alignrl.errors import UserError

MAGIC = b"ALRLWT01"
ALIGN = 64
CONTENT_TYPE = "application/x-alignrl-weights"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 64 << 20  # a header this large would list millions of tensors: refuse it instead


class WireError(UserError):
    """The body is not a valid weight update; the message says what is wrong."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # a DTYPES key

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass
class WeightUpdate:
    version: int
    tensors: dict[str, torch.Tensor]  # views over the received body: copy them before the body goes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorSpec]:
    return {n: TensorSpec(tuple(t.shape), DTYPE_NAMES[t.dtype]) for n, t in named}


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bytes:
    """One body holding every tensor; the tensor bytes are copied once, straight into it."""
    entries, parts, offset = [], [], 0
    tensors = [(n, t.detach().contiguous().cpu()) for n, t in named_tensors]
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise WireError(f"tensor {name!r} has dtype {t.dtype}, which the wire format does not carry")
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes})
        offset += nbytes + _pad(nbytes)
    header = msgpack.packb({"version": int(version), "tensors": entries}, use_bin_type=True)
    head = MAGIC + struct.pack("<Q", len(header)) + header
    parts.append(head + b"\0" * _pad(len(head)))
    for i, ((_, t), e) in enumerate(zip(tensors, entries)):
        if e["nbytes"]:
            parts.append(t.reshape(-1).view(torch.uint8).numpy())  # a view: join copies it once
        if i < len(tensors) - 1:
            parts.append(b"\0" * _pad(e["nbytes"]))
    return b"".join(parts)


def _entry(e: object, i: int) -> tuple[str, str, tuple[int, ...], int, int]:
    if not isinstance(e, dict):
        raise WireError(f"header entry {i} is not a map")
    name, dtype, shape, off, nb = (e.get(k) for k in ("name", "dtype", "shape", "offset", "nbytes"))
    if not isinstance(name, str) or not name:
        raise WireError(f"header entry {i} has no tensor name")
    if dtype not in DTYPES:
        raise WireError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
        raise WireError(f"tensor {name!r}: shape {shape!r} is not a list of up to 8 non-negative ints")
    for k, v in (("offset", off), ("nbytes", nb)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise WireError(f"tensor {name!r}: {k} {v!r} is not a non-negative int")
    if nb != prod(shape) * DTYPES[dtype].itemsize:
        raise WireError(f"tensor {name!r}: nbytes {nb} does not match shape {shape} of {dtype}")
    if off % ALIGN:
        raise WireError(f"tensor {name!r}: offset {off} is not a multiple of {ALIGN}")
    return name, dtype, tuple(shape), off, nb


def decode(body: bytes) -> WeightUpdate:
    """Parse and bounds-check a body built by `encode`; raises WireError on anything else."""
    if len(body) < 16 or body[:8] != MAGIC:
        raise WireError(f"not an alignrl weight update (expected magic {MAGIC!r} at the start of the body)")
    (hlen,) = struct.unpack_from("<Q", body, 8)
    if hlen > min(MAX_HEADER, len(body) - 16):
        raise WireError(f"header length {hlen} runs past the end of the {len(body)}-byte body (truncated?)")
    try:
        header = msgpack.unpackb(body[16:16 + hlen], raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise WireError("header must be a map with a 'tensors' list")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version < 2**63:
        raise WireError(f"version {version!r} is not a non-negative int")
    start = 16 + hlen + _pad(16 + hlen)
    payload = len(body) - start
    tensors: dict[str, torch.Tensor] = {}
    end = 0  # tensors must be in offset order without overlap, so no byte is read twice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer over read-only bytes: we only read them
        for i, e in enumerate(header["tensors"]):
            name, dtype, shape, off, nb = _entry(e, i)
            if name in tensors:
                raise WireError(f"tensor {name!r} appears twice")
            if off < end:
                raise WireError(f"tensor {name!r} overlaps the previous tensor (offset {off} < {end})")
            if off + nb > payload:
                raise WireError(f"tensor {name!r} ends at payload byte {off + nb} but the payload has only "
                                f"{max(payload, 0)} bytes: the body is truncated")
            t = (torch.frombuffer(body, dtype=DTYPES[dtype], count=prod(shape), offset=start + off)
                 if nb else torch.empty(0, dtype=DTYPES[dtype]))
            tensors[name] = t.view(shape)
            end = off + nb
    if payload != end:
        raise WireError(f"body has {payload - end} bytes after the last tensor; send exactly what encode() builds")
    return WeightUpdate(int(version), tensors)


def check_against(update: WeightUpdate, manifest: Mapping[str, TensorSpec]) -> None:
    """The update must name every served parameter once, each with the served shape and dtype:
    a partial push would silently leave stale layers in use."""
    unknown = [n for n in update.tensors if n not in manifest]
    if unknown:
        raise WireError(f"{len(unknown)} tensor name(s) not in the served model, e.g. {unknown[0]!r}; "
                        "send the names of model.named_parameters() (strip wrapper prefixes such as 'module.')")
    missing = [n for n in manifest if n not in update.tensors]
    if missing:
        raise WireError(f"update lacks {len(missing)} of the model's {len(manifest)} tensors, e.g. {missing[0]!r}; "
                        "push all parameters in one update")
    for name, spec in manifest.items():
        t = update.tensors[name]
        if tuple(t.shape) != spec.shape:
            raise WireError(f"tensor {name!r} has shape {list(t.shape)}, the served model needs {list(spec.shape)}")
        if DTYPE_NAMES[t.dtype] != spec.dtype:
            raise WireError(f"tensor {name!r} is {DTYPE_NAMES[t.dtype]}, the served model needs {spec.dtype}; "
                            "cast before sending")
        # A float64 sum is finite exactly when every element is (finite float32/16 values cannot overflow
        # it), and costs one read of the tensor instead of a full-size boolean temporary.
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.sum(dtype=torch.float64))):
            raise WireError(f"tensor {name!r} contains NaN or infinity; refusing to serve it")
