"""The generation server as a subprocess: OpenAI client, batching, weight sync, auth. How the servers start and
refuse to start: test_serve_startup.py."""

import copy
import math
import threading
import time

import httpx
import openai
import pytest
import torch

from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.rollout.remote import RemoteRolloutEngine, ServiceError
from alignrl.serve.process import ServiceProcess
from alignrl.wire.http_weights import encode

pytestmark = pytest.mark.timeout(240)
KEY = "test-secret-key"


@pytest.fixture(scope="module")
def gen(tiny_model_dir):
    # A wide batching window so that concurrently fired requests reliably meet in one batch.
    with ServiceProcess(["generate", "--model", str(tiny_model_dir), "--batch_window_ms", "50"]) as s:
        yield s


@pytest.fixture(scope="module")
def oa(gen):
    return openai.OpenAI(base_url=gen.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model_name(oa):
    return oa.models.list().data[0].id


def test_health_is_exactly_the_seed_body(gen):
    r = httpx.get(gen.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "healthy"}
    assert r.headers["X-Alignrl-Service"] == "generation"  # `alignrl doctor` tells swapped URLs apart by it


def test_another_models_name_is_a_404_as_vllm_answers(gen, oa):
    """A client asking for another model gets vLLM's 404 in one line, not this model's text under that name."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(gen.url + path, json={**body, "model": "gpt-4"})
        assert r.status_code == 404, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("The model `gpt-4` does not exist: this server serves `") and "\n" not in msg
        for named in ({"model": _model_name(oa)}, {}):  # its own name, or none: served
            assert httpx.post(gen.url + path, json={**body, **named}).status_code == 200


def test_completions_n_logprobs_usage(oa, tiny_model):
    _, tok = tiny_model
    r = oa.completions.create(model=_model_name(oa), prompt="What is 12 + 7?", n=3, max_tokens=10, logprobs=2,
                              temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(tok.encode("What is 12 + 7?"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens >= 3
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs)
        assert any(v < 0 for v in lp.token_logprobs)
        assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)  # 2 alternatives + the sampled token if not in them
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completions_stop_string_is_cut(oa):
    name = _model_name(oa)
    free = oa.completions.create(model=name, prompt="Compute 3 * 4.", max_tokens=24, temperature=0).choices[0].text
    stop = next(ch for ch in free[1:] if ch.strip())  # a character greedy decoding produces mid-text
    r = oa.completions.create(model=name, prompt="Compute 3 * 4.", max_tokens=24, temperature=0, stop=[stop], n=2)
    for c in r.choices:
        assert stop not in c.text and c.finish_reason == "stop"
        assert c.text == free[:free.index(stop)]


def test_chat_completions_use_the_template(oa, tiny_model):
    _, tok = tiny_model
    msgs = [{"role": "user", "content": "What is 5 + 6?"}]
    r = oa.chat.completions.create(model=_model_name(oa), messages=msgs, n=2, max_tokens=8, logprobs=True,
                                   top_logprobs=3, temperature=0.7, seed=1)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert len(r.choices) == 2 and all(c.message.role == "assistant" for c in r.choices)
    for c in r.choices:
        assert c.logprobs.content, "logprobs=true returns an entry per token"
        for e in c.logprobs.content:
            assert math.isfinite(e.logprob) and e.logprob <= 0
            assert len(e.top_logprobs) == 3
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-5


def test_bad_request_is_a_4xx_through_the_openai_client(oa):
    with pytest.raises(openai.BadRequestError, match="n"):
        oa.completions.create(model=_model_name(oa), prompt="hi", n=10_000)


def test_sampling_controls_this_server_lacks_are_refused_unless_neutral(oa):
    """Presence and frequency penalties and logit_bias were dropped in silence: the caller got plain sampling. Their
    neutral values (what the openai client and vLLM send by default) still pass; min_p and repetition_penalty
    (vLLM's extra parameters) are taken."""
    for extra in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"logit_bias": {"50256": -100}}):
        with pytest.raises(openai.BadRequestError, match=f"{next(iter(extra))}=.* is not supported"):
            oa.completions.create(model=_model_name(oa), prompt="hi", max_tokens=2, extra_body=extra)
    done = oa.completions.create(model=_model_name(oa), prompt="hi", max_tokens=2, presence_penalty=0,
                                 frequency_penalty=0.0, extra_body={"repetition_penalty": 1.0, "min_p": 0.0})
    assert len(done.choices) == 1
    done = oa.completions.create(model=_model_name(oa), prompt="hi", max_tokens=2,
                                 extra_body={"repetition_penalty": 1.3, "min_p": 0.5})
    assert len(done.choices) == 1


def test_a_megabyte_prompt_is_refused_from_its_beginning(oa, tiny_model):
    """A text far longer than the context is refused having tokenized only its beginning: the server would
    otherwise spend seconds on a body of megabytes (64 MiB are accepted) only to find it too long."""
    from alignrl.serve.common import RequestError
    from alignrl.serve.openai_format import PREFIX_CHARS_PER_TOKEN, ChatRequest, chat_prompt, refuse_overlong

    huge = "12 + 7 = 19. " * 100_000  # 1.3 MB
    for call in (lambda: oa.completions.create(model=_model_name(oa), prompt=["hi", huge], max_tokens=2),
                 lambda: oa.chat.completions.create(model=_model_name(oa), max_tokens=2,
                                                    messages=[{"role": "user", "content": huge}])):
        with pytest.raises(openai.BadRequestError, match="more tokens than the model's context"):
            call()
    _, tok = tiny_model
    seen = []

    class Counting:  # the tokenizer, counting the characters it is given to encode
        chat_template = tok.chat_template

        def encode(self, text, **kw):
            seen.append(len(text))
            return tok.encode(text, **kw)

        def apply_chat_template(self, *a, **kw):
            return tok.apply_chat_template(*a, **kw)

    counting = Counting()
    with pytest.raises(RequestError, match="prompt 0 has more tokens"):
        refuse_overlong(counting, huge, 256, "prompt 0")
    assert seen == [257 * PREFIX_CHARS_PER_TOKEN]
    with pytest.raises(RequestError, match="the messages' text has more tokens"):
        chat_prompt(ChatRequest(messages=[{"role": "user", "content": huge}]), counting, 256)
    seen.clear()
    short = "12 + 7 = 19. " * 50  # longer than the context, shorter than the prefix: the exact check says so
    refuse_overlong(counting, short, 256, "prompt 0")
    assert seen == []


def _tokens(url, prompt, **kw):
    r = httpx.post(url + "/v1/generate_tokens", json={"prompts": [prompt], "temperature": 0, "max_tokens": 12, **kw},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_share_engine_calls(gen):
    prompts = [[5 + i, 17, 30 + 2 * i, 44] for i in range(8)]
    solo = [_tokens(gen.url, p)["outputs"][0]["token_ids"] for p in prompts]
    before = httpx.get(gen.url + "/v1/stats").json()
    barrier, got = threading.Barrier(len(prompts)), [None] * len(prompts)

    def fire(i):
        barrier.wait()
        got[i] = _tokens(gen.url, prompts[i])["outputs"][0]["token_ids"]

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = httpx.get(gen.url + "/v1/stats").json()
    assert after["requests"] - before["requests"] == len(prompts)
    # fewer engine calls than requests: some requests shared a call (on a loaded 2-core machine the 8 threads'
    # requests can arrive over more than one 50 ms window: 4 calls for 8 requests were seen)
    assert after["engine_batches"] - before["engine_batches"] < len(prompts)
    assert got == solo  # each request gets its own rows back, unchanged by the company it was batched with


def test_health_answers_while_a_long_batch_runs(gen):
    """/health is answered while the engine is busy with a batch: the batch seen running before the health check is
    still running after its answer (no request was answered in between), not waited for."""
    def stats() -> dict:
        return httpx.get(gen.url + "/v1/stats", timeout=30).json()

    t = threading.Thread(target=httpx.post, args=(gen.url + "/v1/generate_tokens",), daemon=True,
                         kwargs=dict(json={"prompts": [[3, 4, 5]] * 32, "n": 32, "max_tokens": 200, "temperature": 1.0},
                                     timeout=120))
    t.start()
    deadline = time.monotonic() + 60
    while (busy := stats())["running"] == 0:
        assert time.monotonic() < deadline, "the long batch never reached the engine"
        time.sleep(0.01)
    assert httpx.get(gen.url + "/health", timeout=30).json() == {"status": "healthy"}
    after = stats()
    t.join(120)
    assert after["running"] > 0 and after["requests"] == busy["requests"], (busy, after)


def test_seeded_requests_are_reproducible(gen):
    a = _tokens(gen.url, [7, 8, 9], n=4, temperature=1.0, seed=11)
    b = _tokens(gen.url, [7, 8, 9], n=4, temperature=1.0, seed=11)
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]


# --- weight sync and auth, on a server of their own (they change its weights) ---

@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with ServiceProcess(["generate", "--model", str(tiny_model_dir)], env={"ALIGNRL_API_KEY": KEY}) as s:
        yield s


def _greedy(engine, prompts):
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))


def _post_update(url, body, key=KEY):
    return httpx.post(url + "/v1/update_weights", content=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def test_weight_update_auth_and_validation(keyed, tiny_model):
    model, tok = tiny_model
    remote = RemoteRolloutEngine(keyed.url, tok, api_key=KEY, retries=1)
    prompts = [[10, 20, 30], [40, 50]]
    base = _greedy(remote, prompts)
    named = list(model.named_parameters())

    # without or with the wrong token: 401 and nothing changes
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(keyed.url + "/v1/update_weights", content=encode(named, 5), headers=headers)
        assert r.status_code == 401 and "ALIGNRL_API_KEY" in r.json()["error"]["message"]

    # a push without the token is refused before its body is read: announce 10 GB and send none of it
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(keyed.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /v1/update_weights HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 401")  # without the check: no answer until the body came

    body = encode(named, 1)
    shapes = [(n, t.reshape(-1)) if i == 0 else (n, t) for i, (n, t) in enumerate(named)]
    bad = {"truncated": body[:-7], "garbage": b"not a weight update at all",
           "wrong shape": encode(shapes, 1), "wrong dtype": encode([(n, t.double()) for n, t in named], 1),
           "unknown name": encode(named + [("extra.weight", torch.zeros(2))], 1),
           "missing tensor": encode(named[1:], 1), "nan": encode([(n, t * float("nan")) for n, t in named], 1)}
    for what, b in bad.items():
        r = _post_update(keyed.url, b)
        assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
        assert "\n" not in r.json()["error"]["message"]
    assert remote.weight_version() == 0
    again = _greedy(remote, prompts)
    assert torch.equal(again.response_ids, base.response_ids) and torch.equal(again.logprobs, base.logprobs)

    # a valid push: the version advances and the server now samples what a local copy with those weights does
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        torch.manual_seed(0)
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert remote.load_weights(perturbed.named_parameters(), version=3) == 3
    assert remote.weight_version() == 3
    new = _greedy(remote, prompts)
    assert remote.last_version == 3
    assert not torch.equal(new.logprobs, base.logprobs)
    local = _greedy(HFRolloutEngine(perturbed, tok), prompts)
    assert torch.equal(new.response_ids, local.response_ids)
    torch.testing.assert_close(new.logprobs, local.logprobs, atol=1e-4, rtol=0)

    # an old version is refused (409) and leaves version 3 in place
    r = _post_update(keyed.url, encode(named, 2))
    assert r.status_code == 409 and remote.weight_version() == 3
    with pytest.raises(ServiceError, match="HTTP 401"):
        RemoteRolloutEngine(keyed.url, tok, api_key="wrong", retries=1).load_weights(named, version=9)
    assert remote.weight_version() == 3


def test_generation_needs_no_token(keyed):
    r = httpx.post(keyed.url + "/v1/generate_tokens", json={"prompts": [[1, 2]], "max_tokens": 3})
    assert r.status_code == 200


def test_openai_details_nulls_surrogates_and_a_stop_inside_a_character(oa, tiny_model):
    """null for a parameter is "not given" (the openai client sends it for max_tokens=None); a lone surrogate in a
    long chat message is a 400, not the tokenizer's 500; the tokens kept before a stop string are those whose
    text holds the kept text, also when a character spans two byte-level tokens."""
    from alignrl.serve.common import RequestError
    from alignrl.serve.gen_types import GenRow
    from alignrl.serve.openai_format import ChatRequest, CompletionRequest, _finish, chat_prompt

    _, tok = tiny_model
    r = httpx.post(oa.base_url.join("completions").__str__(), json={"prompt": "hi", "max_tokens": None, "n": None,
                                                                      "temperature": 0}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    assert CompletionRequest(prompt="hi", max_tokens=None, top_p=None).max_tokens == 16
    long = ChatRequest(messages=[{"role": "user", "content": "\ud800" + "a" * 9000}])
    with pytest.raises(RequestError, match="message 0 is not valid Unicode"):
        chat_prompt(long, tok, 256)
    ids = tok.encode("café au lait STOP more", add_special_tokens=False)
    text, kept, reason = _finish(tok, GenRow(ids, [0.0] * len(ids), "length"), ["STOP"])
    assert text == "café au lait " and reason == "stop"
    assert tok.decode(ids[:kept]).startswith(text) and not tok.decode(ids[:kept - 1]).startswith(text)


def test_top_logprobs_in_slices_equal_one_pass(tiny_model):
    """A request's alternatives are computed a few rows at a time (bounded memory), with the one pass's values."""
    from alignrl.serve.generate import top_logprobs

    model, tok = tiny_model
    prompts = [tok.encode(p) for p in ("1+1=", "23+4=", "7*8=")]
    responses = [tok.encode(r, add_special_tokens=False) for r in ("2", "27 is it", "56.")]
    whole = top_logprobs(model, prompts, responses, 3, 0.7, tok.pad_token_id)
    sliced = top_logprobs(model, prompts, responses, 3, 0.7, tok.pad_token_id, budget_bytes=1)  # a row at a time
    assert [len(t) for t in whole] == [len(r) for r in responses]
    for a, b in zip(whole, sliced):
        for pa, pb in zip(a, b):
            assert [i for i, _ in pa] == [i for i, _ in pb]
            assert [v for _, v in pa] == pytest.approx([v for _, v in pb], abs=1e-5)
