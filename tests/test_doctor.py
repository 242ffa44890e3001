"""`alignrl doctor`: live and dead services, model folders, hostfile syntax, the rendezvous port."""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from conftest import json_reply

from alignrl.dist.launch import free_port
from alignrl.doctor import parse_hostfile


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        healthy = self.path == "/health"
        json_reply(self, {"status": "healthy"} if healthy else {}, 200 if healthy else 404)

    def log_message(self, *args):
        pass


@pytest.fixture
def live_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "alignrl", "doctor", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})


def test_hostfile_syntax():
    hosts, errors = parse_hostfile("# nodes\ngpu007 slots=8  # master\ngpu005   slots=8\n\n")
    assert hosts == {"gpu007": 8, "gpu005": 8} and errors == []
    _, errors = parse_hostfile("gpu007 slots=eight\ngpu005\ngpu006 slots=0\ngpu007 slots=8\ngpu007 slots=8\n")
    assert len(errors) == 4 and errors[0].startswith("line 1")


def test_all_good_exits_zero(live_url, tiny_model_dir, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=8  # 主节点\n127.0.0.1 slots=8\n")
    cfg = {"training": {"master_node": "127.0.0.1", "master_port": free_port(),
                        "services": {"generation": {"url": live_url}, "reference": {"url": live_url}}},
           "models": {"train": {"path": str(tiny_model_dir)}, "output": {"path": str(tmp_path / "out")}}}
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(cfg))
    r = doctor("--config", str(tmp_path / "nodes.yaml"), "--hostfile", str(hostfile))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "7 passed, 0 failed" in r.stdout


def test_failures_are_listed_and_exit_nonzero(live_url, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu007 slots=8\ngpu005 8\n")
    r = doctor(f"services.generation_url={dead}", f"services.reference_url={live_url}",
               f"model.path={tmp_path / 'missing'}", f"trainer.hostfile={hostfile}", f"trainer.master_port={free_port()}",
               "--timeout", "1")
    assert r.returncode == 1
    out = r.stdout
    assert "not reachable" in out and "no config.json" in out and "line 2" in out
    assert "3 failed" in out


def test_port_in_use_fails(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = doctor(f"trainer.master_port={s.getsockname()[1]}")
    assert r.returncode == 1 and "in use on this host" in r.stdout


def test_bad_config_is_one_line(tmp_path):
    r = doctor("trainer.no_such_key=1")
    assert r.returncode == 2 and "unknown config key" in r.stderr and "Traceback" not in r.stderr
