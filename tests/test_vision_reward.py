"""The R1 rule reward (format + math accuracy) and OpenRLHF's remote reward protocol: `alignrl serve reward
--protocol openrlhf` (and LMM-R1's module spelling `python -m openrlhf.models.remote_rm.math_verifier`) answering
the request OpenRLHF's `remote_rm_fn` sends, its one-line 400s, and the loop's `RemoteReward` speaking the protocol
when its URL names an endpoint (http://host:port/get_reward)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from alignrl.rewards import think_answer
from alignrl.rewards.registry import default_compute_score
from alignrl.serve.process import ServiceProcess
from conftest import src_path

ROOT = Path(__file__).parents[1]
CHAT = "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
PICTURE = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"


def chat_row(text: str, answer: str, image: str | None = "/tmp/x.png") -> dict:
    """A chatml row as seed 001's data holds it: `message` a JSON string of an OpenAI-style message list."""
    content = ([{"type": "image", "image": f"file://{image}"}] if image else []) + [{"type": "text", "text": text}]
    return {"message": json.dumps([{"role": "user", "content": content}]), "answer": answer}


ROWS = [chat_row("Problem 1: how many red shapes?", "3"), chat_row("Problem 2: what is 1/2 + 1/4?", "\\frac{3}{4}"),
        chat_row("Which bar is taller?", "2", "/tmp/a.png"), chat_row("Which bar is taller?", "1", "/tmp/b.png"),
        {"message": "Plain question: 6 times 7?", "answer": "$42$"}]


@pytest.mark.parametrize("response, answer, want", [
    ("<think>three red ones</think><answer>3</answer>", "3", 1.5),  # form and answer
    ("<think>x</think>\n<answer>\\boxed{3}</answer>", "3", 1.5),  # a newline between the blocks, a boxed answer
    ("<answer>3</answer>", "3", 1.0),  # right answer, no think block
    ("the answer is 3", "3", 1.0),  # no tags: the whole response is read
    ("<think>hm</think><answer>4</answer>", "3", 0.5),  # well formed, wrong
    ("<think>a</think><answer>0.75</answer>", "\\frac{3}{4}", 1.5),  # equal as numbers
    ("<think>a</think><answer>1</answer><answer>3</answer>", "3", 1.0),  # two answers: no format bonus, the last read
    ("<think>a</think><answer>3</answer> and more", "3", 1.0),  # text after the answer block
    ("", "3", 0.0),
])
def test_rule_reward_is_format_plus_accuracy(response, answer, want):
    assert think_answer.score(response, answer) == want
    assert default_compute_score(think_answer.DATA_SOURCE, response, answer) == want  # the loop's data_source


def start_server(data: Path, *extra: str, command=()) -> ServiceProcess:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), src_path()])}
    return ServiceProcess([*([] if command else ["reward", "--protocol", "openrlhf"]), "--dataset", str(data),
                           "--input_key", "message", "--prompt-template", "chatml", *extra], env=env,
                          command=command, startup_s=120.0).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """LMM-R1's module spelling, as seed 001's vision script starts it, from the repository root."""
    data = tmp_path_factory.mktemp("rows") / "rows.json"
    data.write_text(json.dumps(ROWS))
    proc = start_server(data, command=[sys.executable, "-m", "openrlhf.models.remote_rm.math_verifier"])
    try:
        yield proc
    finally:
        proc.stop()


def post(server, body, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(server.url + "/get_reward", content=raw, headers={"Content-Type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + "/get_reward", json=body, timeout=60)


def test_openrlhfs_request_gets_format_plus_accuracy(server):
    """OpenRLHF's remote_rm_fn body: queries are prompt + response with the chat tokens, prompts the prompts, labels
    empty strings (no --label_key). Each finds its row by the prompt's user turn, the image's tokens left out."""
    prompts = [CHAT.format(user=PICTURE + "Problem 1: how many red shapes?"),
               CHAT.format(user="Problem 2: what is 1/2 + 1/4?"), CHAT.format(user="Plain question: 6 times 7?"),
               ROWS[0]["message"]]
    responses = ["<think>count</think><answer>3</answer><|im_end|>", "<answer>0.75</answer><|endoftext|>",
                 "<think>6*7</think><answer>41</answer><|im_end|>", "<think>x</think><answer>3</answer>"]
    r = post(server, {"query": [p + s for p, s in zip(prompts, responses)], "prompts": prompts,
                      "labels": [""] * 4})
    assert r.status_code == 200, r.text
    assert r.json() == {"rewards": [1.5, 1.0, 0.5, 1.5]}  # the last: LMM-R1's raw prompt value (the file's string)
    # OpenRLHF before 0.6 sends queries alone: the prompt is what comes before the assistant turn
    r = post(server, {"query": [prompts[0] + responses[0]]})
    assert r.status_code == 200 and r.json() == {"rewards": [1.5]}, r.text
    assert httpx.get(server.url + "/health", timeout=30).headers["X-Alignrl-Service"] == "reward"


def test_shared_user_text_needs_the_raw_prompt_or_a_label(server):
    """Two rows ask the same question of different images: their rendered prompts look alike, so the label decides,
    or the prompt as the file holds it; without either the request is refused rather than scored on a guess."""
    prompt = CHAT.format(user=PICTURE + "Which bar is taller?")
    r = post(server, {"query": [prompt + "<think>t</think><answer>1</answer>"], "prompts": [prompt]})
    assert r.status_code == 400 and "different answers" in r.json()["error"]["message"], r.text
    r = post(server, {"query": [prompt + "<think>t</think><answer>1</answer>"] * 2, "prompts": [prompt] * 2,
                      "labels": ["1", "2"]})
    assert r.json() == {"rewards": [1.5, 0.5]}, r.text
    raw = ROWS[3]["message"]
    r = post(server, {"query": ["<think>t</think><answer>1</answer>"], "prompts": [raw]})
    assert r.json() == {"rewards": [1.5]}, r.text


@pytest.mark.parametrize("body, raw, words", [
    ({"query": ["x"], "prompts": [CHAT.format(user="never asked")]}, None, "is in no row of the server's --dataset"),
    (None, b"{not json", "not valid JSON"),
    ({"prompts": ["a"]}, None, "query"),
    ({"query": "a single string"}, None, "query"),
    ({"query": [], "prompts": []}, None, "query"),
    ({"query": ["a", "b"], "prompts": ["a"]}, None, "1 prompts for 2 queries"),
    ({"query": ["a"], "prompts": ["a"], "labels": ["1", "2"]}, None, "2 labels for 1 queries"),
])
def test_bad_requests_are_one_line_400s(server, body, raw, words):
    r = post(server, body, raw)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message, message


@pytest.mark.parametrize("rows, words", [
    ("[{\"prompt\": \"q\", \"answer\": \"1\"}]", "has no 'message'"),
    ("{broken", "is not valid JSON/JSONL"),
    (None, "does not exist"),
])
def test_bad_datasets_are_one_line(tmp_path, rows, words):
    data = tmp_path / "rows.json"
    if rows is not None:
        data.write_text(rows)
    out = subprocess.run([sys.executable, "-m", "alignrl", "serve", "reward", "--protocol", "openrlhf", "--dataset",
                          str(data), "--input_key", "message", "--port", "0"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": src_path()})
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr


class Tokens:
    """A tokenizer of one character per id (chat tokens included as ids of their own), for the client's decoding."""

    SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

    def ids(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            hit = next((s for s in self.SPECIAL if text.startswith(s, i)), None)
            out.append(1000 + self.SPECIAL.index(hit) if hit else ord(text[i]))
            i += len(hit) if hit else 1
        return out

    def batch_decode(self, rows, skip_special_tokens=False):
        assert not skip_special_tokens  # OpenRLHF decodes with the chat tokens: the server finds the turns by them
        return ["".join(self.SPECIAL[t - 1000] if t >= 1000 else chr(t) for t in row) for row in rows]


def test_remote_reward_speaks_openrlhfs_protocol_for_an_endpoint_url(server):
    """--remote_rm_url http://host:port/get_reward: the loop's RemoteReward decodes the token rows (left-padded
    prompts, right-padded responses) and posts OpenRLHF's body; the doubled slash of LMM-R1's scripts is one."""
    from alignrl.data.collate import left_pad, right_pad
    from alignrl.rollout.remote_reward import RemoteReward, reward_endpoint

    assert reward_endpoint("http://h:5000//get_reward") == ("http://h:5000", "/get_reward")
    assert reward_endpoint("http://h:8002") == ("http://h:8002", None)
    assert reward_endpoint("http://h:8002/v1/score") == ("http://h:8002", None)
    tok = Tokens()
    prompts = [CHAT.format(user=PICTURE + "Problem 1: how many red shapes?"), CHAT.format(user="Which bar is taller?")]
    responses = ["<think>a</think><answer>3</answer><|im_end|>", "<think>b</think><answer>2</answer>"]
    pi, pm = left_pad([tok.ids(p) for p in prompts], 0)
    ri, rm = right_pad([tok.ids(r) for r in responses], 0)
    assert not rm[1].all()  # the shorter second response is padded: its padding (id 0) would break the format
    reward = RemoteReward(server.url + "/get_reward", tokenizer=tok, max_rows=1)
    assert reward.takes_labels
    scores = reward.score(pi, pm, ri, rm, labels=["", "1"])  # the label picks the answer of the shared question
    assert torch.equal(scores, torch.tensor([1.5, 0.5])), scores
    assert reward.score_texts(prompts[:1], ["<answer>3</answer>"]) == [1.0]
    with pytest.raises(Exception, match="different answers"):
        reward.score(pi, pm, ri, rm)  # the shared question without its label
    reward.client.close()


def test_run_checks_an_endpoint_url_at_its_service_root(server, http_servers):
    """check_services asks the service's /health, not <endpoint>/health; a server of the protocol that has no
    /health (LMM-R1's own) answers 404 there, which still says it is up."""
    from http.server import BaseHTTPRequestHandler

    from alignrl.config import load_config
    from alignrl.rollout.service_health import check_services

    cfg = load_config(None, [f"services.reward_url={server.url}//get_reward", "services.wait_s=0"])
    check_services(cfg, wait_s=0)

    class NoHealth(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    check_services(load_config(None, [f"services.reward_url={http_servers(NoHealth)}/get_reward"]), wait_s=0)


def test_the_loops_reward_stage_scores_through_the_protocol(server, tmp_path):
    """The reward stage with a RemoteReward of the policy's tokenizer (a tiny Qwen2-VL's) as its reward model: the
    rollout's token rows are decoded with their chat and image tokens, the server finds each row by its prompt, and its
    rewards are the stage's; correctness stays the rule's on the rows' ground truth."""
    from alignrl.data.collate import left_pad, right_pad
    from alignrl.data.records import Rollout, Sample
    from alignrl.models.tiny_vl import build_tiny_vl
    from alignrl.models.vision import load_processor
    from alignrl.rewards.registry import load_reward_fn
    from alignrl.rl.scoring import RewardStage
    from alignrl.rollout.remote_reward import RemoteReward

    texts = [r["message"] for r in ROWS] + ["<think>count</think><answer>3</answer> 0.75"] * 5
    tok = load_processor(build_tiny_vl(tmp_path / "vl", seed=0, texts=texts)).tokenizer
    prompts = [CHAT.format(user=PICTURE + "Problem 1: how many red shapes?"),
               CHAT.format(user="Problem 2: what is 1/2 + 1/4?")]
    responses = ["<think>count</think><answer>3</answer><|im_end|>", "<think>c</think><answer>0.7</answer><|im_end|>"]
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    pi, pm = left_pad([ids(p) for p in prompts], tok.pad_token_id)
    ri, rm = right_pad([ids(r) for r in responses], tok.pad_token_id)
    ro = Rollout(prompt_ids=pi, prompt_mask=pm, response_ids=ri, response_mask=rm, logprobs=torch.zeros(ri.shape),
                 truncated=torch.zeros(2, dtype=torch.bool), group=torch.arange(2))
    samples = [Sample(messages=[{"role": "user", "content": "q"}], ground_truth=a, data_source="think_answer")
               for a in ("3", "\\frac{3}{4}")]
    rule = load_reward_fn(None)
    stage = RewardStage(tok, rule, rule, 16, reward_model=RemoteReward(server.url + "/get_reward", tokenizer=tok))
    scores = stage.score(ro, samples)
    assert scores.rewards.tolist() == [1.5, 0.5] and scores.correct.tolist() == [True, False]
    stage.reward_model.client.close()
