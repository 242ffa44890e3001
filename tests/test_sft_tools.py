"""SFT rows with tools (verl's multi-turn tool SFT, TRL's `tools` column): the row's tool schemas reach the chat
template, assistant turns with their tool calls are trained and tool turns are not, a row's enable_thinking is its
own; verl's nested prompt/response columns (prompt_dict_keys, response_dict_keys). The tiny model's template renders
neither tools nor calls, so a Qwen2.5-style template is set on its tokenizer here."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignrl.data.loaders import DataError
from alignrl.data.sft_rows import SFTKeys, encode_rows, load_rows
from alignrl.preference.sft_cli import parse_sft

# Qwen2.5's template, its default system text and tool preamble shortened; enable_thinking=false marks the system
# turn (Qwen3 reads it in the generation prompt, which these rows never render)
QWEN25_STYLE = (
    "{%- set think = '' if enable_thinking is not defined or enable_thinking else ' /no_think' %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}{{- think }}"
    "{{- '\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + think + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

TOOL = {"type": "function", "function": {"name": "calc", "description": "evaluates arithmetic",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
CALL = {"type": "function", "function": {"name": "calc", "arguments": json.dumps({"expr": "6*7"})}}
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    t.chat_template = QWEN25_STYLE
    return t


def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _encode(tok, path: str, keys: SFTKeys = SFTKeys()):
    return encode_rows(tok, load_rows(path, keys), keys, 4096)[0]


def _trained_text(tok, enc) -> str:
    return tok.decode([t for t, on in zip(enc.ids, enc.trained) if on])


def test_tool_rows_train_the_assistant_turns_and_their_calls(tok, tmp_path):
    """verl's layout (tools a JSON string, arguments a JSON string; or its parquet) and TRL's (lists): the schemas are
    in the rendering and untrained, the tool call and the final reply are trained, the tool's answer and the user's
    not."""
    verl = {"messages": CONVERSATION, "tools": json.dumps([TOOL])}
    trl = {"messages": [*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expr": "6*7"}}}]}, *CONVERSATION[3:]],
           "tools": [TOOL]}
    a, b = _encode(tok, _write(tmp_path / "rows.jsonl", [verl, trl]))
    assert a.ids == b.ids and a.trained == b.trained
    pq.write_table(pa.Table.from_pylist([{**verl, "tools": [TOOL]}]), tmp_path / "rows.parquet")
    (c,) = _encode(tok, str(tmp_path / "rows.parquet"))  # verl's parquet: tools a list, other turns' tool_calls null
    assert c.ids == a.ids and c.trained == a.trained
    text = tok.decode(a.ids)
    assert '"description": "evaluates arithmetic"' in text and " /no_think" not in text
    assert _trained_text(tok, a) == ('<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
                                     "<|im_end|>\nIt is 42.<|im_end|>\n")


def test_prompt_completion_rows_with_tools_and_a_row_of_its_own_thinking(tok, tmp_path):
    """TRL's prompt-completion rows with a tools column: the completion's tool call is trained; enable_thinking
    (verl's per-row column) reaches the template for that row alone."""
    row = {"prompt": CONVERSATION[:2], "completion": [CONVERSATION[2]], "tools": [TOOL]}
    quiet = {"messages": CONVERSATION[:2] + CONVERSATION[4:], "enable_thinking": False}
    a, b, c = _encode(tok, _write(tmp_path / "rows.jsonl", [row, quiet, {**quiet, "enable_thinking": None}]))
    assert _trained_text(tok, a) == ('<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
                                     "<|im_end|>\n")
    assert "Be brief. /no_think" in tok.decode(b.ids) and " /no_think" not in tok.decode(c.ids)
    assert _trained_text(tok, b) == _trained_text(tok, c) == "It is 42.<|im_end|>\n"


def test_a_template_that_leaves_out_tools_or_calls_is_one_line(tiny_model_dir, tmp_path):
    """The tiny model's own template writes neither tools nor tool calls: trained so, the row would be another."""
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    no_call = CONVERSATION[:2] + CONVERSATION[4:]
    for row, words in (({"messages": no_call, "tools": [TOOL]}, "does not render the row's tools"),
                       ({"messages": CONVERSATION}, "does not render tool_calls")):
        path = _write(tmp_path / "rows.jsonl", [row])
        with pytest.raises(DataError, match=rf"^{path}:1: the chat template {words}"):
            _encode(plain, path)


@pytest.mark.parametrize("row, words", [
    ({"messages": CONVERSATION, "tools": "[{"}, r"tools is not JSON"),
    ({"messages": CONVERSATION, "tools": [1]}, r"tools must be a list of tool schemas"),
    ({"messages": [{**m, "tool_calls": [{"function": {"arguments": "{}"}}]} if m["role"] == "assistant" else m
                   for m in CONVERSATION[:3]]}, r"a tool call in messages must be"),
    ({"messages": [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": [{"name": "calc", "arguments": "6*7"}]}]},
     r"arguments of tool call 'calc' in messages must be a JSON object"),
    ({"messages": [{**CONVERSATION[1], "tool_calls": [CALL]}, CONVERSATION[4]]}, r"'user' message in messages has "
     "tool_calls"),
    ({"messages": CONVERSATION, "enable_thinking": "no"}, r"enable_thinking must be true or false"),
    ({"text": "6*7=42", "tools": [TOOL]}, r"only the chat template renders, and the row is text"),
    ({"extra_info": {"question": "q"}, "answer": "a"}, r"extra_info has no key 'prompt' \(keys question\)"),
])
def test_rows_with_tools_that_are_not_what_they_should_be_are_one_line(tok, tmp_path, row, words):
    path = _write(tmp_path / "rows.jsonl", [row])
    keys = SFTKeys(prompt="extra_info", prompt_path=("prompt",), response="answer") if "extra_info" in row else \
        SFTKeys()
    with pytest.raises(DataError, match=rf"^{path}:1: .*{words}"):
        _encode(tok, path, keys)


def test_verl_nested_columns_and_tool_keys(tok, tmp_path):
    """verl's gsm8k quickstart: prompt and response inside the extra_info dicts; its tools and thinking keys."""
    cfg = parse_sft(["data.train_files=t.parquet", "data.prompt_key=extra_info", "+data.prompt_dict_keys=['question']",
                     "data.response_key=extra_info", "+data.response_dict_keys=[answer]",
                     "data.multiturn.tools_key=functions", "data.enable_thinking_key=think",
                     "data.enable_thinking_default=false", "data.apply_chat_template_kwargs={enable_thinking: true}"])
    assert (cfg.prompt_dict_keys, cfg.response_dict_keys) == (["question"], ["answer"])
    assert cfg.chat_template_kwargs == {"enable_thinking": False}  # verl's default of rows without their own
    assert (cfg.tools_key, cfg.enable_thinking_key) == ("functions", "think")
    keys = SFTKeys(prompt="extra_info", response="extra_info", prompt_path=("question",),
                   response_path=("answer",), chat_template=True, tools="functions")
    row = {"extra_info": {"question": "What is 6*7?", "answer": "42", "index": 3}, "functions": None}
    (got,) = load_rows(_write(tmp_path / "rows.jsonl", [row]), keys)
    assert (got.prompt, got.completion, got.tools) == ("What is 6*7?", "42", None)
    (enc,) = encode_rows(tok, [got], keys, 64)[0]
    assert _trained_text(tok, enc) == "42<|im_end|>\n"
