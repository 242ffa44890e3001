"""The search tool's retriever client against servers that misbehave: malformed answers, a server that is down,
slow or speaks another API, long queries, and the request limits a server names; each is one line, and a run meets
a dead or wrong retriever when its tool is made, not at its first search."""

import http.server
import json
import time

import pytest

from alignrl.rollout.agent import AgentRollout
from alignrl.rollout.hf_engine import HFRolloutEngine
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.retriever import RetrieverClient

pytestmark = pytest.mark.timeout(240)


class _Fixed(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fixed_server(http_servers):
    def start(body: bytes) -> str:
        return http_servers(type("H", (_Fixed,), {"body": body})) + "/retrieve"

    return start


@pytest.mark.parametrize("body", [b"<html>not json</html>", b'{"result": 5}', b'{"result": [[{"doc": 1}]]}',
                                  b'{"result": [[], []]}'])
def test_malformed_retriever_answers_are_one_line(fixed_server, body):
    url = fixed_server(body)
    with pytest.raises(ServiceError) as e:
        RetrieverClient(url, retries=1, timeout_s=5).search(["one query"])
    msg = str(e.value)
    assert url.rsplit("/", 1)[0] in msg and "\n" not in msg


def test_retriever_down_is_one_line_naming_the_url():
    import socket

    with socket.socket() as s:  # a port nobody listens on: bound without listen() for the test, so nothing takes it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/retrieve"
        with pytest.raises(ServiceError) as e:
            RetrieverClient(url, retries=2, timeout_s=2).search(["q"])
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "\n" not in msg
    assert msg.endswith(f"start it with `PORT={port} bash retrieval_launch.sh` (or `alignrl serve retrieve --port "
                        f"{port}`), or check retriever.url"), msg  # the seed's launcher, and the likelier typo
    with pytest.raises(ServiceError):
        RetrieverClient("127.0.0.1:8000/retrieve")


def test_long_query_is_cut_and_still_answered(fixed_server):
    url = fixed_server(json.dumps({"result": [[{"document": {"contents": '"T"\nbody'}, "score": 1.0}]]}).encode())
    client = RetrieverClient(url, retries=1, max_query_chars=50)
    assert client.search(["x" * 500]) == ['Doc 1(Title: "T") body\n'] and client.cut_queries == 1


class _Recording(http.server.BaseHTTPRequestHandler):
    """A retrieval server that names small limits in /health, answers each query with one passage after
    `delay` seconds, and records every request (path, queries, body bytes)."""

    limits: dict = {}
    delay = 0.0
    seen: list = []

    def do_GET(self):  # noqa: N802
        self._send(json.dumps({"status": "healthy", **self.limits}).encode())

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        queries = json.loads(body)["queries"]
        self.seen.append((self.path, len(queries), len(body)))
        time.sleep(self.delay)
        hits = [[{"document": {"contents": f'"{q[:3]}"\nbody'}, "score": 1.0}] for q in queries]
        self._send(json.dumps({"result": hits}).encode())

    def _send(self, body: bytes):
        try:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def recording_server(http_servers):
    def start(limits: dict, delay: float = 0.0):
        handler = type("H", (_Recording,), {"limits": limits, "delay": delay, "seen": []})
        return http_servers(handler), handler.seen

    return start


def test_the_client_keeps_to_the_limits_the_server_names(recording_server):
    """A server started with a lower --max_queries, or a turn's queries over its body cap, refused the request
    (HTTP 413) mid-run; the client now reads the limits at its start-up check and splits. The URL's query
    string stays on the path."""
    queries = [f"q{i:02d}" + "é" * 60 for i in range(5)]  # 126 bytes each in the body
    for limits, sizes in (({"max_queries": 2}, [2, 2, 1]), ({"max_body_bytes": 300}, [1] * 5)):
        base, seen = recording_server(limits)
        client = RetrieverClient(f"{base}/retrieve?token=abc", retries=1, timeout_s=5)
        client.check()
        assert client.search(queries) == [f'Doc 1(Title: "q{i:02d}") body\n' for i in range(5)]
        assert [path for path, _, _ in seen] == ["/retrieve?token=abc"] * len(seen)
        cap = limits.get("max_body_bytes", 4 << 20)
        assert [n for _, n, _ in seen[1:]] == sizes and all(size <= cap for _, _, size in seen), seen


def test_a_slow_retriever_is_asked_once_and_named_slow(recording_server):
    """A request that got no answer in time was sent again (the busy server searched it twice or three
    times) and reported as "not reachable ... start it"."""
    base, seen = recording_server({}, delay=1.5)
    with pytest.raises(ServiceError) as e:
        RetrieverClient(f"{base}/retrieve", retries=3, timeout_s=0.5).search(["q"])
    msg = str(e.value)
    assert "did not answer" in msg and "retriever.timeout_s" in msg and "\n" not in msg, msg
    assert len(seen) == 1


def test_a_retriever_that_is_down_or_speaks_another_api_stops_the_run_at_start(tiny_model, fixed_server,
                                                                                retrieval_stub):
    """The search tool asks once when it is made (before the first step): an untrained policy may never search,
    and a run should not train for hours before its first search meets a dead or wrong endpoint."""
    import socket

    from alignrl.placements.episodes import with_tools
    from alignrl.config import load_config

    model, tok = tiny_model
    engine = HFRolloutEngine(model, tok)
    with socket.socket() as s:  # a port nobody listens on: bound without listen() for the test, so nothing takes it
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
        for url, said in ((dead, "alignrl serve retrieve"), (fixed_server(b"<html>Not Found</html>"), "")):
            cfg = load_config(None, ["agent.max_turns=2", f"retriever.url={url}", "retriever.retries=1",
                                     "retriever.timeout_s=5"])
            with pytest.raises(ServiceError) as e:
                with_tools(cfg, engine, tok)
            assert url.rsplit("/", 1)[0] in str(e.value) and said in str(e.value) and "\n" not in str(e.value)
    cfg = load_config(None, ["agent.max_turns=2", f"retriever.url={retrieval_stub}"])
    assert isinstance(with_tools(cfg, engine, tok), AgentRollout)
