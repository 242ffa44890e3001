"""Every endpoint of the three servers, fed malformed and hostile input: always a one-line 4xx, never a
5xx, and the server stays healthy and keeps serving. Loops are bounded and seeded."""

import json
import random
import struct

import httpx
import msgpack
import pytest

from alignrl.serve.process import ServiceProcess, start_all
from alignrl.wire.http_weights import MAGIC

pytestmark = pytest.mark.timeout(300)
LIMIT_MB = 0.25  # a small body limit, so "oversized" stays cheap to send
HUGE = [10**9, 10**30]

# Per endpoint: a valid body, and per field its kind, which decides the invalid values tried.
ENDPOINTS = {
    "generate": {
        "/v1/generate_tokens": ({"prompts": [[5, 6, 7]], "n": 2, "temperature": 0.8, "top_p": 0.9, "top_k": 5,
                                 "max_tokens": 4, "stop": ["x"], "seed": 1},
                                {"prompts": "ids!", "n": "count", "temperature": "float", "top_p": "prob",
                                 "top_k": "topk", "max_tokens": "count", "stop": "strs", "seed": "seed"}),
        "/v1/completions": ({"prompt": "What is 1 + 1?", "n": 2, "max_tokens": 4, "logprobs": 1,
                             "temperature": 0.5, "stop": ["q"]},
                            {"prompt": "prompt!", "n": "count", "max_tokens": "count", "logprobs": "k",
                             "temperature": "float", "stop": "stop"}),
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                  "logprobs": True, "top_logprobs": 2},
                                 {"messages": "messages!", "max_tokens": "count", "top_logprobs": "k",
                                  "logprobs": "bool"}),
    },
    "ref": {"/v1/logprobs": ({"prompts": [[5, 6], [7]], "responses": [[8], [9, 10]], "temperature": 1.0},
                             {"prompts": "ids!", "responses": "ids!", "temperature": "float"})},
    "reward": {"/v1/score": ({"prompts": ["a b", "c"], "responses": ["d", "e f"]},
                             {"prompts": "texts!", "responses": "texts!"})},
}
COMMON_BAD = ["x", {"a": 1}, [[["deep"]]]]
TAKES_TEXT = {"prompt", "stop"}  # kinds for which "x" is a valid value
BAD = {  # invalid values per kind (a trailing ! marks a required field)
    "ids": [5, [5], [[]], [["7"]], [[1.5]], [[True]], [[10**6]], [[-5]], [[10**30]], [], [[1] * 300]],
    "count": [-2, 0, 1.5, True, *HUGE], "k": [-2, 1.5, True, *HUGE], "seed": [-2, 1.5, True, 2**70],
    "topk": [-2, 1.5, True],
    "float": [-0.5, True, 1e9, -1e9], "prob": [-0.5, 0.0, 1.5, True],
    "strs": [5, [5], [""], ["s"] * 100, [None], ["\udfff"]],
    "stop": [5, [5], [""], ["s"] * 100, [None], "", "\ud800", ["a", "\udfff"]], "bool": [5, "yes"],
    "texts": [5, [5], [], [None], [[10**6]], [[-1]], ["\ud800"]],  # JSON may carry a lone surrogate
    "prompt": [5, [], [[]], [True], [10**6], [[10**6]], [-1], [1] * 300, {"text": "a"}, "", "\ud800", ["a", "\udfff"]],
    "messages": [[], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}],
                 [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}], ["hi"],
                 [{"role": "user", "content": "\ud800" + "a" * 9000}]],  # long enough for the tokenizer itself
}
MALFORMED = [b"{", b"", b"null", b"[]", b'"text"', b"123", b"\xff\xfe\x00", b'{"prompts": [[1, 2]', b"{'a': 1}",
             b'{"prompts": NaN}']


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = tmp_path_factory.mktemp("fuzz_rm") / "rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1).save_pretrained(str(rm))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(rm))
    procs = {name: ServiceProcess([name, "--model", str(model), "--max_body_mb", str(LIMIT_MB),
                                   "--max_request_seqs", "64"])
             for name, model in (("generate", tiny_model_dir), ("ref", tiny_model_dir), ("reward", rm))}
    start_all(list(procs.values()))
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _check_4xx(r: httpx.Response, what):
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    msg = r.json()["error"]["message"]
    assert msg and "\n" not in msg and "Traceback" not in msg, (what, msg)


def _cases(body, fields):
    for field, kind in fields.items():
        required = kind.endswith("!")
        kind = kind.rstrip("!")
        for bad in BAD[kind] + [b for b in COMMON_BAD if not (kind in TAKES_TEXT and b == "x")]:
            yield f"{field}={json.dumps(bad)[:40]}", {**body, field: bad}
        if required:  # optional fields may be missing: that is not an error
            yield f"no {field}", {k: v for k, v in body.items() if k != field}
    yield "extra nesting", {"body": body}


@pytest.mark.parametrize("service", ["generate", "ref", "reward"])
def test_invalid_input_is_4xx_and_server_survives(servers, service):
    s = servers[service]
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for path, (body, fields) in ENDPOINTS[service].items():
            assert c.post(path, json=body).status_code == 200, path  # the base body is valid
            for raw in MALFORMED:
                _check_4xx(c.post(path, content=raw, headers={"content-type": "application/json"}), (path, raw))
            for what, bad in _cases(body, fields):  # ASCII JSON: it can carry a lone surrogate as \ud800
                _check_4xx(c.post(path, content=json.dumps(bad), headers={"content-type": "application/json"}),
                           (path, what))
            big = json.dumps({**body, "pad": "x" * int(LIMIT_MB * (1 << 20))}).encode()
            _check_4xx(c.post(path, content=big, headers={"content-type": "application/json"}), (path, "oversized"))
            chunks = (b"x" * 65536 for _ in range(int(LIMIT_MB * 16) + 2))  # chunked, no Content-Length
            _check_4xx(c.post(path, content=chunks), (path, "oversized chunked"))
            _check_4xx(c.get(path), (path, "GET"))
        _check_4xx(c.get("/no/such/endpoint"), "404")
        assert c.get("/health").json() == {"status": "healthy"}
        for path, (body, _) in ENDPOINTS[service].items():
            assert c.post(path, json=body).status_code == 200, path


def _random_json(rng: random.Random, depth: int = 0):
    """A random JSON value: scalars of every type, nested lists and maps, token-id-like lists."""
    options = [lambda: None, lambda: True, lambda: rng.randint(-2**40, 2**40), lambda: rng.uniform(-1e6, 1e6),
               lambda: "".join(rng.choices("ab{}[]\"\\ \x00é", k=5)), lambda: rng.choice([0, -1, 1, 2**63]),
               lambda: [[rng.randint(-3, 400) for _ in range(3)]]]
    if depth < 3:
        options += [lambda: [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))],
                    lambda: {rng.choice(["prompts", "n", "responses", "role", "content", "x"]):
                             _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}]
    return rng.choice(options)()


@pytest.mark.parametrize("service", ["generate", "ref", "reward"])
def test_random_mutations_never_5xx(servers, service):
    rng = random.Random(1234)
    s = servers[service]
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for path, (body, fields) in ENDPOINTS[service].items():
            for _ in range(40):
                mutated = dict(body)
                for field in rng.sample(list(body), rng.randint(1, min(3, len(body)))):
                    mutated[field] = _random_json(rng)
                r = c.post(path, json=mutated)
                assert r.status_code < 500, (path, mutated, r.text[:300])
        assert c.get("/health").json() == {"status": "healthy"}


def _frame(header, payload=b""):
    h = msgpack.packb(header) if not isinstance(header, bytes) else header
    head = MAGIC + struct.pack("<Q", len(h)) + h
    return head + b"\0" * (-len(head) % 64) + payload


def test_weight_update_bodies(servers):
    s = servers["generate"]
    name = next(iter(httpx.get(s.url + "/v1/weights_manifest").json()["tensors"]))
    entry = {"name": name, "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    bodies = {
        "empty": b"", "garbage": b"\x80\x04pickle-like bytes", "magic only": MAGIC,
        "header past end": MAGIC + struct.pack("<Q", 2**40) + b"xx",
        "header not msgpack": _frame(b"\xc1\xc1\xc1"), "header a list": _frame([1, 2]),
        "no tensors": _frame({"version": 1}), "version str": _frame({"version": "1", "tensors": []}),
        "negative version": _frame({"version": -1, "tensors": []}),
        "dtype pickle": _frame({"version": 1, "tensors": [{**entry, "dtype": "pickle"}]}, b"\0" * 8),
        "negative shape": _frame({"version": 1, "tensors": [{**entry, "shape": [-2]}]}, b"\0" * 8),
        "nbytes mismatch": _frame({"version": 1, "tensors": [{**entry, "nbytes": 12}]}, b"\0" * 12),
        "misaligned": _frame({"version": 1, "tensors": [{**entry, "offset": 3}]}, b"\0" * 11),
        "truncated payload": _frame({"version": 1, "tensors": [entry]}, b"\0" * 5),
        "trailing bytes": _frame({"version": 1, "tensors": [entry]}, b"\0" * 9),
        "entry not a map": _frame({"version": 1, "tensors": ["x"]}),
        "wrong shape for the model": _frame({"version": 1, "tensors": [entry]}, b"\0" * 8),
        "empty update": _frame({"version": 1, "tensors": []}),
    }
    for what, body in bodies.items():
        _check_4xx(httpx.post(s.url + "/v1/update_weights", content=body), what)
    assert httpx.get(s.url + "/v1/weight_version").json() == {"weight_version": 0}
    assert httpx.get(s.url + "/health").json() == {"status": "healthy"}
