"""Reference and reward servers as subprocesses, against the in-process computations they replace."""

import threading

import httpx
import pytest
import torch

from alignrl.data.collate import left_pad, right_pad
from alignrl.models.logprobs import response_logprobs
from alignrl.rollout.hf_engine import HFRolloutEngine, SamplingParams
from alignrl.rollout.remote import RemoteRefScorer, ServiceError
from alignrl.rollout.remote_reward import RemoteReward
from alignrl.serve.process import ServiceProcess, start_all

pytestmark = pytest.mark.timeout(240)


def build_reward_model(tiny_model_dir, out):
    """A random sequence-classification head on the tiny LM, saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    return build_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def services(tiny_model_dir, rm_dir):
    procs = [ServiceProcess(["ref", "--model", str(tiny_model_dir), "--batch_window_ms", "50"]),
             ServiceProcess(["reward", "--model", str(rm_dir)])]
    start_all(procs)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def ref(services):
    return services[0]


@pytest.fixture(scope="module")
def reward(services):
    return services[1]


@pytest.fixture(scope="module")
def rollout(tiny_model):
    model, tok = tiny_model
    prompts = [tok.encode(t) for t in ("What is 3 + 4?", "Add 10 and 25.", "12 * 3 =")]
    return HFRolloutEngine(model, tok).generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=5))


def test_health(ref, reward):
    for s, kind in ((ref, "reference"), (reward, "reward")):
        r = httpx.get(s.url + "/health")
        assert r.json() == {"status": "healthy"} and r.headers["X-Alignrl-Service"] == kind


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ref_logprobs_equal_the_local_computation(ref, tiny_model, rollout, temperature):
    model, _ = tiny_model
    remote = RemoteRefScorer(ref.url, temperature=temperature)
    got = remote.logprobs(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    with torch.no_grad():
        want, _ = response_logprobs(model.eval(), rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                    rollout.response_mask, temperature=temperature)
    assert got.shape == rollout.response_ids.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if temperature == 1.0:  # the sampler's own log-probs are the same quantity
        torch.testing.assert_close(got, rollout.logprobs, atol=1e-4, rtol=0)


def test_ref_rows_keep_their_lengths(ref):
    r = httpx.post(ref.url + "/v1/logprobs", json={"prompts": [[1, 2, 3], [4]], "responses": [[5, 6], []]})
    lp = r.json()["logprobs"]
    assert [len(x) for x in lp] == [2, 0] and all(v < 0 for v in lp[0])


def test_ref_concurrent_requests_are_batched(ref):
    before = httpx.get(ref.url + "/v1/stats").json()
    barrier, codes = threading.Barrier(6), []

    def fire(i):
        barrier.wait()
        codes.append(httpx.post(ref.url + "/v1/logprobs", json={"prompts": [[i + 1, 2, 3]], "responses": [[4, 5]]},
                                timeout=60).status_code)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = httpx.get(ref.url + "/v1/stats").json()
    assert codes == [200] * 6 and after["requests"] - before["requests"] == 6
    assert after["engine_batches"] - before["engine_batches"] < 6


def test_reward_scores_equal_the_local_scorer(reward, rm_dir, rollout):
    from alignrl.models.value import ModelScorer

    want = ModelScorer(str(rm_dir)).score(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                          rollout.response_mask)
    got = RemoteReward(reward.url).score(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                         rollout.response_mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got.std() > 0  # different rows, different scores


def test_reward_text_form_equals_token_form(reward, rm_dir, tiny_model):
    from alignrl.models.value import ModelScorer

    _, tok = tiny_model
    prompts, responses = ["What is 2 + 2?", "Name a prime."], [" It is 4.", " 7"]
    got = RemoteReward(reward.url).score_texts(prompts, responses)
    pi = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ri = [tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    (p_ids, pm), (r_ids, rm) = left_pad(pi, tok.pad_token_id), right_pad(ri, tok.pad_token_id)
    want = ModelScorer(str(rm_dir)).score(p_ids, pm, r_ids, rm)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_reward_rejects_mismatched_rows_with_one_line(reward):
    client = RemoteReward(reward.url, retries=1).client
    with pytest.raises(ServiceError) as e:
        client.request("POST", "/v1/score", json={"prompts": ["a", "b"], "responses": ["c"]})
    msg = str(e.value)
    assert "HTTP 400" in msg and "2 prompts but 1 responses" in msg and "\n" not in msg
