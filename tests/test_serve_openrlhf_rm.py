"""`alignrl serve reward --protocol openrlhf --reward_pretrain RM` (OpenRLHF's `openrlhf.cli.serve_rm`) against the
in-process scorer it wraps: the eos OpenRLHF appends, normalization from config.json, truncation to --max_len,
forward passes of --batch_size, one-line errors, and the loop's RemoteReward on /get_reward; plus
`--normalize_reward` on the native /v1/score."""

import json
import shutil
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from alignrl.serve import openrlhf_rm, reward

MEAN, STD = 0.25, 2.0  # what `alignrl train rm` writes into a reward model's config.json
QUERIES = ["What is 3 + 4? 7", "Add 10 and 25. The sum is 35", "12 * 3 = 36", "I am done", "x"]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A random sequence-classification head on the tiny LM, with its tokenizer and a score mean and std."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model.config.pad_token_id = tok.pad_token_id
    model.config.mean, model.config.std = MEAN, STD
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tok(rm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(rm_dir))


@pytest.fixture(scope="module")
def scorer(rm_dir):
    from alignrl.models.value import ModelScorer

    return ModelScorer(str(rm_dir), log=lambda *_: None)


def one_by_one(scorer, rows: list[list[int]]) -> list[float]:
    """Each row scored alone (no padding): what the server's batched answer must equal."""
    empty = torch.zeros((1, 0), dtype=torch.long)
    return [scorer.score(torch.tensor([r]), torch.ones((1, len(r)), dtype=torch.bool), empty, empty.bool()).item()
            for r in rows]


def serve(rm_dir, *flags: str) -> tuple[openrlhf_rm.OpenRLHFRewardModel, TestClient]:
    args = openrlhf_rm.parser().parse_args(["--reward_pretrain", str(rm_dir), "--batch_window_ms", "0", *flags])
    assert openrlhf_rm.flag_problem(args) is None
    svc = openrlhf_rm.load_service(args)
    return svc, TestClient(openrlhf_rm.build_app(svc, 1 << 20))


@pytest.fixture(scope="module")
def plain(rm_dir):
    return serve(rm_dir)


def rewards(client: TestClient, queries: list[str], **extra) -> list[float]:
    r = client.post("/get_reward", json={"query": queries, **extra})
    assert r.status_code == 200, r.text
    return r.json()["rewards"]


def test_scores_are_the_scorers_on_each_query_with_one_eos(plain, scorer, tok):
    _, client = plain
    eos, pad = tok.eos_token, tok.pad_token
    # pad and eos already at the ends (a decoded rollout's) are removed before the one eos is appended
    sent = [QUERIES[0], QUERIES[1] + eos, pad + pad + QUERIES[2] + eos + pad, QUERIES[3] + eos, QUERIES[4]]
    got = rewards(client, sent, prompts=["ignored"] * 5, labels=[None] * 5)
    want = one_by_one(scorer, [tok(q + eos)["input_ids"] for q in QUERIES])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert len(set(round(x, 6) for x in got)) == len(got)  # different queries, different scores
    # without the appended eos the score is another one: it is read at the eos
    bare = one_by_one(scorer, [tok(QUERIES[0])["input_ids"]])[0]
    assert abs(bare - got[0]) > 1e-6
    # "I am done": whole tokens are stripped, not their characters (OpenRLHF's str.strip would cut "ne")
    assert abs(got[3] - one_by_one(scorer, [tok("I am do" + eos)["input_ids"]])[0]) > 1e-6


def test_normalize_reward_uses_the_config_mean_and_std(rm_dir, plain, capsys):
    capsys.readouterr()
    _, client = serve(rm_dir, "--normalize_reward", "--flash_attn")
    said = [line for line in capsys.readouterr().err.splitlines() if "--flash_attn" in line]
    assert len(said) == 1 and "not used" in said[0]
    raw = torch.tensor(rewards(plain[1], QUERIES))
    torch.testing.assert_close(torch.tensor(rewards(client, QUERIES)), (raw - MEAN) / STD, atol=1e-5, rtol=0)


def test_a_long_query_keeps_its_first_max_len_tokens(rm_dir, scorer, tok):
    _, client = serve(rm_dir, "--max_len", "6")
    long = "Add 10 and 25, then multiply the sum by 3, and say what it is"
    ids = tok(long + tok.eos_token)["input_ids"]
    assert len(ids) > 6
    got = rewards(client, [long, "x"])
    want = one_by_one(scorer, [ids[:6], tok("x" + tok.eos_token)["input_ids"]])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert abs(got[0] - one_by_one(scorer, [ids])[0]) > 1e-6  # the whole query would score otherwise


def test_batch_size_splits_forwards_without_changing_scores(rm_dir, plain):
    svc, client = serve(rm_dir, "--batch_size", "2")
    sizes = []
    score = svc.scorer.score

    def counted(ids, *rest):
        sizes.append(ids.shape[0])
        return score(ids, *rest)

    svc.scorer.score = counted
    got = rewards(client, QUERIES)
    assert sizes == [2, 2, 1]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(rewards(plain[1], QUERIES)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("body, words", [
    ({"prompts": ["a"]}, "query: Field required"),
    ({"query": []}, "at least 1 item"),
    ({"query": ["a", 3]}, "query.1: Input should be a valid string"),
    ({"query": "one text"}, "valid list"),
    ('{"query": ["\\ud800"]}', "not valid Unicode"),
    ('{"query": [', "not valid JSON"),
])
def test_bad_requests_are_one_line_400s(plain, body, words):
    _, client = plain
    r = (client.post("/get_reward", content=body, headers={"Content-Type": "application/json"})
         if isinstance(body, str) else client.post("/get_reward", json=body))
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and words in message and "\n" not in message


def test_too_many_queries_are_refused_in_one_line(rm_dir):
    _, client = serve(rm_dir, "--max_request_seqs", "2")
    r = client.post("/get_reward", json={"query": ["a", "b", "c"]})
    assert r.status_code == 413 and "at most 2" in r.json()["error"]["message"]


def test_the_loops_remote_reward_gets_the_same_scores(plain, scorer, tok):
    """A run's `services.reward_url=http://127.0.0.1:PORT/get_reward`, over a real socket."""
    import uvicorn

    from alignrl.data.collate import left_pad, right_pad
    from alignrl.rollout.remote_reward import RemoteReward
    from alignrl.serve.common import address, bind

    svc, _ = plain
    sock = bind("127.0.0.1", 0)
    sock.listen()  # a connection made before the server runs waits in the backlog instead of being refused
    url = address(sock)
    server = uvicorn.Server(uvicorn.Config(openrlhf_rm.build_app(svc, 1 << 20), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    remote = RemoteReward(url + "/get_reward", tokenizer=tok, retries=1)
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started, "the reward server did not start within 60 s"
        prompts, responses = ["What is 3 + 4?", "Add 10 and 25."], [" 7", " The sum is 35"]
        want = one_by_one(scorer, [tok(p + r + tok.eos_token)["input_ids"] for p, r in zip(prompts, responses)])
        got = remote.score_texts(prompts, responses, labels=["7", "35"])
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        # token ids as a rollout holds them: responses end in eos, the server takes it off and puts one back
        p_ids, p_mask = left_pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id)
        r_ids, r_mask = right_pad([tok(r)["input_ids"] + [tok.eos_token_id] for r in responses], tok.pad_token_id)
        torch.testing.assert_close(remote.score(p_ids, p_mask, r_ids, r_mask), torch.tensor(want), atol=1e-5, rtol=0)
    finally:
        remote.close()
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive(), "the reward server did not stop within 60 s"


@pytest.mark.parametrize("flags, words", [
    (["--load_in_4bit"], "--load_in_4bit: 4-bit loading is not supported"),
    (["--value_head_prefix", "v_head"], "--value_head_prefix v_head"),
    (["--max_len", "0"], "--max_len must be at least 1"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
])
def test_flags_alignrl_cannot_honour_are_one_line_errors(rm_dir, capsys, flags, words):
    code = reward.main(["--protocol", "openrlhf", "--reward_pretrain", str(rm_dir), "--port", "0", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err
    assert err.startswith("alignrl serve reward --protocol openrlhf: error:")


def test_protocol_openrlhf_without_a_model_is_still_the_rule_reward(capsys):
    with pytest.raises(SystemExit) as ended:
        reward.main(["--protocol", "openrlhf", "--input_key", "message"])
    assert ended.value.code == 2 and "--dataset" in capsys.readouterr().err
    args = openrlhf_rm.parser().parse_args(["--reward_pretrain", "x", "--value_head_prefix", "score"])
    assert openrlhf_rm.flag_problem(args) is None and args.port == 5000 and args.host == "127.0.0.1"


def test_a_folder_openrlhfs_reward_trainer_saved_scores_as_the_same_model_does(rm_dir, tmp_path):
    """OpenRLHF saves its reward model under the class name RewardModel, with its head as value_head (its older
    default); both load, and score as the sequence-classification folder with the same weights."""
    from safetensors.torch import load_file, save_file

    from alignrl.models.folder import ModelError
    from alignrl.models.value import ModelScorer, check_scorer_folder

    folder = tmp_path / "openrlhf_rm"
    shutil.copytree(rm_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["RewardModel"]}))
    check_scorer_folder(str(folder), "algorithm.reward_model")  # accepted before anything loads
    ids, mask = torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 4, dtype=torch.bool)
    theirs = ModelScorer(str(folder)).score(ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:])
    ours = ModelScorer(str(rm_dir)).score(ids[:, :2], mask[:, :2], ids[:, 2:], mask[:, 2:])
    assert torch.equal(theirs, ours)
    svc = openrlhf_rm.load_service(openrlhf_rm.parser().parse_args(["--reward_pretrain", str(folder)]))
    assert torch.equal(svc.scorer.model.score.weight, weights["value_head.weight"])
    from alignrl.models.value import load_value_model

    critic = load_value_model(str(folder))  # a critic initialised from it starts from its head, as OpenRLHF's does
    assert torch.equal(critic.score.weight, weights["value_head.weight"])
    critic.save_pretrained(tmp_path / "critic")  # and saves it under transformers' name, as its config.json says
    assert "score.weight" in load_file(str(tmp_path / "critic" / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["CriticModel"]}))
    with pytest.raises(ModelError, match="is not a reward/cost model"):  # OpenRLHF's critic scores values, not rewards
        check_scorer_folder(str(folder), "algorithm.reward_model")


def test_native_score_protocol_normalizes_too(rm_dir):
    def client(*flags: str) -> TestClient:
        svc = reward.load_service(reward.parser().parse_args(["--model", str(rm_dir), "--batch_window_ms", "0",
                                                              *flags]))
        return TestClient(reward.build_app(svc, 1 << 20))

    body = {"prompts": ["What is 3 + 4?", "Add 10 and 25."], "responses": [" 7", " 35"]}
    raw = torch.tensor(client().post("/v1/score", json=body).json()["scores"])
    got = torch.tensor(client("--normalize_reward").post("/v1/score", json=body).json()["scores"])
    torch.testing.assert_close(got, (raw - MEAN) / STD, atol=1e-5, rtol=0)
    assert json.loads((rm_dir / "config.json").read_text())["std"] == STD
