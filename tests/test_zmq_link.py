"""alignrl.wire.zmq_link over real sockets on 127.0.0.1: push/pull, bounded queues and waits, the sync
request/reply path across a trainer restart, and malformed input that leaves sockets usable."""

import socket
import threading
import time

import pytest
import torch
import zmq

from alignrl.wire import zmq_link
from alignrl.wire.weight_buckets import encode_weights
from alignrl.wire.frames import WireError, decode, encode
from alignrl.errors import UserError
from alignrl.runtime.ports import free_port
from alignrl.wire.zmq_link import (InsecureBind, PeerTimeout, PortInUse, Puller, Pusher, Replier, Requester, address,
                                   check_bind)

pytestmark = pytest.mark.timeout(60)  # a timeout waits at least its length (lower bounds), and far less than 30 s
HOST = "127.0.0.1"


@pytest.fixture
def dead_port():
    """A port nobody listens on: bound without listen(), so no other test or process can take it meanwhile
    and every connection to it is refused."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    yield s.getsockname()[1]
    s.close()


def _raw(kind: int, addr: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def _recv(sock, timeout_s: float = 5.0):
    got = sock.recv(timeout_s)
    assert got is not None, "nothing arrived in time"
    return got


class Server:
    """A Replier served from a thread until stop(); handler(peer, msg) -> reply or None (no reply)."""

    def __init__(self, rep: Replier, handler):
        self.rep, self.handler, self.errors = rep, handler, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                try:
                    got = self.rep.recv(0.05)
                except WireError as e:
                    self.errors.append(e)
                    continue
                if got is not None:
                    self.handler(self.rep, *got)
        finally:
            self.rep.close()

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


def _echo(rep, peer, msg):
    rep.reply_msg(peer, "echo", {"got": msg.kind, **msg.meta}, {k: v.clone() * 2 for k, v in msg.tensors.items()})


def _bind_replier(port: int, deadline_s: float = 5.0) -> Replier:
    # libzmq closes a listener in its IO thread after close() returns: a restart in the same process may need a
    # moment before the port is free (a new trainer process does not).
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return Replier(HOST, port)
        except PortInUse:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_address_and_check_bind():
    assert address("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert address("::1", 5556) == "tcp://[::1]:5556"
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_bind(host, "")
    for host in ("0.0.0.0", "*", "10.1.2.3", "eth0", "trainer.example"):
        check_bind(host, "tok")
        with pytest.raises(InsecureBind) as e:
            check_bind(host, "")
        assert "set ALIGNRL_ZMQ_TOKEN" in str(e.value) and "bind 127.0.0.1" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(InsecureBind):
        Puller("0.0.0.0", 0)  # refused before anything is bound


def test_push_pull_between_threads():
    t = {"ids": torch.arange(6).view(2, 3), "lp": torch.randn(2, 3).to(torch.bfloat16), "m": torch.tensor(True)}
    with Puller(HOST, 0, token="tok") as pull:
        def sampler():
            with Pusher(pull.addr, token="tok") as push:
                for i in range(20):
                    push.send("record", {"i": i}, t, timeout_s=5.0)

        th = threading.Thread(target=sampler)
        th.start()
        got = [_recv(pull) for _ in range(20)]
        th.join(10)
        assert pull.recv(0.05) is None
        with Pusher(pull.addr, token="tok") as push:  # undecoded frames, for callers that forward them first
            push.send("record", {"i": 20}, t, timeout_s=5.0)
            raw = pull.recv_frames(5.0)
            assert raw is not None and len(raw) == 1 + len(t)
            got.append(decode([bytes(memoryview(f)) for f in raw], token="tok"))
    assert [m.meta["i"] for m in got] == list(range(21))
    for m in got:
        assert m.kind == "record" and all(torch.equal(m.tensors[k], t[k]) for k in t)


def test_send_times_out_without_a_puller(dead_port):
    addr = address(HOST, dead_port)
    with Pusher(addr) as push:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout) as e:
            push.send("record", {"i": 0}, timeout_s=0.5)
        assert 0.45 <= time.monotonic() - t0 < 30  # gave up after its 0.5 s, not never
    assert addr in str(e.value) and "\n" not in str(e.value)


def test_hwm_bounds_queued_messages():
    big = {"x": torch.zeros(1 << 20, dtype=torch.uint8)}  # 1 MiB each, so kernel buffers hold only a few
    with Puller(HOST, 0, hwm=1) as pull, Pusher(pull.addr, hwm=1) as push:
        sent = 0
        with pytest.raises(PeerTimeout):
            while sent < 200:  # nobody reads: the queue must fill up long before this
                # the first two always fit (hwm 1 + 1): time enough for a loaded machine's I/O thread to take them
                push.send("record", {"i": sent}, big, timeout_s=5.0 if sent < 2 else 0.3)
                sent += 1
        assert 2 <= sent < 48, sent  # hwm 1 + 1, plus what the kernel's TCP buffers hold (~11 here)
        got = [_recv(pull).meta["i"] for _ in range(sent)]  # every queued message is delivered, in order
        assert got == list(range(sent))
        assert pull.recv(0.05) is None
        push.send("record", {"i": "again"}, timeout_s=5.0)  # room again once the trainer reads
        assert _recv(pull).meta == {"i": "again"}


def test_port_in_use_is_one_line():
    with Puller(HOST, 0) as pull:
        with pytest.raises(PortInUse) as e:
            Puller(HOST, pull.port)
        assert str(e.value) == (f"port {pull.port} on 127.0.0.1 is in use (another training_worker?): "
                                "stop it or pass --data-port N")
        assert isinstance(e.value, UserError)  # said as one line by every command
        with pytest.raises(PortInUse, match="--sync-port N"):
            Replier(HOST, pull.port)


def test_malformed_push_leaves_puller_usable(monkeypatch):
    with Puller(HOST, 0) as pull:
        raw = _raw(zmq.PUSH, pull.addr)
        try:
            good = encode("record", {"ok": 1}, {"x": torch.ones(3)})
            raw.send_multipart([b"\xc1garbage", b"more", b"frames"])
            raw.send_multipart([good[0]])  # header announces a tensor frame that is missing
            raw.send_multipart(good)
            with pytest.raises(WireError, match="not msgpack"):
                _recv(pull)
            with pytest.raises(WireError, match="announces 1 \\+ 1"):
                _recv(pull)
            msg = _recv(pull)
            assert msg.meta == {"ok": 1} and torch.equal(msg.tensors["x"], torch.ones(3))
            monkeypatch.setattr(zmq_link, "MAX_FRAMES", 2)  # a message with too many parts is drained, then refused
            raw.send_multipart([b""] * 12)
            raw.send_multipart(good)
            with pytest.raises(WireError, match="12 frames"):
                _recv(pull)
            assert _recv(pull).meta == {"ok": 1}
        finally:
            raw.close(linger=0)


def test_token_mismatch_on_puller():
    with Puller(HOST, 0, token="right") as pull, Pusher(pull.addr, token="wrong") as push:
        push.send("record", {}, timeout_s=5.0)
        with pytest.raises(WireError, match="shared token"):
            _recv(pull)


def test_request_reply_round_trip():
    w = [("a", torch.randn(100)), ("b", torch.randn(3, 3).to(torch.bfloat16))]
    published = encode_weights(w, version=7, bucket_bytes=256)  # encoded once, replied to every sampler

    def handler(rep, peer, msg):
        if msg.kind == "get_weights":
            assert rep.reply(peer, published)
        else:
            _echo(rep, peer, msg)

    server = Server(Replier(HOST, 0), handler)
    try:
        addr = server.rep.addr
        with Requester(addr) as r1, Requester(addr) as r2:
            for i in range(5):
                ans = r1.request("lease", {"i": i}, {"t": torch.full((2,), float(i))}, timeout_s=5.0)
                assert ans.kind == "echo" and ans.meta == {"got": "lease", "i": i}
                assert torch.equal(ans.tensors["t"], torch.full((2,), 2.0 * i))
            for r in (r1, r2, r1):
                ws = r.request("get_weights", {}, timeout_s=5.0)
                assert ws.kind == "weights" and ws.meta["version"] == 7
                assert all(torch.equal(ws.tensors[n], t) for n, t in w)
    finally:
        server.stop()
    assert not server.errors


def test_stale_and_duplicate_replies_are_never_taken():
    release, sent_twice = threading.Event(), []

    sent = threading.Condition()

    def handler(rep, peer, msg):
        if msg.meta["i"] == 0:
            release.wait(10)  # answer only after the requester gave up on this request
            rep.reply_msg(peer, "echo", {"i": 0})  # to the old socket: dropped (False) or discarded, never read
            return
        rep.reply_msg(peer, "echo", {"i": msg.meta["i"]})
        # a second answer to the same request goes out (tagged 0, as nothing is pending) and is dropped there
        with sent:
            sent_twice.append(rep.reply_msg(peer, "echo", {"i": "duplicate"}))
            sent.notify_all()

    server = Server(Replier(HOST, 0), handler)
    try:
        with Requester(server.rep.addr) as req:
            with pytest.raises(PeerTimeout):
                req.request("q", {"i": 0}, timeout_s=0.3)
            release.set()
            for i in range(1, 4):
                assert req.request("q", {"i": i}, timeout_s=5.0).meta == {"i": i}
            # the requester stays open until the last duplicate went out: closed before, the send finds no peer
            with sent:
                assert sent.wait_for(lambda: len(sent_twice) == 3, timeout=30)
    finally:
        server.stop()
    assert sent_twice == [True] * 3


def test_requester_survives_trainer_restart():
    port = free_port()  # from the run's pool: no other test process takes it while it is rebound below
    server = Server(Replier(HOST, port), _echo)
    try:
        with Requester(address(HOST, port)) as req:
            assert req.request("hello", {"n": 1}, timeout_s=5.0).meta == {"got": "hello", "n": 1}
            server.stop()  # the trainer goes away
            t0 = time.monotonic()
            with pytest.raises(PeerTimeout) as e:
                req.request("hello", {"n": 2}, timeout_s=0.5)
            assert 0.45 <= time.monotonic() - t0 < 30  # gave up after its 0.5 s, not never
            assert f"tcp://127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)
            server = Server(_bind_replier(port), _echo)  # a new trainer on the same port
            assert req.request("hello", {"n": 3}, timeout_s=5.0).meta == {"got": "hello", "n": 3}
    finally:
        server.stop()


def test_malformed_request_reports_peer_and_can_be_answered():
    with Replier(HOST, 0, token="right") as rep:
        raw = _raw(zmq.DEALER, rep.addr)
        try:
            raw.send_multipart([b"no-envelope"])
            with pytest.raises(WireError, match="request-id envelope") as e:
                _recv(rep)
            assert isinstance(e.value.peer, bytes) and e.value.peer
        finally:
            raw.close(linger=0)

        seen = []

        def server_side():
            try:
                _recv(rep)
            except WireError as e:
                seen.append(str(e))
                rep.reply_msg(e.peer, "error", {"why": str(e)})

        with Requester(rep.addr, token="wrong") as req:
            th = threading.Thread(target=server_side)
            th.start()
            # the trainer's answer carries its own token, which this sampler does not accept either
            with pytest.raises(WireError, match="shared token"):
                req.request("lease", {}, timeout_s=5.0)
            th.join(10)
        assert len(seen) == 1 and "shared token" in seen[0]
        assert not rep.reply(b"\x00nobody", encode("x", {}))  # a vanished peer: dropped, no exception


def test_wake_ends_a_blocked_recv_and_a_parked_request_is_answered_later():
    rep = Replier(HOST, 0)
    try:
        rep.wake()  # queued before anyone waits: the next recv returns at once
        t0 = time.monotonic()
        assert rep.recv(60.0) is None and time.monotonic() - t0 < 30
        got, parked, answered, woke = [], threading.Event(), threading.Event(), []

        def serve():  # parks the request: answers it only after a wake-up from another thread
            got.append(_recv(rep, 60.0))
            parked.set()
            assert rep.recv(60.0) is None  # returned by wake(), long before its timeout
            got.append(time.monotonic())
            rep.reply_msg(got[0][0], "lease", {"n": 1})
            answered.set()

        def wake_once_parked():  # a wake-up before the request arrived would end the wait for it instead
            assert parked.wait(60)
            time.sleep(0.3)
            woke.append(time.monotonic())
            rep.wake()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with Requester(rep.addr) as req:
            threading.Thread(target=wake_once_parked, daemon=True).start()
            ans = req.request("work", {}, timeout_s=60.0)
            assert ans.kind == "lease" and ans.meta == {"n": 1}
            # the reply can arrive before the serving thread marks it sent: wait for the mark
            assert answered.wait(60) and 0 <= got[1] - woke[0] < 30
        thread.join(5)
    finally:
        rep.close()
    rep.wake()  # after close: a no-op, not an error
