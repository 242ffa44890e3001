"""The port pool: processes that share its file never pick the same port, a held port is skipped, picks wrap round
the range, and the pool lies below the kernel's ephemeral range."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from alignrl.runtime import ports

# a machine whose ephemeral ports start low (1024, 10000) leaves no room below them: free_ports asks the kernel there,
# which the held-port test's last picks cover
needs_pool = pytest.mark.skipif(ports.pool_range() is None, reason="the kernel's ephemeral port range starts below "
                                "21000 here: no port pool below it")


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """A pool file not made yet: the first port taken starts it at the low end of the range."""
    path = tmp_path / "ports"
    monkeypatch.setenv(ports.POOL_ENV, str(path))
    return path


@needs_pool
def test_the_first_port_starts_the_pool_below_the_ephemeral_range(pool):
    low, high = ports.pool_range()
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high <= ephemeral_low and high - low >= 1000
    got = ports.free_ports(2)  # the run's own pool, started at the same low end, may hold the first ports
    assert low <= got[0] < got[1] < high and pool.read_text() == f"{low} {high} {got[1] + 1}"


@needs_pool
def test_processes_sharing_a_pool_never_pick_the_same_port(pool):
    pick = "from alignrl.runtime.ports import free_ports; print(*free_ports(5))"
    procs = [subprocess.Popen([sys.executable, "-c", pick], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    got = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    got += ports.free_ports(5)
    assert len(got) == 25 and len(set(got)) == 25


@needs_pool
def test_a_held_port_is_skipped_and_picks_wrap_round(pool, monkeypatch):
    """Which ports are held is the test's (other tests hold ports of the same range)."""
    low, high = ports.pool_range()
    held = {high - 1, low + 1}
    monkeypatch.setattr(ports, "_binds", lambda host, port: port not in held)
    pool.write_text(f"{low} {high} {high - 2}")
    assert ports.free_ports(3) == [high - 2, low, low + 2]
    assert pool.read_text().split()[2] == str(low + 3)


def test_a_pool_with_no_free_port_says_so(tmp_path, monkeypatch):
    path = tmp_path / "ports"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        path.write_text(f"{port} {port + 1} {port}")
        monkeypatch.setenv(ports.POOL_ENV, str(path))
        with pytest.raises(OSError, match=f"no 1 free ports left in the pool {port}-{port + 1}"):
            ports.free_port()


@pytest.mark.parametrize("text, said", [("20000 x 1", "does not hold a port pool ('low high next')"),
                                         ("20000 21000 30000", "not 'low high next' with low <= next < high")])
def test_a_pool_file_of_something_else_is_one_line(pool, text, said):
    pool.write_text(text)
    with pytest.raises(OSError, match=f"ALIGNRL_PORT_POOL={pool}") as e:
        ports.free_port()
    assert said in str(e.value) and "remove the file" in str(e.value) and "\n" not in str(e.value)
    assert pool.read_text() == text  # left as it was


def test_without_a_pool_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(ports.POOL_ENV, raising=False)
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(p > 0 for p in got)


@needs_pool
def test_this_test_run_picks_from_one_pool_below_the_ephemeral_range():
    """conftest made the pool before the test processes started: every test process and what it starts share it."""
    import os

    port = ports.free_port()
    low, high, _ = map(int, Path(os.environ[ports.POOL_ENV]).read_text().split())
    assert low <= port < high
