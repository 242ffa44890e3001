"""The port pool: processes that share its file never pick the same port, a held port is skipped, picks wrap round
the range, and the pool lies below the kernel's ephemeral range."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.runtime import ports


@pytest.fixture
def pool(tmp_path, monkeypatch):
    path = tmp_path / "ports"
    assert ports.new_pool(path)
    low, high, at = map(int, path.read_text().split())
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert at == low and high <= ephemeral_low and high - low >= 1000
    monkeypatch.setenv(ports.POOL_ENV, str(path))
    return path


def test_processes_sharing_a_pool_never_pick_the_same_port(pool):
    pick = "from alignrl.runtime.ports import free_ports; print(*free_ports(5))"
    procs = [subprocess.Popen([sys.executable, "-c", pick], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    got = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    got += ports.free_ports(5)
    assert len(got) == 25 and len(set(got)) == 25


def test_a_held_port_is_skipped_and_picks_wrap_round(pool):
    low, high, _ = map(int, pool.read_text().split())
    pool.write_text(f"{low} {high} {high - 2}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", high - 1))
        assert ports.free_ports(2) == [high - 2, low]
    assert pool.read_text().split()[2] == str(low + 1)


def test_a_pool_with_no_free_port_says_so(tmp_path, monkeypatch):
    path = tmp_path / "ports"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        path.write_text(f"{port} {port + 1} {port}")
        monkeypatch.setenv(ports.POOL_ENV, str(path))
        with pytest.raises(OSError, match=f"no 1 free ports left in the pool {port}-{port + 1}"):
            ports.free_port()


def test_without_a_pool_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(ports.POOL_ENV, raising=False)
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p > 0 for p in got)


def test_this_test_run_picks_from_one_pool_below_the_ephemeral_range():
    """conftest made the pool before the test processes started: every test process and what it starts share it."""
    import os

    low, high, _ = map(int, Path(os.environ[ports.POOL_ENV]).read_text().split())
    assert low <= ports.free_port() < high
