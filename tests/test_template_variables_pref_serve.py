"""Variables of the chat template (Qwen3's enable_thinking...) beyond the RL runs: `alignrl train dpo|rm` take
`chat_template_kwargs` (verl's name apply_chat_template_kwargs too) and template their pairs with them; the
generation service's /v1/chat/completions takes vLLM's per-request `chat_template_kwargs` over the server's
`--default_chat_template_kwargs`. Bad values are one line."""

import json
import shutil

import pytest

from alignrl.config import ConfigError
from alignrl.models.loader import load_tokenizer
from alignrl.preference import dpo, rm
from alignrl.preference.cli import dpo_main, parse_dpo, parse_rm, rm_main

pytestmark = pytest.mark.timeout(240)

# Qwen3's switch as its template reads it: with enable_thinking=false the generation prompt holds an empty think block
THINKING = ("{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
OFF = "<think>\n\n</think>\n\n"
MSGS = [{"role": "user", "content": "What is 5 + 6?"}]


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model whose chat template ends with Qwen3's enable_thinking switch."""
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(folder)
    tok.chat_template = tok.chat_template + THINKING
    tok.save_pretrained(str(folder))
    return folder


class _Encoded(Exception):
    """Stops a run once its pairs are encoded: the rows are what is checked, not the training."""


def _rows(monkeypatch, module, train, cfg) -> list[str]:
    """The training prompts `module`'s trainer encodes for `cfg`, as text."""
    from alignrl.data.preference import encode_pairs

    seen = []

    def encode(tok, pairs, max_length, *render):
        rows = encode_pairs(tok, pairs, max_length, *render)
        seen.append([tok.decode(e.prompt, skip_special_tokens=False) for e in rows[0]])
        raise _Encoded

    monkeypatch.setattr(module, "encode_pairs", encode)
    with pytest.raises(_Encoded):
        train(cfg)
    return seen[0]


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_preference_rows_are_templated_with_the_variables(command, thinking_model, tmp_path, monkeypatch):
    module, parse = (dpo, parse_dpo) if command == "dpo" else (rm, parse_rm)
    train = dpo.train_dpo if command == "dpo" else rm.train_rm
    common = [f"model_path={thinking_model}", "max_train_pairs=8", "max_eval_pairs=8", "batch_size=4",
              "report_to=[jsonl]", "max_length=512"]
    if command == "dpo":  # a loss without the two scorers, on the helpful pairs alone
        common += ["loss_type=sigmoid", "train_files=[builtin:helpful]", "eval_files=[builtin:helpful_test]"]
    runs = {}
    for name, extra in (("plain", []), ("off", ["chat_template_kwargs.enable_thinking=false"]),
                        ("verl", ["+apply_chat_template_kwargs.enable_thinking=False"])):
        argv = [*common, *extra, "--output_dir", str(tmp_path / name / "out"),
                "--logging_dir", str(tmp_path / name / "logs")]
        runs[name] = _rows(monkeypatch, module, train, parse(argv))
    assert len(runs["plain"]) == 8 and not any(OFF in p for p in runs["plain"])
    assert all(p.endswith(OFF) for p in runs["off"]), runs["off"][0]
    assert runs["verl"] == runs["off"]
    assert [p.removesuffix(OFF) for p in runs["off"]] == runs["plain"]  # only the variable's text differs


def test_a_yaml_file_sets_them_in_either_name(tmp_path):
    for key in ("chat_template_kwargs", "apply_chat_template_kwargs"):
        path = tmp_path / f"{key}.yaml"
        path.write_text(f"{key}:\n  enable_thinking: false\n  reasoning_effort: low\n")
        assert parse_dpo(["--config", str(path)]).chat_template_kwargs == {"enable_thinking": False,
                                                                         "reasoning_effort": "low"}
    (tmp_path / "null.yaml").write_text("chat_template_kwargs: null\n")
    assert parse_rm(["--config", str(tmp_path / "null.yaml")]).chat_template_kwargs == {}
    (tmp_path / "list.yaml").write_text("chat_template_kwargs: [enable_thinking]\n")
    with pytest.raises(ConfigError, match=r"bad value for 'chat_template_kwargs' \(.*list.yaml\): .* not a mapping"):
        parse_rm(["--config", str(tmp_path / "list.yaml")])


@pytest.mark.parametrize("value", ["5", "[1,2]", "thinking", "{1: 2}"])
def test_a_value_that_is_not_a_mapping_is_one_line(value, capsys):
    for main in (dpo_main, rm_main):
        assert main([f"chat_template_kwargs={value}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "bad value for 'chat_template_kwargs'" in err, err


# ---------------------------------------------------------------- the generation service's chat endpoint


def _client(model, *flags: str):
    from fastapi.testclient import TestClient

    from alignrl.serve import generate

    svc = generate.load_service(generate.parser().parse_args(["--model", str(model), *flags]))
    return svc, TestClient(generate.build_app(svc, 1 << 20))


def _prompt_tokens(client, **extra) -> int:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _length(tok, **variables) -> int:
    ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, **variables)
    return len(ids if isinstance(ids, list) else ids["input_ids"])


def test_the_chat_endpoint_renders_with_a_requests_variables(thinking_model):
    tok = load_tokenizer(thinking_model)
    plain, off = _length(tok), _length(tok, enable_thinking=False)
    assert off > plain
    svc, client = _client(thinking_model)
    try:
        with client:
            assert _prompt_tokens(client) == plain
            assert _prompt_tokens(client, chat_template_kwargs={"enable_thinking": False}) == off
            assert _prompt_tokens(client, chat_template_kwargs={}) == _prompt_tokens(client) == plain  # not kept
            for bad, said in ((5, "must be a JSON object"), ([1], "must be a JSON object"),
                              ("enable_thinking", "must be a JSON object"),
                              ({"tokenize": False}, "tokenize: argument(s) of apply_chat_template itself")):
                r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                                              "chat_template_kwargs": bad})
                msg = r.json()["error"]["message"]
                assert r.status_code == 400 and said in msg and "\n" not in msg, r.text
    finally:
        svc.batcher.close()


def test_the_servers_defaults_apply_unless_a_request_sets_the_variable(thinking_model):
    tok = load_tokenizer(thinking_model)
    svc, client = _client(thinking_model, "--default-chat-template-kwargs", json.dumps({"enable_thinking": False}))
    try:
        with client:
            assert _prompt_tokens(client) == _length(tok, enable_thinking=False)
            assert _prompt_tokens(client, chat_template_kwargs={"enable_thinking": True}) == _length(tok)
    finally:
        svc.batcher.close()


@pytest.mark.parametrize("value, said", [("[1]", "must be a JSON object"), ("{enable_thinking: false}", "not JSON"),
                                         ('{"tokenize": false}', "apply_chat_template itself")])
def test_a_bad_server_default_is_one_line_before_the_model_loads(value, said, capsys):
    from alignrl.serve import generate

    assert generate.main(["--model", "/nonexistent", "--default_chat_template_kwargs", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--default_chat_template_kwargs" in err and said in err, err


def test_a_chat_with_images_renders_with_the_variables_too(tmp_path):
    """A vision-language model's prompt with images is templated by its processor: the request's variables reach
    it through the same per-request view, and the shared processor keeps its own behaviour."""
    import base64

    from PIL import Image

    from alignrl.models.tiny_vl import build_tiny_vl
    from alignrl.models.vision import processor_of

    folder = build_tiny_vl(tmp_path / "tiny-vl", seed=0)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "red.png")
    image = {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode((tmp_path / "red.png").read_bytes()).decode()}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Which color?"}]}]
    svc, client = _client(folder)
    processor_of(svc.tokenizer).chat_template += THINKING
    try:
        with client:
            lengths = [_prompt_tokens(client, messages=messages, **extra)
                       for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {})]
    finally:
        svc.batcher.close()
    plain, off, again = lengths
    assert off > plain == again
