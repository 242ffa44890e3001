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


def new_pool(path: Path, low: int = 20000, high: int = 29400) -> bool:
    """Writes a pool of the ports [low, high) below the kernel's ephemeral range; False (nothing written) where that
    range leaves fewer than 1,000 of them. A port the kernel picks (bind to 0, an outgoing connection's own port)
    comes from the ephemeral range, so between a pool port's pick and its bind no other program takes it unless it
    asked for that very number; the default stops short of torchrun's customary 29500."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    high = min(high, ephemeral_low)
    if high - low < 1000:
        return False
    path.write_text(f"{low} {high} {low}")
    return True


def _from_pool(path: Path, n: int, host: str) -> list[int]:
    """The pool's next `n` ports that bind now, in turn (wrapping round), under an exclusive lock on its file."""
    import fcntl

    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        low, high, at = map(int, f.read().split())
        ports: list[int] = []
        for _ in range(high - low):
            if _binds(host, at):
                ports.append(at)
            at = at + 1 if at + 1 < high else low
            if len(ports) == n:
                f.seek(0)
                f.truncate()
                f.write(f"{low} {high} {at}")
                return ports
    raise OSError(f"no {n} free ports left in the pool {low}-{high} of {path}: stop what holds them, or unset "
                  f"{POOL_ENV}")


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
