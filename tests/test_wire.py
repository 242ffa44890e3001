"""alignrl.wire.frames: round trips of records and bucketed weights, and every malformed message refused with
one line (and never unpickled)."""

import pickle

import msgpack
import pytest
import torch
import zmq

from alignrl.wire import frames as wire
from alignrl.wire.weight_buckets import WeightsEncoder, _Buckets, encode_weights
from alignrl.wire.frames import PROTOCOL_VERSION, Message, WireError, check_weights, decode, encode, manifest_of

pytestmark = pytest.mark.timeout(60)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "tokens": torch.randint(0, 50_000, (3, 7), generator=g),  # int64
        "logprobs": torch.randn(3, 7, generator=g),  # float32
        "mask": torch.rand(3, 7, generator=g) > 0.5,  # bool
        "hidden": torch.randn(2, 5, generator=g).to(torch.bfloat16),
        "half": torch.randn(4, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i32": torch.arange(-3, 3, dtype=torch.int32), "i16": torch.arange(4, dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8), "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "empty": torch.zeros(0, 4), "empty_long": torch.zeros(0, dtype=torch.long),
        "scalar": torch.tensor(2.5), "scalar_bool": torch.tensor(True),
        "strided": torch.arange(12.0).view(3, 4).t(),  # not contiguous: made contiguous on the way
    }


def _assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    return msg


def _rehead(frames: list, drop_frames: int = 0, **changes) -> list:
    header = msgpack.unpackb(frames[0], raw=False)
    if "tensors" in changes and "layout" in header:  # a weights message carries its entries as one blob
        changes["layout"] = msgpack.packb(changes.pop("tensors"), use_bin_type=True)
    header.update(changes)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:len(frames) - drop_frames]]


def _entries(frames: list) -> list[dict]:
    header = msgpack.unpackb(frames[0], raw=False)
    return msgpack.unpackb(header["layout"], raw=False) if "layout" in header else header["tensors"]


def test_record_round_trip_all_dtypes():
    t = _tensors()
    meta = {"prompt_id": 17, "reward": -0.25, "ok": True, "none": None, "text": "héllo", "raw": b"\x00\xff",
            "nested": {"a": [1, 2, {"b": 3.5}]}}
    frames = encode("record", meta, t, token="s3cret")
    assert len(frames) == 1 + len(t)
    msg = decode(frames, token="s3cret")
    assert isinstance(msg, Message) and msg.kind == "record" and msg.meta == meta
    _assert_same(t, msg.tensors)
    assert msg.nbytes == sum(x.numel() * x.element_size() for x in t.values())


def test_decode_accepts_bytes_memoryviews_and_zmq_frames():
    t = _tensors()
    frames = encode("record", {}, t)
    for conv in (bytes, bytearray, memoryview, zmq.Frame, lambda f: memoryview(bytes(f))):
        _assert_same(t, decode([conv(f) for f in frames]).tensors)


def test_message_without_tensors():
    msg = decode(encode("lease", {"want": 4}))
    assert msg.kind == "lease" and msg.meta == {"want": 4} and msg.tensors == {}


def _mixed_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    named = [(f"layer{i}.w", torch.randn(10 + i, 3, generator=g)) for i in range(40)]
    named += [("embed", torch.randn(64, 64, generator=g).to(torch.bfloat16)),  # 8 KiB: larger than a bucket
              ("norm.b", torch.randn(7, generator=g).half()), ("step", torch.tensor(3)),
              ("empty", torch.zeros(0, 2)), ("flag", torch.tensor([True, False, True])),
              ("lm_head", torch.randn(16, 8, generator=g).t()),  # not contiguous
              ("column", torch.randn(6, 5, generator=g)[:, 0]), ("strided", torch.arange(10.0)[::2]),
              ("expanded", torch.ones(1).expand(5)), ("bf16_strided", torch.randn(8, generator=g).bfloat16()[::2]),
              ("flags_strided", torch.tensor([True, False, True, True])[::2])]
    return named


def test_weights_round_trip_across_buckets():
    named = _mixed_weights()
    frames = encode_weights(iter(named), version=12, bucket_bytes=4096, meta={"step": 30})
    entries = _entries(frames)
    nbuckets = len(frames) - 1
    assert nbuckets >= 4
    big = next(e for e in entries if e["name"] == "embed")
    assert sum(1 for e in entries if e["bucket"] == big["bucket"] and e["nbytes"]) == 1  # alone in its frame
    assert frames[1 + big["bucket"]].nbytes == big["nbytes"] > 4096
    assert all(len(frames[1 + b]) <= 4096 for b in range(nbuckets) if b != big["bucket"])
    assert max(sum(1 for e in entries if e["bucket"] == b) for b in range(nbuckets)) > 1  # small ones share
    for b in range(nbuckets):  # the alignment gaps between tensors go out as zeros, never as stale memory
        used = torch.zeros(len(frames[1 + b]), dtype=torch.bool)
        for e in entries:
            if e["bucket"] == b:
                used[e["offset"]:e["offset"] + e["nbytes"]] = True
        assert not torch.frombuffer(frames[1 + b], dtype=torch.uint8)[~used].any()
    msg = decode(frames)
    assert msg.kind == "weights" and msg.meta["version"] == 12 and msg.meta["step"] == 30
    assert msg.meta["nbytes"] == sum(x.numel() * x.element_size() for _, x in named)
    _assert_same(dict(named), msg.tensors)
    check_weights(msg, manifest_of(named))


def test_the_accelerator_staging_path_fills_the_same_bytes():
    # Tensors on a GPU are gathered there bucket by bucket and each bucket goes to the host in one copy. The
    # same code runs here with the CPU as the "device" (tests/test_gpu.py runs it on CUDA), against the
    # foreach copy that CPU tensors take, into a fresh set of buffers
    named = _mixed_weights()
    enc = WeightsEncoder(bucket_bytes=4096)
    direct = [bytes(f) for f in enc(named, 1)[1:]]
    plan = enc._plan
    staged = _Buckets(plan)
    plan.stage([named[slot[0]][1] for slot in plan.slots], staged, torch.device("cpu"))
    assert [bytes(a) for a in staged.arrays] == direct and len(direct) >= 4


def test_weights_of_empty_tensors_alone_round_trip():
    named = [("a", torch.zeros(0, 3)), ("b", torch.zeros(2, 0, dtype=torch.bfloat16))]
    frames = WeightsEncoder()(named, 4)
    assert len(frames) == 1  # the header alone: no bucket frame
    _assert_same(dict(named), decode(frames).tensors)


def test_weights_are_a_snapshot():
    w = torch.nn.Parameter(torch.ones(100))  # a parameter that requires grad, as a trainer publishes it
    frames = encode_weights([("w", w)], version=1)
    with torch.no_grad():
        w.add_(1)  # an optimizer step after publishing must not change what is on the wire
    assert torch.equal(decode(frames).tensors["w"], torch.ones(100))


def test_check_weights_refuses_mismatch():
    named = [("a", torch.zeros(2)), ("b", torch.zeros(3))]
    msg = decode(encode_weights(named[:1], version=0))
    with pytest.raises(WireError, match="lacks 1 of"):
        check_weights(msg, manifest_of(named))
    bad = decode(encode_weights([("a", torch.tensor([1.0, float("nan")])), ("b", torch.zeros(3))], version=0))
    with pytest.raises(WireError, match="NaN"):
        check_weights(bad, manifest_of(named))


def test_protocol_version_mismatch():
    with pytest.raises(WireError) as e:
        decode(_rehead(encode("record", {}), proto=PROTOCOL_VERSION + 1))
    assert _one_line(e) == (f"peer speaks alignrl wire protocol {PROTOCOL_VERSION + 1}, this process speaks "
                            f"{PROTOCOL_VERSION}: run the same alignrl version on both sides")
    for proto in (None, "1", True):
        with pytest.raises(WireError, match="no protocol version"):
            decode(_rehead(encode("record", {}), proto=proto))


def test_token():
    frames = encode("record", {"x": 1}, {"t": torch.ones(2)}, token="right")
    assert decode(frames, token="right").meta == {"x": 1}
    assert decode(frames).meta == {"x": 1}  # a process without a token does not check it
    for bad in (encode("record", {}, token="wrong"), encode("record", {}), _rehead(frames, token=5),
                _rehead(frames, token="righ"), _rehead(frames, token="right\x00")):
        with pytest.raises(WireError) as e:
            decode(bad, token="right")
        assert "did not present the shared token (ALIGNRL_ZMQ_TOKEN)" in _one_line(e)
        assert "right" not in str(e.value)  # the secret never appears in an error


@pytest.mark.parametrize("frames, words", [
    ([], "empty message"),
    ([b"\xc1"], "not msgpack"),
    ([b""], "not msgpack"),
    ([msgpack.packb({"proto": 1}) + b"x"], "not msgpack"),
    ([msgpack.packb([1, 2, 3])], "not a map"),
    ([msgpack.packb("hello")], "not a map"),
    ([msgpack.packb({1: 2})], "not msgpack"),  # non-string map keys
    ([msgpack.packb({"proto": 1, "meta": msgpack.ExtType(5, b"x")})], "extension type 5"),
    ([b'{"proto": 1}'], "not msgpack"),
    ([12345], "not a bytes-like frame"),
])
def test_garbage_headers(frames, words):
    with pytest.raises(WireError) as e:
        decode(frames)
    assert words in _one_line(e)


def test_malformed_records():
    frames = encode("record", {"a": 1}, {"x": torch.arange(6, dtype=torch.float32).view(2, 3), "y": torch.ones(2)})
    ex, ey = _entries(frames)
    cases = [
        (frames[:2], "has 2 frames but its header announces 1 + 2"),
        ([*frames, b"extra"], "has 4 frames"),
        ([frames[0], bytes(frames[1])[:-4], frames[2]], "frame 1 holds 20 bytes"),
        ([frames[0], bytes(frames[1]) + b"\0" * 4, frames[2]], "frame 1 holds 28 bytes"),
        (_rehead(frames, tensors=[{**ex, "dtype": "complex64"}, ey]), "unknown dtype 'complex64'"),
        (_rehead(frames, tensors=[{**ex, "dtype": ["float32"]}, ey]), "unknown dtype"),
        (_rehead(frames, tensors=[{**ex, "shape": [-2, -3]}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": [2.0, 3]}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": [True, 6]}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": "2x3"}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": [1] * 9}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": [2**40, 2**40], "nbytes": 4}, ey]), "bad shape"),
        (_rehead(frames, tensors=[{**ex, "shape": [3, 3]}, ey]), "does not match float32 of shape [3, 3]"),
        (_rehead(frames, tensors=[{**ex, "nbytes": True}, ey]), "does not match"),
        (_rehead(frames, tensors=[ex, {**ey, "name": "x"}]), "'x' appears twice"),
        (_rehead(frames, tensors=[{**ex, "name": ""}, ey]), "no valid name"),
        (_rehead(frames, tensors=[ex, "y"]), "entry 1 of the header is not a map"),
        (_rehead(frames, tensors={"x": ex}), "is not a list"),
        (_rehead(frames, meta=[1]), "meta of a 'record' message is not a map"),
        (_rehead(frames, kind=None), "kind None"),
        (_rehead(frames, kind="k" * 65), "kind"),
    ]
    for bad, words in cases:
        with pytest.raises(WireError) as e:
            decode(bad)
        assert words in _one_line(e), (words, str(e.value))
    assert decode(frames).meta == {"a": 1}  # the untouched message is fine


def test_malformed_weights():
    frames = encode_weights([("a", torch.ones(3)), ("b", torch.ones(5)), ("c", torch.ones(2000))], version=4,
                            bucket_bytes=256)
    ea, eb, ec = _entries(frames)
    assert len(frames) == 3 and ea["bucket"] == eb["bucket"] == 0 and eb["offset"] == 64
    cases = [
        (frames[:2], "has 2 frames but its header announces 1 + 2"),
        (_rehead(frames, buckets=10**12), "announces 1 + 1000000000000"),
        (_rehead(frames, buckets=-1), "announces"),
        ([frames[0], bytes(frames[1])[:-4], frames[2]], "out of bounds"),
        ([frames[0], bytes(frames[1]) + b"\0" * 64, frames[2]], "bucket frame 0 holds 148 bytes"),
        (_rehead(frames, tensors=[ea, {**eb, "offset": 8}, ec]), "misaligned"),
        (_rehead(frames, tensors=[ea, {**eb, "offset": 0}, ec]), "out of order"),  # overlaps a
        (_rehead(frames, tensors=[eb, ea, ec]), "out of order"),
        (_rehead(frames, tensors=[ea, eb, {**ec, "bucket": 2}]), "out of bounds"),
        (_rehead(frames, tensors=[ea, eb, {**ec, "bucket": 0, "offset": 128}]), "out of bounds"),
        (_rehead(frames, tensors=[ea, eb, {**ec, "bucket": "1"}]), "needs non-negative int 'bucket'"),
        (_rehead(frames, tensors=[ea, eb, {**ec, "bucket": 2**40}]), "out of bounds"),
        (_rehead(frames, layout=[ea, eb, ec]), "not a msgpack blob"),
        (_rehead(frames, layout=b"\xc1"), "weights layout is not msgpack"),
        (_rehead(frames, layout=msgpack.packb({"a": ea})), "not a list"),
        (_rehead(frames, tensors=[ea, {k: v for k, v in eb.items() if k != "offset"}, ec]), "'offset'"),
        (_rehead(frames, tensors=[ea, ec], buckets=2), "bucket frame 0 holds"),  # b's bytes unaccounted for
        (_rehead(frames, meta={"version": -1}), "version -1"),
        (_rehead(frames, meta={}), "version None"),
    ]
    for bad, words in cases:
        with pytest.raises(WireError) as e:
            decode(bad)
        assert words in _one_line(e), (words, str(e.value))


def test_absurd_sizes(monkeypatch):
    frames = encode("record", {"pad": "x" * 2000})
    monkeypatch.setattr(wire, "MAX_HEADER", 1000)
    with pytest.raises(WireError) as e:
        decode(frames)
    assert "more than the 1000-byte limit" in _one_line(e)
    monkeypatch.setattr(wire, "MAX_FRAMES", 3)
    with pytest.raises(WireError, match="more than the limit of 4"):
        decode([b""] * 5)
    monkeypatch.setattr(wire, "MAX_HEADER", 64 << 20)
    monkeypatch.setattr(wire, "MAX_TENSORS", 2)
    with pytest.raises(WireError, match="at most 2 entries"):
        decode(encode("record", {}, {"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)}))


def test_encode_refuses_what_it_cannot_carry():
    for meta, words in (({"t": torch.ones(2)}, "not plain msgpack"), ({"o": object()}, "not plain msgpack"),
                        ({"big": 2**70}, "not plain msgpack"), ([1], "must be a dict")):
        with pytest.raises(WireError) as e:
            encode("record", meta)
        assert words in _one_line(e)
    with pytest.raises(WireError, match="complex64"):
        encode("record", {}, {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WireError, match="appears twice"):
        encode_weights([("a", torch.ones(1)), ("a", torch.ones(1))], version=0)
    with pytest.raises(WireError, match="not a torch.Tensor"):
        encode("record", {}, {"a": [1, 2]})
    with pytest.raises(WireError, match="version"):
        encode_weights([], version=-1)
    with pytest.raises(WireError, match="kind"):
        encode("", {})


def _boom(*_a, **_k):
    raise AssertionError("something was unpickled")


class _Evil:
    def __reduce__(self):
        return (_boom, ())


def test_pickle_payloads_are_never_unpickled(monkeypatch):
    for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, _boom)
    payload = pickle.dumps(_Evil())
    with pytest.raises(WireError, match="not msgpack"):
        decode([payload])
    with pytest.raises(WireError, match="not msgpack"):
        decode([payload, payload])
    # A pickle where tensor bytes belong is only ever bytes.
    head = msgpack.packb({"proto": PROTOCOL_VERSION, "kind": "record", "token": "", "meta": {},
                          "tensors": [{"name": "p", "dtype": "uint8", "shape": [len(payload)],
                                       "nbytes": len(payload)}]})
    msg = decode([head, payload])
    assert bytes(msg.tensors["p"].numpy()) == payload
    with pytest.raises(WireError, match="dtype"):  # "object"/"pickle" dtypes do not exist
        decode([_rehead([head, payload], tensors=[{"name": "p", "dtype": "object", "shape": [1], "nbytes": 1}])[0],
                b"x"])


def test_weights_frames_at_odd_addresses_are_realigned():
    # libzmq may hand a frame over at any address; the typed views must not be misaligned
    named = [("a", torch.randn(5, 3)), ("b", torch.randn(4).double()), ("c", torch.arange(6, dtype=torch.int32))]
    frames = encode_weights(named, version=2)
    odd = [frames[0]] + [memoryview(bytearray(b"\0") + bytes(f))[1:] for f in frames[1:]]
    msg = decode(odd)
    _assert_same(dict(named), msg.tensors)
    assert all(t.data_ptr() % t.element_size() == 0 for t in msg.tensors.values())


def test_an_encoder_plans_once_and_replans_when_the_tensors_change(monkeypatch):
    enc = WeightsEncoder(bucket_bytes=256)
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(70)), ("h", torch.randn(5).half())]
    first = enc(named, 1)
    plan = enc._plan
    wire._layout.cache_clear()
    for v in range(2, 5):  # new values, same names/dtypes/shapes: the plan, the layout and its check are reused
        named = [(n, t + v) for n, t in named]
        frames = enc(named, v, meta={"step": v})
        assert enc._plan is plan and _entries(frames) == _entries(first)
        msg = decode(frames)
        assert msg.meta == {"step": v, "version": v, "nbytes": 12 * 4 + 70 * 4 + 5 * 2}
        _assert_same(dict(named), msg.tensors)
    assert wire._layout.cache_info().misses == 1 and wire._layout.cache_info().hits == 2
    for changed in ([("a", torch.randn(4, 3)), *named[1:]], [("a", named[0][1].double()), *named[1:]],
                    [("z", named[0][1]), *named[1:]], named[:2]):  # shape, dtype, name, count
        frames = enc(changed, 9)
        assert enc._plan is not plan
        plan = enc._plan
        _assert_same(dict(changed), decode(frames).tensors)


def test_an_encoder_reuses_bucket_buffers_only_once_nothing_holds_them():
    enc = WeightsEncoder(bucket_bytes=256)
    w = torch.nn.Parameter(torch.zeros(100))  # 400 bytes: two buckets

    def step(version):
        with torch.no_grad():
            w.fill_(version)
        frames = enc([("w", w)], version)
        return frames, [memoryview(f).obj.ctypes.data for f in frames[1:]]

    v1, first = step(1)
    v2, second = step(2)  # v1 still held (as the board holds the newest weights): new buffers
    assert set(second).isdisjoint(first)
    del v1
    v3, third = step(3)  # v1's set is free: filled in place, no new memory
    assert third == first
    held = decode(v3).tensors["w"]  # a tensor over v3's frames holds them
    del v3
    v4, fourth = step(4)  # both sets held (v2's frames, the tensor over v3's): new buffers
    assert set(fourth).isdisjoint(first + second)
    assert torch.equal(held, torch.full((100,), 3.0)) and torch.equal(decode(v2).tensors["w"], torch.full((100,), 2.0))
    assert torch.equal(decode(v4).tensors["w"], torch.full((100,), 4.0))
