"""`alignrl serve retrieve` as a real subprocess: Search-R1 request/response layouts, hostile input, CLI errors."""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from alignrl.serve.retrieve import Limits, RequestError, parse_request

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready on http://127\.0\.0\.1:(\d+)/retrieve")
START_DEADLINE_S = 180  # dense model load + encoding the corpus on a busy 2-core CPU


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                ALIGNRL_CACHE=str(tmp_path / "cache"))


def _cli(*args: str, tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "alignrl", "serve", "retrieve", *args], cwd=REPO,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieve")
    out, err = (tmp / "stdout.txt").open("w"), (tmp / "stderr.txt").open("w")
    # Files, not pipes: a child that logs more than a pipe buffer would block on a full pipe.
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "retrieve", "--port", "0",
                             "--index_path", str(tmp / "index"), "--topk", "3"],
                            cwd=REPO, env=_env(tmp), stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        url = None
        while url is None:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}: {(tmp / 'stderr.txt').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {START_DEADLINE_S}s: {(tmp / 'stderr.txt').read_text()[-2000:]}")
            m = READY.search((tmp / "stdout.txt").read_text())
            if m:
                url = f"http://127.0.0.1:{m.group(1)}"
            else:
                time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=60) as client:
            while True:
                try:
                    if client.get("/health").json()["status"] == "healthy":
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("server never answered /health")
                time.sleep(0.2)
            client.server_stderr = tmp / "stderr.txt"  # for tests that check the log stayed clean
            yield client
    finally:
        _stop(proc)
        out.close()
        err.close()


def _title(contents: str) -> str:
    return contents.split("\n", 1)[0].strip('"')


@pytest.mark.timeout(300)
def test_search_r1_request_with_scores(server):
    queries = ["who wrote the play about the prince of denmark", "what is the biggest sea on our planet"]
    r = server.post("/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(row) == 3 for row in result)
    for row in result:
        for entry in row:
            assert set(entry) == {"document", "score"} and set(entry["document"]) == {"id", "contents"}
            assert isinstance(entry["score"], float) and isinstance(entry["document"]["id"], str)
        assert [e["score"] for e in row] == sorted((e["score"] for e in row), reverse=True)
    assert _title(result[0][0]["document"]["contents"]) == "Hamlet"
    assert _title(result[1][0]["document"]["contents"]) == "Pacific Ocean"


@pytest.mark.timeout(300)
def test_search_r1_request_without_scores_and_default_topk(server):
    r = server.post("/retrieve", json={"queries": ["capital city of canada"], "topk": 3, "return_scores": False})
    assert r.status_code == 200
    (row,) = r.json()["result"]
    assert len(row) == 3 and all(set(doc) == {"id", "contents"} for doc in row)
    assert _title(row[0]["contents"]) == "Ottawa"
    # topk and return_scores omitted: server default topk (3), bare documents (the reference default).
    row = server.post("/retrieve", json={"queries": ["capital city of canada"]}).json()["result"][0]
    assert len(row) == 3 and "contents" in row[0]


HOSTILE_BODIES = [
    b"", b"{", b"null", b"[]", b'"queries"', b"NaN", b"[" * 50_000,
    b'{"queries": "one query"}', b'{"queries": [1, 2]}', b'{"queries": [null]}',
    b'{"queries": ["a"], "topk": -3}', b'{"queries": ["a"], "topk": 10000000}',
    b'{"queries": ["a"], "topk": "3"}', b'{"queries": ["a"], "topk": true}', b'{"queries": ["a"], "topk": 2.5}',
    b'{"queries": ["a"], "topk": 1e400}', b'{"queries": ["a"], "return_scores": "yes"}',
    b'{"topk": 3}', b'\xff\xfe\x00junk', b'{"queries": ["a"]}' + b" " * (Limits.max_body_bytes + 10),
    json.dumps({"queries": ["q"] * (Limits.max_queries + 1)}).encode(),
    json.dumps({"queries": ["x" * (Limits.max_query_chars + 1)]}).encode(),
]


def test_what_search_r1s_trainer_sends_is_answered_as_its_server_does(server):
    """A turn in which no row searched (Search-R1 asks all the same) and topk 0 (its server's default): they were
    refused with 422, and Search-R1's client then failed on `.json()['result']`."""
    r = server.post("/retrieve", json={"queries": [], "topk": 3, "return_scores": True})
    assert r.status_code == 200 and r.json() == {"result": []}
    r = server.post("/retrieve", json={"queries": ["mount everest height"], "topk": 0})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 3  # the server's --topk


@pytest.mark.timeout(300)
def test_hostile_bodies_get_one_line_4xx_and_server_stays_up(server):
    rng = random.Random(0)
    bodies = list(HOSTILE_BODIES)
    valid = b'{"queries": ["mount everest height"], "topk": 3, "return_scores": true}'
    for _ in range(40):  # seeded mutations of a valid body: truncations and byte flips
        b = bytearray(valid[: rng.randrange(1, len(valid))])
        for _ in range(rng.randrange(0, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        bodies.append(bytes(b))
    for body in bodies:
        r = server.post("/retrieve", content=body, headers={"content-type": "application/json"})
        if r.status_code == 200:  # a mutation can still be a valid request; then it must answer properly
            assert "result" in r.json()
            continue
        assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:200])
        msg = r.json()["error"]["message"]  # the error shape shared by the alignrl services
        assert msg and "\n" not in msg and "Traceback" not in msg
    for path, method in (("/nope", "GET"), ("/retrieve", "GET"), ("/health", "POST")):
        assert 400 <= server.request(method, path).status_code < 500
    assert server.get("/health").json() == {"status": "healthy", "max_queries": 512, "max_topk": 100,
                                            "max_query_chars": 8192, "max_body_bytes": 4 << 20}
    assert "Traceback" not in server.server_stderr.read_text()
    r = server.post("/retrieve", content=valid)
    assert r.status_code == 200 and _title(r.json()["result"][0][0]["document"]["contents"]) == "Mount Everest"


def test_parse_request_rules():
    req = parse_request(b'{"queries": ["a", "b"], "topk": 5, "return_scores": true}', 3, Limits())
    assert (req.queries, req.topk, req.return_scores) == (["a", "b"], 5, True)
    req = parse_request(b'{"queries": ["a"], "topk": null}', 3, Limits())
    assert (req.topk, req.return_scores) == (3, False)
    with pytest.raises(RequestError) as e:
        parse_request(b'{"queries": ["a"], "topk": 11}', 3, Limits(max_topk=10))
    assert e.value.status == 422 and "between 1 and 10" in e.value.message


@pytest.mark.parametrize("args,fragment", [
    (["--host", "0.0.0.0", "--retriever_name", "bm25"], "--allow-remote"),
    (["--retriever_name", "splade"], "unknown retriever 'splade'"),
    (["--retriever_name", "bm25", "--faiss_gpu"], "--faiss_gpu"),
    (["--topk", "0"], "--topk must be between"),
    (["--port", "70000"], "--port must be between"),
    pytest.param(["--faiss_gpu"], "FAISS sees no GPU", marks=pytest.mark.skipif(
        __import__("faiss").get_num_gpus() > 0, reason="a GPU FAISS build is present")),
])
def test_flag_errors_exit_2_before_loading_anything(capsys, args, fragment):
    from alignrl.serve.retrieve import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("alignrl serve retrieve: error:")


@pytest.mark.timeout(120)
def test_bad_corpus_through_the_cli_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "ok"}\n{"id": "1"}\n')
    p = _cli("--retriever_name", "bm25", "--corpus_path", str(bad), "--port", "0", tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [f"alignrl serve retrieve: error: {bad}:2: missing key 'contents'; "
                                             "each line needs 'id' and 'contents'"]
    words = tmp_path / "stop_words.jsonl"  # valid lines, but nothing BM25 can index
    words.write_text('{"id": "0", "contents": "\\"A\\"\\nthe of and"}\n')
    p = _cli("--retriever_name", "bm25", "--corpus_path", str(words), "--port", "0", "--index_path",
             str(tmp_path / "i"), tmp_path=tmp_path)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(errors) == 1, p.stderr
    assert errors[0].startswith("alignrl serve retrieve: error: ") and "no indexable word" in errors[0]


@pytest.mark.timeout(120)
def test_port_in_use_is_a_one_line_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = _cli("--retriever_name", "bm25", "--port", str(port), "--index_path", str(tmp_path / "i"),
                 tmp_path=tmp_path)
    assert p.returncode == 2 and f"cannot bind 127.0.0.1:{port}" in p.stderr and "Traceback" not in p.stderr


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@pytest.mark.timeout(120)
def test_retrieval_launch_sh_takes_env_overrides(tmp_path):
    """The seed's `bash retrieval_launch.sh`, here with BM25 and a free port from the environment."""
    env = dict(_env(tmp_path), RETRIEVER_NAME="bm25", PORT="0", TOPK="2", INDEX_PATH=str(tmp_path / "idx"),
               ALIGNRL_PYTHON=sys.executable)
    log = tmp_path / "launch.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(REPO / "retrieval_launch.sh")], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (m := READY.search(log.read_text())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{m.group(1)}/retrieve", json={"queries": ["fastest land animal"]}, timeout=30)
        (row,) = r.json()["result"]
        assert len(row) == 2 and _title(row[0]["contents"]) == "Cheetah"  # TOPK=2 became the server default
        assert "bm25 over" in log.read_text()
    finally:
        _stop(proc)


def test_a_request_whose_client_gave_up_while_it_waited_is_not_searched():
    """One search at a time: requests queue for their turn. A client that timed out while its request
    waited reads no answer, so searching it would only delay the queue behind it (with the client's
    retries, a busy server searched each query three times)."""
    import threading

    import uvicorn

    from alignrl.runtime.ports import free_ports
    from alignrl.retrieval.corpus import Hit
    from alignrl.serve.retrieve import create_app

    class Slow:
        def __init__(self):
            self.searched = []

        def search(self, queries, topk):
            self.searched.append(queries)
            time.sleep(1.0)
            return [[Hit("0", '"T"\nbody', 1.0)] for _ in queries]

    slow = Slow()
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(create_app(slow), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)

        def ask(query: str, timeout: float, out: dict):
            try:
                out[query] = httpx.post(f"{url}/retrieve", json={"queries": [query]}, timeout=timeout).status_code
            except httpx.TimeoutException:
                out[query] = "gave up"

        answers: dict = {}
        first = threading.Thread(target=ask, args=("first", 10.0, answers))
        first.start()
        while not slow.searched:  # the first request holds the turn
            time.sleep(0.01)
        quitters = [threading.Thread(target=ask, args=(f"quitter{i}", 0.3, answers)) for i in range(2)]
        for t in quitters:
            t.start()
        for t in (first, *quitters):
            t.join(15)
        ask("last", 10.0, answers)
        assert answers == {"first": 200, "quitter0": "gave up", "quitter1": "gave up", "last": 200}
        assert slow.searched == [["first"], ["last"]]
    finally:
        server.should_exit = True
        thread.join(10)
