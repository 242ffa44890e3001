"""The HTTP clients: retries, backoff and one-line errors against stub servers; parity of the remote
rollout engine with the in-process one against a live generation server."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.rollout.remote import RemoteRefScorer, RemoteRolloutEngine, ServiceClient, ServiceError, rollout_from_rows
from alignrl.rollout.remote_reward import RemoteReward
from alignrl.runtime.ports import free_port

pytestmark = pytest.mark.timeout(120)  # backoff and timeout bounds: lower bounds, and upper ones far above them


class Stub:
    """A loopback HTTP server answering from a script of (status, body, delay) and counting requests."""

    def __init__(self, script, port: int = 0):
        self.script, self.hits = list(script), 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                status, body, delay, *headers = stub.script[min(stub.hits, len(stub.script) - 1)]
                stub.hits += 1
                time.sleep(delay)
                data = b"" if body is None else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    for name, value in (headers[0] if headers else {}).items():
                        self.send_header(name, value)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    made = []

    def make(script):
        made.append(Stub(script))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("make, hint", [
    (lambda url: RemoteRolloutEngine(url, _Tok(), retries=3, backoff=0.2).generate([[1, 2]], SamplingParams()),
     "alignrl serve generate --model PATH --port"),
    (lambda url: RemoteRefScorer(url, retries=3, backoff=0.2).logprobs(*[torch.ones(1, 2, dtype=torch.long)] * 4),
     "alignrl serve ref --model PATH --port"),
    (lambda url: RemoteReward(url, retries=3, backoff=0.2).score_texts(["a"], ["b"]),
     "alignrl serve reward --model RM_PATH --port"),
])
def test_dead_port_gives_one_line_error_after_backoff(make, hint):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as e:
        make(url)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert f"at {url} is not reachable after 3 tries" in msg and f"{hint} {port}" in msg
    assert 0.6 <= elapsed < 30  # backoff 0.2 s then 0.4 s between the three tries, then give up


def test_a_service_on_another_host_is_told_to_listen_beyond_its_loopback():
    """Seed 000 starts its services on gpu004/gpu008 without --host, where they listen on loopback only: the
    trainer's line says how to open them (it said "start it", though the service was running)."""
    port = free_port()
    with pytest.raises(ServiceError) as e:
        RemoteRefScorer(f"http://127.0.0.2:{port}", retries=1).logprobs(*[torch.ones(1, 2, dtype=torch.long)] * 4)
    assert (f"alignrl serve ref --model PATH --port {port} --host 0.0.0.0` on 127.0.0.2 with ALIGNRL_API_KEY set"
            in str(e.value)) and "\n" not in str(e.value)


def test_5xx_is_retried_then_succeeds(stub):
    s = stub([(500, {"error": {"message": "busy"}}, 0), (503, {}, 0), (200, {"weight_version": 7}, 0)])
    assert ServiceClient(s.url, "generation", retries=3, backoff=0.01).request("GET", "/v1/weight_version") == \
        {"weight_version": 7}
    assert s.hits == 3


def test_persistent_5xx_names_the_status_and_message(stub):
    s = stub([(500, {"error": {"message": "engine crashed"}}, 0)])
    with pytest.raises(ServiceError, match=r"kept failing after 2 tries \(HTTP 500: engine crashed\)"):
        ServiceClient(s.url, "reference", retries=2, backoff=0.01).request("POST", "/v1/logprobs", json={})
    assert s.hits == 2


def test_4xx_fails_at_once_with_the_server_message(stub):
    s = stub([(400, {"error": {"message": "prompt 0 is empty; every prompt needs at least one token"}}, 0)])
    with pytest.raises(ServiceError) as e:
        ServiceClient(s.url, "generation", retries=3, backoff=0.01).request("POST", "/v1/generate_tokens", json={})
    assert s.hits == 1 and e.value.status == 400 and "prompt 0 is empty" in str(e.value)


def test_slow_server_times_out_within_bounds(stub):
    s = stub([(200, {}, 30)])  # far beyond the client's timeouts and backoffs
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match="ReadTimeout"):
        ServiceClient(s.url, "reward", timeout=0.3, retries=2, backoff=0.01).request("GET", "/x")
    assert time.monotonic() - t0 < 15  # gave up after two 0.3 s timeouts, not the 30 s answer


def test_configured_services_are_checked_before_a_run_loads_its_model(stub):
    """`check_services` asks each configured service's /health with the configured tries: a healthy one and vLLM's
    empty 200 pass; a dead port and a program that has no /health are one line naming the service."""
    from alignrl.config import load_config
    from alignrl.rollout.service_health import check_services

    healthy, other = stub([(200, {"status": "healthy"}, 0)]), stub([(404, {"detail": "Not Found"}, 0)])
    check_services(load_config(None, [f"services.generation_url={healthy.url}", f"services.reference_url={healthy.url}",
                                      "actor.use_kl_loss=true"]))
    assert healthy.hits == 2
    vllm = stub([(200, "", 0)])  # vLLM's own server: an empty 200
    vllm.script = [(200, None, 0)]
    check_services(load_config(None, [f"services.generation_url={vllm.url}"]))
    assert vllm.hits == 1
    # a reference the run never asks (no KL term) is not asked either: a config may name one that is down
    check_services(load_config(None, [f"services.reference_url=http://127.0.0.1:{free_port()}",
                                      "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]))
    check_services(load_config(None, []))  # nothing configured: nothing asked
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServiceError) as e:
        check_services(load_config(None, [f"services.reference_url={healthy.url}", f"services.reward_url={dead}",
                                          "services.retries=1", "services.wait_s=0"]))
    assert str(e.value).startswith(f"reward service at {dead} is not reachable after 1 tries") and "\n" not in str(e.value)
    with pytest.raises(ServiceError, match=r"reference service at .* rejected GET /health \(HTTP 404\)"):
        check_services(load_config(None, [f"services.reference_url={other.url}", "actor.use_kl_loss=true"]))
    # swapped URLs: alignrl's services say what they are in a header; the run failed later with a 404
    gen = stub([(200, {"status": "healthy"}, 0, {"X-Alignrl-Service": "generation"})])
    with pytest.raises(ServiceError) as e:
        check_services(load_config(None, [f"services.generation_url={gen.url}", f"services.reference_url={gen.url}",
                                          "actor.use_kl_loss=true"]))
    assert str(e.value) == (f"services.reference_url={gen.url} is a generation service, not a reference service: "
                            "are the service URLs swapped?")


def test_a_service_that_starts_late_is_waited_for(stub, capsys):
    """A service binds its port once its model is loaded: `serve ... &` then `train` found it refusing connections."""
    from alignrl.config import load_config
    from alignrl.rollout.service_health import check_services

    port = free_port()
    late: list = []
    threading.Timer(1.5, lambda: late.append(Stub([(200, {"status": "healthy"}, 0)], port))).start()
    try:
        check_services(load_config(None, [f"services.reward_url=http://127.0.0.1:{port}", "services.retries=1",
                                          "services.wait_s=20"]))
    finally:
        for s in late:
            s.close()
    assert late and late[0].hits >= 1
    said = capsys.readouterr()  # on stderr: the launch scripts read their plan from stdout
    assert said.out == "" and f"waiting up to 20 s for the reward service at http://127.0.0.1:{port}" in said.err


def test_an_unreachable_service_stops_a_run_before_its_model_loads(tmp_path):
    from conftest import src_path

    dead = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "alignrl", "train", "grpo", f"services.reward_url={dead}",
                          "services.wait_s=0",
                          f"trainer.output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": src_path()})
    err = out.stderr.strip()
    assert out.returncode == 2 and "\n" not in err and f"reward service at {dead} is not reachable" in err, err
    assert not (tmp_path / "out").exists() and "accuracy" not in out.stdout  # no run folder, no base evaluation
    # with a checkpoint of the run, the line says where the same command continues once the service answers
    from alignrl.config import load_config
    from alignrl.train.checkpoint import write_manifest

    argv = [f"services.reward_url={dead}", "services.wait_s=0", f"trainer.output_dir={tmp_path / 'out'}"]
    done = load_config(None, argv).checkpoint_root / "global_step_2"
    done.mkdir(parents=True)
    torch.save({"step": 2}, done / "trainer_state.pt")
    write_manifest(done)
    out = subprocess.run([sys.executable, "-m", "alignrl", "train", "grpo", *argv], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": src_path()})
    assert out.stderr.strip().endswith(f"; once it answers, the same command continues from {done}"), out.stderr
    from alignrl.cli import _resume_note  # a mistake in the settings (swapped URLs) is not an outage: no such note

    assert _resume_note(ServiceError("services.reference_url=... is a generation service"), load_config(None, argv)) \
        == ""


def test_samples_from_weights_this_run_did_not_push_stop_the_run(stub):
    """Two runs sharing one generation service (or the service restarted): the run sampled from the other run's
    weights with nothing failing (seen as spikes of rollout/kl_vs_trainer)."""
    row = {"token_ids": [5], "logprobs": [-0.5], "finish_reason": "stop"}
    s = stub([(200, {"weight_version": 1, "tensors": {"w": {"shape": [1], "dtype": "float32"}}}, 0),  # manifest
              (200, {"weight_version": 1}, 0),  # the served version, before the push
              (200, {"weight_version": 2}, 0),  # the push
              (200, {"outputs": [row], "weight_version": 2}, 0),  # sampled with this run's weights
              (200, {"outputs": [row], "weight_version": 3}, 0)])  # another run pushed meanwhile
    engine = RemoteRolloutEngine(s.url, _Tok(), retries=1)
    assert engine.load_weights([("w", torch.zeros(1))]) == 2
    engine.generate([[1, 2]], SamplingParams(n=1))
    with pytest.raises(ServiceError) as e:
        engine.generate([[1, 2]], SamplingParams(n=1))
    assert str(e.value).startswith(f"generation service at {s.url} serves weight version 3, not the 2 this run "
                                   "pushed last: another run pushes its weights there, or the service restarted")


def test_a_refused_token_says_what_to_set(stub):
    s = stub([(401, {"error": {"message": "missing or wrong bearer token"}}, 0)])
    with pytest.raises(ServiceError) as e:
        ServiceClient(s.url, "generation", retries=1).request("POST", "/v1/update_weights")
    assert str(e.value) == (f"generation service at {s.url} refused this run's bearer token (HTTP 401): set "
                            "ALIGNRL_API_KEY here to the key the service was started with")


def test_bad_url_is_rejected():
    with pytest.raises(ServiceError, match="must start with http://"):
        RemoteReward("127.0.0.1:8002")


def test_rows_that_do_not_fit_the_prompts_are_an_error():
    with pytest.raises(ServiceError, match="rows"):
        rollout_from_rows([[1, 2]], 2, [([3], [-0.1], False)], pad_id=0)


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def _prompts(tok):
    return [tok.encode(t) for t in ("What is 3 + 4?", "Add 10 and 25 then double it.", "7 * 8 =", "1")]


def test_remote_greedy_rollout_equals_local(base_generation, tiny_model):
    model, tok = tiny_model
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=14)
    local = HFRolloutEngine(model, tok).generate(_prompts(tok), params)
    remote = RemoteRolloutEngine(base_generation.url, tok).generate(_prompts(tok), params)
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated", "group"):
        a, b = getattr(remote, f), getattr(local, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    torch.testing.assert_close(remote.logprobs, local.logprobs, atol=1e-4, rtol=0)


def test_remote_sampled_rollout_layout_and_chunking(base_generation, tiny_model):
    _, tok = tiny_model
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=4)
    whole = RemoteRolloutEngine(base_generation.url, tok).generate(_prompts(tok), params)
    chunked = RemoteRolloutEngine(base_generation.url, tok, max_seqs_per_request=3).generate(_prompts(tok), params)
    assert whole.group.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    lengths = whole.response_mask.sum(1)
    assert torch.equal(whole.truncated, lengths == 10)
    assert torch.equal(whole.response_mask, torch.arange(whole.response_mask.shape[1]) < lengths[:, None])
    assert bool((whole.logprobs[whole.response_mask] < 0).all())
    assert bool((whole.logprobs[~whole.response_mask] == 0).all())
    # one request per prompt (3 sequences each) gives the same layout
    assert chunked.response_ids.shape[0] == 12 and torch.equal(chunked.group, whole.group)
