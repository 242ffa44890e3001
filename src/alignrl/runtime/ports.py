"""Local ports and addresses: free loopback ports for the services and process groups a run starts, and whether a
host is this machine's loopback (what may bind without a token)."""

from __future__ import annotations

import socket


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an IP, or an IPv6 address in brackets) is this machine's loopback only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # wildcards ("*", "0.0.0.0"), names and interfaces are not loopback
        return False


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1 (all held at once while picked, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
