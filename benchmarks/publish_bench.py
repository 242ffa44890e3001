"""Weight publish against a raw ZeroMQ copy of the same bytes (part of `async_vs_sync.py`, which prints it).

`publish_bench(named, repeats)` times a `WeightsEncoder` call (the snapshot the trainer keeps while it goes
on training; one encoder publishes again and again, as the trainer's does) + sending its frames over a
ZeroMQ PUSH/PULL pair on 127.0.0.1 + receiving them + `alignrl.wire.frames.decode`, against one blob of the
same size sent with copy=True and received; and the same-host path (`shared`: the weights copied into a
shared-memory set, its handles sent, mapped and viewed by name).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def demo_weights(model_dir: Path) -> list:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return list(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).named_parameters())


def synthetic_weights(mib: int) -> list:
    """fp32 tensors shaped like a transformer's (per layer: 4 square projections, 2 MLP matrices, 2 norms),
    about `mib` MiB in all: large enough that bytes, not per-message overheads, decide the time."""
    import torch

    d, layers = 1024, max(1, round(mib * 2**20 / (4 * 1024 * 1024 * 12)))
    named = [("embed", torch.randn(4 * d, d))]
    for i in range(layers):
        named += [(f"l{i}.{n}", torch.randn(d, d)) for n in ("q", "k", "v", "o")]
        named += [(f"l{i}.up", torch.randn(4 * d, d)), (f"l{i}.down", torch.randn(d, 4 * d))]
        named += [(f"l{i}.norm1", torch.randn(d)), (f"l{i}.norm2", torch.randn(d))]
    return named


def publish_bench(named: list, repeats: int) -> dict:
    """Medians (s) of: our publish path (`wire`), a raw ZeroMQ copy of the same bytes (`raw_copy`: the
    encoded frames' bytes as one blob, sent with copy=True, as ZeroMQ copies a message it is given), the same
    blob sent zero-copy (`raw`), the encoder / decode alone, and the same-host shared path (`shared`)."""
    import torch
    import zmq

    torch.set_num_threads(1)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    closers: list = []
    try:
        fns, total, n_frames = _wire_rounds(named, push, pull)
        fns["shared"] = _shared_round(named, push, pull, closers)
        times = _time_in_blocks(fns, repeats)
    finally:
        for close in closers:
            close()
        push.close()
        pull.close()
        ctx.term()
    return {"bytes": total, "frames": n_frames, "params": sum(t.numel() for _, t in named),
            **{k: statistics.median(v) for k, v in times.items()}}


def _time_in_blocks(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Each variant is timed in its own block of rounds, and every round drops its frames before the clock
    stops. Zero-copy frames are released later by pyzmq's garbage-collector thread; in a block that cost falls on
    the same variant's next round (as it does for a trainer publishing step after step), whereas interleaving
    the variants round by round moved it into the raw copy's timing (measured: raw 2.4 ms after a weights round
    against 1.0 ms after a raw round)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for half in (repeats - repeats // 2, repeats // 2):  # two passes over the blocks, so drift hits all
        for k, fn in fns.items():
            for i in range(3 + half):  # 3 warm-up rounds absorb what the previous block left behind
                dt = fn()
                if i >= 3:
                    times[k].append(dt)
    return times


def _wire_rounds(named: list, push, pull) -> tuple[dict, int, int]:
    """One round of each frames variant (wire, raw_copy, raw, encode, decode), the frames' bytes and count."""
    from alignrl.wire.frames import decode
    from alignrl.wire.weight_buckets import WeightsEncoder

    encode_weights = WeightsEncoder()  # plans on its first call, like the trainer's WeightBoard
    first = encode_weights(named, 1)
    sizes = [memoryview(f).nbytes for f in first]
    total = sum(sizes)
    # the raw copy sends these very bytes, written into memory of their own. A blob of zeros (bytes(n)) is
    # calloc'd pages that all map the kernel's one zero page, so copying it reads 4 KiB of cache over and over:
    # measured in the send-receive loop, its copy took 0.28 ms against 0.45 ms for the weights' bytes, which
    # made the baseline about a sixth cheaper than any real payload
    blob = b"".join(first)
    del first
    held = encode_weights(named, 1)

    def wire() -> float:
        t = time.perf_counter()
        frames = encode_weights(named, 1)
        push.send_multipart(frames, copy=False)
        got = pull.recv_multipart(copy=False)
        msg = decode(got)
        ok = msg.meta["version"] == 1 and len(msg.tensors) == len(named)
        del frames, got, msg
        dt = time.perf_counter() - t
        assert ok
        return dt

    def raw_send(copy: bool):
        def raw() -> float:
            t = time.perf_counter()
            push.send(blob, copy=copy)
            got = pull.recv(copy=False)
            n = len(got.buffer)
            del got
            dt = time.perf_counter() - t
            assert n == total
            return dt
        return raw

    def encode_only() -> float:
        t = time.perf_counter()
        frames = encode_weights(named, 1)
        del frames
        return time.perf_counter() - t

    def decode_only() -> float:
        t = time.perf_counter()
        msg = decode(held)
        del msg
        return time.perf_counter() - t

    fns = {"wire": wire, "raw_copy": raw_send(True), "raw": raw_send(False), "encode": encode_only,
           "decode": decode_only}
    return fns, total, len(sizes)


def _shared_round(named: list, push, pull, closers: list):
    """The same-host path (pipeline.weight_transport=auto): fill a shared set, send its handles, map them (once;
    cached after) and view the tensors by name; the sampler's next request releases the set. Its closers are
    appended to `closers`."""
    import threading

    from alignrl.wire.frames import decode
    from alignrl.wire.shared_weights import SharedPublisher, SharedReader

    shared_pub, reader = SharedPublisher(32 << 20, "", threading.Lock()), SharedReader()
    closers += [reader.close, shared_pub.close]

    def shared() -> float:
        t = time.perf_counter()
        shared_pub.publish(named, 1, {"incarnation": "b"})
        with shared_pub.lock:
            frames = shared_pub.shared_frames("s")
        push.send_multipart(frames, copy=False)
        tensors = reader.tensors(decode(pull.recv_multipart(copy=False)))
        ok = len(tensors) == len(named)
        del frames, tensors
        with shared_pub.lock:
            shared_pub.release("s")
        dt = time.perf_counter() - t
        assert ok
        return dt

    return shared


def print_publish(pubs: list[tuple[str, dict]], repeats: int) -> tuple[float | None, list[float]]:
    """Prints each weight set's publish timings; returns the worst frames ratio against the raw copy (None when
    one set failed) and the shared-memory ratios."""
    ratios, shared_ratios = [], []
    for label, pub in pubs:
        if "error" in pub:
            print(f"weight publish, {label}: FAILED: {pub['error']}")
            continue
        ratio = pub["wire"] / pub["raw_copy"]
        ratios.append(ratio)
        print(f"weight publish, {label} ({pub['params'] / 1e6:.2f}M params, {pub['bytes'] / 2**20:.1f} MiB in "
              f"{pub['frames']} frames, median of {repeats}): encode+send+recv+decode "
              f"{1000 * pub['wire']:.2f} ms; raw ZeroMQ copy {1000 * pub['raw_copy']:.2f} ms -> {ratio:.2f}x; "
              f"raw zero-copy send {1000 * pub['raw']:.2f} ms -> {pub['wire'] / pub['raw']:.2f}x "
              f"(encode alone {1000 * pub['encode']:.2f} ms, decode alone {1000 * pub['decode']:.2f} ms)")
        shared_ratios.append(pub["shared"] / pub["raw_copy"])
        print(f"  same host, shared memory (the default there): publish+send handles+map+view "
              f"{1000 * pub['shared']:.2f} ms -> {shared_ratios[-1]:.2f}x the raw ZeroMQ copy")
    return (max(ratios) if ratios and len(ratios) == len(pubs) else None), shared_ratios
