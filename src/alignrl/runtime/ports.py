"""Local ports and addresses: free loopback ports for the services and process groups a run starts, and whether a
host is this machine's loopback (what may bind without a token)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an IP, or an IPv6 address in brackets) is this machine's loopback only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # wildcards ("*", "0.0.0.0"), names and interfaces are not loopback
        return False


POOL_ENV = "ALIGNRL_PORT_POOL"  # a file "low high next": processes that share it never pick the same port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports on `host`: from the port pool file named by ALIGNRL_PORT_POOL where set, else the
    kernel's choice (all held at once while picked, so none repeats)."""
    pool = os.environ.get(POOL_ENV)
    if pool:
        return _from_pool(Path(pool), n, host)
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def pool_range(low: int = 20000, high: int = 29400) -> tuple[int, int] | None:
    """The ports [low, high) below the kernel's ephemeral range, or None where that leaves fewer than 1,000. A port
    the kernel picks (bind to 0, an outgoing connection's own port) comes from the ephemeral range, so between a pool
    port's pick and its bind no other program takes it unless it asked for that very number; the default stops
    short of torchrun's customary 29500."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    high = min(high, ephemeral_low)
    return (low, high) if high - low >= 1000 else None


def _from_pool(path: Path, n: int, host: str) -> list[int]:
    """The pool's next `n` ports that bind now, in turn (wrapping round), under an exclusive lock on its file; the
    first process to find the file missing or empty starts it at the low end of `pool_range()`."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        low, high, at = _pool_state(path, f.read())
        ports: list[int] = []
        for _ in range(high - low):
            if _binds(host, at):
                ports.append(at)
            at = at + 1 if at + 1 < high else low
            if len(ports) == n:
                f.truncate(0)
                f.write(f"{low} {high} {at}")  # "a+": written at the end, which is now the start
                return ports
    raise OSError(f"no {n} free ports left in the pool {low}-{high} of {path}: stop what holds them, or unset "
                  f"{POOL_ENV}")


def _pool_state(path: Path, text: str) -> tuple[int, int, int]:
    if not text.strip():
        span = pool_range()
        if span is None:
            raise OSError(f"{POOL_ENV}={path}: this machine leaves no 1,000 ports below its ephemeral range for a "
                          f"pool: unset {POOL_ENV}")
        return span[0], span[1], span[0]
    try:
        low, high, at = map(int, text.split())
    except ValueError:
        raise OSError(f"{POOL_ENV}={path} does not hold a port pool ('low high next'): remove the file or name "
                      "another") from None
    if not 0 < low <= at < high <= 65536:
        raise OSError(f"{POOL_ENV}={path} holds {text.strip()!r}, not 'low high next' with low <= next < high: "
                      "remove the file")
    return low, high, at


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
