"""ZeroMQ sockets between sampler and trainer processes, with bounded memory and bounded waiting.

    sampler Pusher (PUSH, connect) ---- records ----> trainer Puller (PULL, bind, data port 5555)
    sampler Requester (DEALER, connect) <-- ask/answer --> trainer Replier (ROUTER, bind, sync port 5556)

Every wait takes a timeout and ends in None (a receive) or PeerTimeout (a send or a request); queues are
bounded by high-water marks (counted in messages; the kernel's TCP buffers add a few MiB on top) and by
a per-frame size limit on the bound side; a malformed message is consumed whole before WireError is
raised, so the socket stays usable. Sockets are bound on loopback unless a shared token is set
(ALIGNRL_ZMQ_TOKEN); every message carries it and the receiver checks it.

Requests travel as [request id, message frames...]: the Replier echoes the id and the Requester drops
any reply whose id is not the one it waits for. After a timeout the Requester also replaces its DEALER
socket, so a late answer to an old request can never be read as the answer to a new one, and a
restarted trainer on the same address is picked up by the fresh connection.

Deliberately left out: delivery guarantees (records are at-most-once: a record queued to a trainer that
dies is lost, like a rollout on a crashed sampler), retries (the caller decides), encryption (CURVE),
service discovery, and thread safety: use each object from one thread only.
"""

from __future__ import annotations

import errno
import math
import os
import struct
import threading
import time
from collections.abc import Mapping

import torch
import zmq

from alignrl.runtime.ports import is_loopback
from alignrl.wire.frames import MAX_FRAMES, TOKEN_ENV, Message, WireError, decode, encode
from alignrl.errors import UserError

__all__ = ["TOKEN_ENV", "DEFAULT_DATA_PORT", "DEFAULT_SYNC_PORT", "PeerTimeout", "PortInUse", "InsecureBind",
           "address", "check_bind", "token_from_env", "Pusher", "Puller", "Replier", "Requester"]

DEFAULT_DATA_PORT = 5555
DEFAULT_SYNC_PORT = 5556
MAX_FRAME_BYTES = 1 << 30  # bound side: libzmq disconnects a peer that sends a bigger frame
MAX_PENDING = 4096  # Replier: request ids remembered for peers not yet answered
_RID = struct.Struct("<Q")
_NO_RID = _RID.pack(0)  # request ids start at 1: a reply tagged 0 is never taken


class PeerTimeout(RuntimeError):
    """The peer did not take or answer a message in time; the message names the address and what to check."""


class PortInUse(UserError):
    """A port another program holds: which one, and the flag that moves it."""


class InsecureBind(UserError):
    """Binding a non-loopback address without a shared token."""


def token_from_env() -> str:
    return os.environ.get(TOKEN_ENV, "")


def address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_bind(host: str, token: str) -> None:
    """Anyone who can reach a bound port can feed the trainer records, so beyond loopback a token is required."""
    if not is_loopback(host) and not token:
        raise InsecureBind(f"refusing to bind {host} without a shared token: set {TOKEN_ENV} on every sampler "
                           "and trainer process, or bind 127.0.0.1")


def _socket(kind: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)  # one context (and IO thread) per process
    s.setsockopt(zmq.LINGER, 0)  # closing never waits for a peer that is gone
    return s


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def _ipv6(sock: zmq.Socket, where: str) -> None:
    # only for IPv6 literals: with IPV6 on, "localhost" may resolve to ::1 while the peer bound 127.0.0.1
    if ":" in where.removeprefix("tcp://").rsplit(":", 1)[0]:
        sock.setsockopt(zmq.IPV6, 1)


def _bind(sock: zmq.Socket, host: str, port: int, flag: str) -> int:
    _ipv6(sock, host)
    try:
        sock.bind(address(host, port if port else "*"))  # "*": an ephemeral port, read back below
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is in use (another training_worker?): "
                            f"stop it or pass {flag} N") from None
        raise OSError(e.errno, f"cannot bind {address(host, port)}: {e.strerror}") from None
    return int(sock.getsockopt(zmq.LAST_ENDPOINT).rsplit(b":", 1)[1])


def _recv_frames(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """All parts of one message (None if none is waiting); parts beyond MAX_FRAMES are read and dropped
    so the socket is left at a message boundary, then the message is refused."""
    try:
        frames = [sock.recv(zmq.NOBLOCK, copy=False)]
    except zmq.Again:
        return None
    dropped = 0
    while sock.getsockopt(zmq.RCVMORE):  # the other parts are already here: multipart is atomic
        part = sock.recv(copy=False)
        if len(frames) < MAX_FRAMES + 3:  # identity + request id + header + data frames
            frames.append(part)
        else:
            dropped += 1
    if dropped:
        raise WireError(f"message has {len(frames) + dropped} frames, more than the limit of {MAX_FRAMES + 1}")
    return frames


def _send(sock: zmq.Socket, frames: list, deadline: float, copy: bool) -> bool:
    """Queues one multipart message before the deadline; False if the socket stayed full or unconnected."""
    while True:
        left = deadline - time.monotonic()
        if sock.poll(_ms(left), zmq.POLLOUT):
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                return True
            except zmq.Again:  # another message took the slot between poll and send
                pass
        if left <= 0:
            return False


def _heartbeat(sock: zmq.Socket) -> None:
    # ZMTP heartbeats drop a connection whose peer vanished without closing TCP (a crashed host), so its
    # queued messages stop counting as delivered and IMMEDIATE makes sends time out instead.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)


class _Socket:
    """Closes its ZeroMQ socket on close() and at the end of a `with` block."""

    _sock: zmq.Socket | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Pusher(_Socket):
    """Sends messages to a Puller. Nothing queues for a peer that is not connected (IMMEDIATE) and at most
    `hwm` messages queue for one that is, so a dead or slow trainer makes send() time out."""

    def __init__(self, addr: str, *, hwm: int = 4, token: str = ""):
        self.addr, self._token = addr, token
        self._sock = _socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        _heartbeat(self._sock)
        _ipv6(self._sock, addr)
        self._sock.connect(addr)

    def send(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None,
             timeout_s: float = 30.0) -> None:
        frames = encode(kind, meta, tensors, self._token)
        # copy=True: the caller may reuse its tensors as soon as send() returns (records are small)
        if not _send(self._sock, frames, time.monotonic() + timeout_s, copy=True):
            raise PeerTimeout(f"could not queue a {kind!r} message to {self.addr} within {timeout_s:g} s: is the "
                              "trainer running and reading (check the host, --data-port and that it keeps up)?")



class Puller(_Socket):
    """Receives messages from any number of Pushers; at most `hwm` messages wait in this process."""

    def __init__(self, host: str, port: int, *, hwm: int = 4, token: str = "", port_flag: str = "--data-port",
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        check_bind(host, token)
        self._token = token
        self._sock = _socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.port = _bind(self._sock, host, port, port_flag)
        self.addr = address(host, self.port)

    def recv(self, timeout_s: float) -> Message | None:
        """The next message, or None if none arrives within timeout_s. A malformed message raises
        WireError once it has been read whole: call recv() again for the next one."""
        frames = self.recv_frames(timeout_s)
        return None if frames is None else decode(frames, self._token)

    def recv_frames(self, timeout_s: float) -> list[zmq.Frame] | None:
        """The frames of the next message, undecoded (pass them to wire.decode with the token), or None
        on timeout; WireError only for a message of absurdly many frames, which is dropped whole."""
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            return None
        return _recv_frames(self._sock)



class Replier(_Socket):
    """Answers Requesters (trainer side). recv() gives (peer, message); answer with reply()/reply_msg()
    for that peer. A reply to a peer that is gone, or whose queue is full, is dropped and reply()
    returns False: the Requester times out and asks again, so the trainer never blocks on a sampler.
    A request may be answered later (long polling): wake(), the one method any thread may call, makes a
    recv() waiting in the Replier's own thread return None at once, so it can answer what became possible."""

    def __init__(self, host: str, port: int, *, token: str = "", hwm: int = 16, port_flag: str = "--sync-port",
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        check_bind(host, token)
        self._token = token
        self._pending: dict[bytes, bytes] = {}  # peer -> id of its request awaiting a reply
        self._sock = _socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: EHOSTUNREACH instead of a silent drop
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.port = _bind(self._sock, host, port, port_flag)
        self.addr = address(host, self.port)
        wake_addr = f"inproc://alignrl-wake-{id(self)}"
        self._wake_rx, self._wake_tx = _socket(zmq.PULL), _socket(zmq.PUSH)
        self._wake_rx.bind(wake_addr)
        self._wake_tx.connect(wake_addr)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)  # one queued wake-up is enough
        self._wake_lock = threading.Lock()  # ZeroMQ sockets are not thread-safe: one waker at a time
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_rx, zmq.POLLIN)

    def wake(self) -> None:
        """Makes a recv() blocked in another thread return None now (or the next one, if none is waiting)."""
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:  # a wake-up is already queued
                pass

    def close(self) -> None:
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        self._wake_rx.close(linger=0)
        super().close()

    def recv(self, timeout_s: float) -> tuple[bytes, Message] | None:
        """(peer identity, request) or None on timeout or wake(). A malformed request raises WireError with
        `.peer` set (None if even the envelope was unreadable); reply_msg(e.peer, ...) can still answer it."""
        ready = dict(self._poller.poll(_ms(timeout_s)))
        if self._wake_rx in ready:
            while self._wake_rx.poll(0, zmq.POLLIN):
                self._wake_rx.recv()
            return None
        if self._sock not in ready:
            return None
        try:
            frames = _recv_frames(self._sock)
        except WireError as e:
            e.peer = None
            raise
        if frames is None:
            return None
        peer = frames[0].bytes
        if len(frames) < 3 or len(frames[1]) != _RID.size:
            e = WireError("request lacks the request-id envelope: send it with zmq_link.Requester")
            e.peer = peer
            raise e
        if len(self._pending) >= MAX_PENDING and peer not in self._pending:
            self._pending.pop(next(iter(self._pending)))  # forget the oldest unanswered peer
        self._pending[peer] = frames[1].bytes
        try:
            return peer, decode(frames[2:], self._token)
        except WireError as e:
            e.peer = peer
            raise

    def reply(self, peer: bytes, frames: list) -> bool:
        """Sends frames from encode()/WeightsEncoder (built with this Replier's token) to `peer`, without
        copying frames of 64 KiB or more: frames of WeightsEncoder are a snapshot and may be sent to many
        peers; tensors given to encode() must not change in place afterwards (or use reply_msg).
        Returns False, dropping the reply, if the peer is gone or its queue is full."""
        return self._send_reply(peer, frames, copy=False)

    def reply_msg(self, peer: bytes, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None
                  ) -> bool:
        """Encodes (with this Replier's token) and sends a copy; same return value as reply()."""
        return self._send_reply(peer, encode(kind, meta, tensors, self._token), copy=True)

    def _send_reply(self, peer: bytes, frames: list, copy: bool) -> bool:
        rid = self._pending.pop(peer, _NO_RID)  # no request pending: tag 0, which no Requester accepts
        try:
            self._sock.send_multipart([peer, rid, *frames], flags=zmq.NOBLOCK, copy=copy)
            return True
        except zmq.ZMQError as e:
            if e.errno in (errno.EHOSTUNREACH, errno.EAGAIN):  # peer gone / its queue full: it will ask again
                return False
            raise



class Requester(_Socket):
    """Asks a Replier and waits for its answer (sampler side). Survives a trainer restart: the socket
    reconnects to the same address by itself, and is replaced after every timeout."""

    def __init__(self, addr: str, *, token: str = ""):
        self.addr, self._token = addr, token
        self._rid = 0
        self._sock: zmq.Socket | None = None
        self._connect()

    def _connect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)  # drops unsent requests and any late replies with it
        self._sock = _socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no request waits in a queue for a trainer that is down
        _heartbeat(self._sock)
        _ipv6(self._sock, self.addr)
        self._sock.connect(self.addr)

    def request(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None,
                timeout_s: float = 30.0) -> Message:
        """Sends one request and returns the reply to it; PeerTimeout if there is none within timeout_s.
        A malformed reply raises WireError (the socket stays usable)."""
        self._rid += 1
        rid = _RID.pack(self._rid)
        frames = [rid, *encode(kind, meta, tensors, self._token)]
        deadline = time.monotonic() + timeout_s
        if _send(self._sock, frames, deadline, copy=True):
            while self._sock.poll(_ms(deadline - time.monotonic()), zmq.POLLIN):
                reply = _recv_frames(self._sock)
                if reply is None or reply[0].bytes != rid:
                    continue  # a stale reply (to an earlier request, or an unsolicited one): drop it
                if len(reply) < 2:
                    raise WireError(f"reply from {self.addr} has no message frames")
                return decode(reply[1:], self._token)
        self._connect()
        raise PeerTimeout(f"no answer to {kind!r} from {self.addr} within {timeout_s:g} s: is the trainer running "
                          f"and reachable (check the host and --sync-port, and that {TOKEN_ENV} matches)?")

