"""Shared weight sets (`pipeline.weight_transport`), in one process on the CPU (POSIX shared memory; the CUDA
IPC path of the same code runs in test_gpu.py): what a reader maps is what was published, a set a sampler
holds is never refilled under it, a sampler silent past the hold limit is sent the weights again, and a bad
description is one line."""

import threading

import pytest
import torch

from alignrl.wire import shared_weights as sw
from alignrl.wire.shared_weights import SharedPublisher, SharedReader, SharedUnavailable
from alignrl.wire.frames import WireError, decode

pytestmark = pytest.mark.timeout(60)


def named(v: float) -> list:
    return [("a", torch.full((3, 5), v)), ("b", torch.full((7,), v, dtype=torch.bfloat16)),
            ("empty", torch.zeros(0, 4)), ("c", torch.arange(300, dtype=torch.int64) + int(v))]


@pytest.fixture
def pub():
    p = SharedPublisher(bucket_bytes=256, token="t", lock=threading.Lock())  # small buckets: several buffers
    yield p
    p.close()


def read(pub: SharedPublisher, reader: SharedReader, sampler: str) -> dict:
    with pub.lock:
        frames = pub.shared_frames(sampler)
    return reader.tensors(decode(frames, "t"))


def test_published_weights_read_back_exactly_through_shared_memory_and_frames(pub):
    pub.publish(named(1.0), 1, {"incarnation": "i"})
    reader = SharedReader()
    got = read(pub, reader, "s")
    with pub.lock:
        wired = decode(pub.wire_frames("far"), "t").tensors  # the same buffers, as frames for another host
    for name, t in named(1.0):
        for tensors in (got, wired):
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t)
    assert len(pub.current.buffers) > 1
    reader.close()


def test_a_held_set_is_never_refilled_and_a_silent_sampler_is_sent_the_weights_again(pub, monkeypatch):
    pub.publish(named(1.0), 1, {"incarnation": "i"})
    reader = SharedReader()
    held = read(pub, reader, "s")
    pub.publish(named(2.0), 2, {"incarnation": "i"})  # "s" may still be copying version 1: another set
    pub.publish(named(3.0), 3, {"incarnation": "i"})
    assert float(held["a"][0, 0]) == 1.0 and len(pub.sets) == 3
    with pub.lock:
        pub.release("s")  # its next request: it has copied
    pub.publish(named(4.0), 4, {"incarnation": "i"})
    assert len(pub.sets) == 3 and float(held["a"][0, 0]) == 4.0 and not pub.torn  # its set, reused
    read(pub, reader, "s")
    monkeypatch.setattr(sw, "HOLD_S", 0.0)  # "s" counts as gone at once: its set may be taken
    for v in (5.0, 6.0, 7.0):
        pub.publish(named(v), int(v), {"incarnation": "i"})
    assert pub.torn == {"s"}  # should it come back, it is sent the newest weights before anything else
    assert torch.equal(read(pub, reader, "s")["c"], named(7.0)[3][1]) and not pub.torn
    reader.close()


def test_a_new_trainer_incarnation_drops_the_old_mappings(pub):
    pub.publish(named(1.0), 1, {"incarnation": "i"})
    reader = SharedReader()
    read(pub, reader, "s")
    n = len(reader._shm)
    other = SharedPublisher(bucket_bytes=256, token="t", lock=threading.Lock())
    try:
        other.publish(named(9.0), 1, {"incarnation": "j"})
        assert float(read(other, reader, "s")["a"][0, 0]) == 9.0
        assert reader.incarnation == "j" and len(reader._shm) == n
    finally:
        reader.close()
        other.close()


@pytest.mark.parametrize("buffers, error, said", [
    ([{"shm": "alignrl-no-such-segment", "size": 4096}], SharedUnavailable, "cannot map the trainer's shared memory"),
    ([{"shm": "../etc/passwd", "size": 4096}], WireError, "is not a plain segment name"),
    ([{"shm": "x", "size": "64"}], WireError, "malformed or smaller than"),
    ([{"cuda": [0, b"h"], "uuid": "GPU-x", "size": 4096}], WireError, "does not hold the handle fields"),
    ([], WireError, "puts tensors in buffer 0 of 0"),
])
def test_a_bad_buffer_description_is_one_line(buffers, error, said):
    pub = SharedPublisher(bucket_bytes=1 << 20, token="t", lock=threading.Lock())  # one buffer
    try:
        pub.publish(named(1.0), 1, {"incarnation": "i"})
        msg = decode([pub.head], "t")
    finally:
        pub.close()
    msg.meta["buffers"] = buffers
    with pytest.raises(error, match=said) as e:
        SharedReader().tensors(msg)
    assert "\n" not in str(e.value)


def test_a_sampler_that_cannot_map_the_buffers_asks_for_frames_from_then_on(capsys):
    """A container with its own /dev/shm passes the host check but cannot open the segments: the sampler
    says so in its next request (the trainer then sends it frames) and loads nothing meanwhile."""
    from alignrl.placements.zmq.sampler import Sampler
    from alignrl.wire.shared_weights import host_id

    pub = SharedPublisher(bucket_bytes=1 << 20, token="", lock=threading.Lock())
    try:
        pub.publish(named(1.0), 1, {"incarnation": "i"})
        msg = decode([pub.head])
    finally:
        pub.close()  # its segments are gone: mapping them fails as it would elsewhere
    s = object.__new__(Sampler)
    s.id, s.shared, s.version, s.incarnation = "s", SharedReader(), -1, None
    s.can_map = {"shared": True, "host": host_id(), "cuda": []}
    s.unmappable = None
    s.load(engine=None, reply=msg)
    assert s.can_map["shared"] is False and (s.version, s.incarnation) == (-1, None)
    assert "asking for the weights as frames" in capsys.readouterr().out
    # frames of the same trainer keep it on frames; a restarted trainer (another incarnation) is tried again
    from types import SimpleNamespace

    from alignrl.wire.weight_buckets import encode_weights
    from alignrl.wire.frames import manifest_of

    s.manifest, engine = manifest_of(named(2.0)), SimpleNamespace(load_weights=lambda items: list(items))
    for incarnation, shared in (("i", False), ("j", True)):
        s.load(engine, decode(encode_weights(named(2.0), 2, meta={"incarnation": incarnation})))
        assert s.can_map["shared"] is shared and (s.version, s.incarnation) == (2, incarnation)


def test_sets_that_zeromq_still_sends_from_never_stall_the_publish(pub):
    """Frames of every set held by slow sends (no sampler copying): the publish fills a new set and leaves
    those to ZeroMQ, closing each once its frames are dropped."""
    held = []
    for v in range(1, 4):
        pub.publish(named(float(v)), v, {"incarnation": "i"})
        with pub.lock:
            held.append(pub.wire_frames("far"))  # as ZeroMQ holds zero-copy frames until they are sent
    pub.publish(named(4.0), 4, {"incarnation": "i"})  # returns: no set was free
    assert len(pub.sets) == 3 and len(pub.retired) == 1
    assert decode(held[0], "t").tensors["c"][0] == 1  # what was being sent is intact
    held.clear()
    pub.publish(named(5.0), 5, {"incarnation": "i"})
    assert not pub.retired  # sent: closed


def test_shared_memory_that_cannot_be_had_is_one_line(pub, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sw.os, "posix_fallocate", full)
    with pytest.raises(SharedUnavailable, match="enlarge it .docker run --shm-size. or set "
                       "pipeline.weight_transport=zmq") as e:
        pub.publish(named(1.0), 1, {"incarnation": "i"})
    assert "No space left on device" in str(e.value) and not sw._CREATED


MAKER = ("import os, signal, sys\nfrom alignrl.wire import shm_segments\nseg = shm_segments.create(4096)\n"
         "print(seg.name, flush=True)\nsys.stdin.readline()\n"
         "os.killpg(os.getpgrp(), signal.SIGKILL) if sys.argv[1] == 'group' else os.kill(os.getpid(), signal.SIGKILL)")


def _killed_maker(how: str) -> tuple[str, str]:
    """A trainer-like process that made a segment and was then killed with `kill -9`: alone (`self`; its resource
    tracker lives on) or with its whole process group, tracker included (`group`). Its segment name and stderr."""
    import os
    import subprocess
    import sys

    from conftest import src_path

    env = {**os.environ, "PYTHONPATH": src_path()}
    with subprocess.Popen([sys.executable, "-c", MAKER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) as p:
        name = p.stdout.readline().strip()
        _, err = p.communicate("\n", timeout=30)  # to the end of stderr, which the tracker holds until it is done
    return name, err


def test_a_trainer_killed_alone_leaves_no_segment_and_no_warning():
    from alignrl.wire import shm_segments

    name, err = _killed_maker("self")
    assert name.startswith(shm_segments.PREFIX) and not (shm_segments.SHM_DIR / name).exists()
    assert "leaked" not in err and "Warning" not in err, err  # the tracker removed it, quietly


@pytest.mark.serial  # another worker's trainer would sweep the orphan before this test looks at it
def test_segments_of_a_killed_process_group_are_swept_by_the_next_trainer():
    """A kill -9 of the whole group takes the resource tracker too: the next trainer's publisher removes them, and
    leaves alone the segments of processes that still run (this one's)."""
    from alignrl.wire import shm_segments

    name, _ = _killed_maker("group")
    assert (shm_segments.SHM_DIR / name).exists() and name in shm_segments.orphans()
    mine = shm_segments.create(4096)
    try:
        assert mine.name not in shm_segments.orphans()
        p = SharedPublisher(bucket_bytes=256, token="t", lock=threading.Lock())
        p.close()
        assert not (shm_segments.SHM_DIR / name).exists() and (shm_segments.SHM_DIR / mine.name).exists()
    finally:
        mine.close()
        mine.unlink()


def test_a_name_that_is_no_pid_of_ours_is_left_alone():
    """/dev/shm is anyone's: a file named like ours with a "pid" beyond any pid (os.kill would overflow) is neither
    judged nor removed, and the sweep goes on."""
    from alignrl.wire import shm_segments

    ns = shm_segments._namespace()
    stray = shm_segments.SHM_DIR / f"{shm_segments.PREFIX}{ns}_99999999999999999999_x"
    stray.write_bytes(b"")
    try:
        assert stray.name not in shm_segments.orphans()
        shm_segments.sweep()
        assert stray.exists()
    finally:
        stray.unlink()
