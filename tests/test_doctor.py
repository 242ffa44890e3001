"""`alignrl doctor`: live and dead services, model folders, hostfile syntax, the rendezvous port."""

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler

import pytest
import yaml
from conftest import json_reply

from alignrl.runtime.ports import free_port
from alignrl.doctor import check_health, parse_hostfile
from alignrl.serve.common import SERVICE_HEADER


class Healthy(BaseHTTPRequestHandler):
    body: dict | None = {"status": "healthy"}  # None: an empty 200, as vLLM's /health answers
    service: str | None = None  # the SERVICE_HEADER alignrl's services send

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path != "/health":
            json_reply(self, {}, 404)
            return
        self.send_response(200)
        if self.service:
            self.send_header(SERVICE_HEADER, self.service)
        data = b"" if self.body is None else json.dumps(self.body).encode()
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server(http_servers):
    """Starts `/health` servers answering a given body (and SERVICE_HEADER) on free loopback ports."""
    def start(body: dict | None = Healthy.body, service: str | None = None) -> str:
        return http_servers(type("Answer", (Healthy,), {"body": body, "service": service}))

    return start


@pytest.fixture
def live_url(health_server):
    return health_server()


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "alignrl", "doctor", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "80"})  # a log's width: nothing may be cut


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


def test_health_names_a_swapped_service_and_accepts_unnamed_ones(health_server):
    ref = health_server(service="reference")  # what `alignrl serve ref` answers
    bad = check_health("generation service", ref, 5, "services.generation_url")
    assert not bad.ok and bad.detail == (f"{ref} is a reference service; services.generation_url wants the generation "
                                         "service (swapped URLs?)")
    assert check_health("reference service", ref, 5, "services.reference_url").ok
    for body in (None, {"status": "healthy"}):  # vLLM's empty 200; a server that does not say its kind
        assert check_health("generation service", health_server(body), 5).ok
    assert not check_health("reward service", health_server({"status": "loading"}), 5).ok


def test_swapped_service_urls_fail(health_server, tmp_path):
    gen, ref = health_server(service="generation"), health_server(service="reference")
    cfg = {"training": {"master_node": "127.0.0.1", "master_port": free_port(),
                        "services": {"generation": {"url": ref}, "reference": {"url": gen}}}}
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(cfg))
    r = doctor("--config", str(tmp_path / "nodes.yaml"), "model.path=demo")
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout
    assert f"FAIL generation service {ref}: {ref} is a reference service; services.generation_url wants the " \
           "generation service (swapped URLs?)" in r.stdout.splitlines(), r.stdout
    assert "is a generation service" in r.stdout
    r = doctor("--config", str(tmp_path / "nodes.yaml"), "model.path=demo", f"training.services.generation.url={gen}",
               f"training.services.reference.url={ref}")
    assert r.returncode == 0 and "healthy generation service" in r.stdout, r.stdout


def test_each_of_several_reward_services_is_checked(health_server):
    from alignrl.doctor import reward_checks

    live, dead = health_server(service="reward"), f"http://127.0.0.1:{free_port()}"
    got = reward_checks(f"{live},{dead}", timeout=10)
    assert [(c.target, c.ok) for c in got] == [(live, True), (dead, False)]
    assert "not reachable" in got[1].detail
    openrlhf_style = reward_checks(f"{live}/get_reward", timeout=10)  # a server without /health for that path
    assert [(c.target, c.ok) for c in openrlhf_style] == [(f"{live}/get_reward", True)]
