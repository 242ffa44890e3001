"""What a supervised fine-tuning row holds beyond its messages' role and content: the tool schemas its chat template
renders (verl's `data.multiturn.tools_key`, TRL's `tools` column), assistant turns that call tools and the `tool`
turns that answer them, a per-row `enable_thinking` (verl's `data.enable_thinking_key`), and verl's nested columns
(`data.prompt_dict_keys` / `data.response_dict_keys`).

A row's tools are a JSON string or a list of schemas (OpenAI's `{"type": "function", "function": {...}}` or bare
function schemas); they go to the chat template as `tools=`, with the row's `enable_thinking`, through `RowTemplate`,
on every rendering of the row, so that the trained turns are found as for any conversation (`data.sft_rows`). An
assistant turn's `tool_calls` take OpenAI's form (`{"type": "function", "function": {"name", "arguments"}}`, or the
bare `{"name", "arguments"}`); `arguments` given as a JSON string are read into the object chat templates expect.
The assistant turns, their tool calls too, are trained; `tool` turns, like user and system turns, are not.

A template that leaves the tools or the tool calls out of its text would train the row as another row: such a row
is one line (`check_rendered`), as is a row whose tools or calls are not what these forms say.
"""

from __future__ import annotations

import json
from typing import Any

from alignrl.data.loaders import DataError
from alignrl.data.sft_images import check_message_keys

TOOL_ROLE_KEYS = ("name", "tool_call_id")  # what a `tool` turn may carry besides its content, for the template


def _plain(value: Any) -> Any:
    """A value with its sequences as lists (parquet and numpy hand over arrays, which templates do not iterate
    as lists), dicts kept."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


def read_tools(loc: str, key: str, value: Any) -> list[dict] | None:
    """A row's tool schemas as a list of dicts (None: the column is absent or empty)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{loc}: {key} is not JSON ({e.msg} at character {e.pos}); give a list of tool "
                            "schemas, as a JSON string or a list") from None
    value = _plain(value)
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{loc}: {key} must be a list of tool schemas ({{'type': 'function', 'function': {{'name': "
                        f"..., 'parameters': ...}}}}), got {type(value).__name__}")
    return value or None


def read_thinking(loc: str, keys, row: dict[str, Any]) -> bool | None:
    """A row's `enable_thinking` for its chat template, in its `keys.thinking` column (None: not given)."""
    key, value = keys.thinking, row.get(keys.thinking)
    if value is None or isinstance(value, bool):
        return value
    if hasattr(value, "item") and isinstance(value.item(), bool):  # numpy's bool
        return bool(value.item())
    raise DataError(f"{loc}: {key} must be true or false, got {value!r:.40}")


def drilled(loc: str, row: dict[str, Any], *columns: tuple[str, tuple[str, ...]]) -> tuple[dict[str, Any], list]:
    """(the row with each (column, path) of `columns`' nested value (`drill`) as a column of its own, the names of
    those columns: `column.key.key`, or the column itself for an empty path). verl's prompt and response may lie
    in one column (its gsm8k extra_info), so each nested value gets its own name."""
    out, names = dict(row), []
    for key, path in columns:
        names.append(".".join((key, *path)))
        if path and key in row:
            out[names[-1]] = drill(loc, key, row[key], path)
    return out, names


def drill(loc: str, key: str, value: Any, path: tuple[str, ...]) -> Any:
    """verl's nested column: the value found by taking each key of `path` in turn from `value` (a dict each time);
    `path` empty: `value` itself."""
    for depth, name in enumerate(path):
        if not isinstance(value, dict) or name not in value:
            where = key + "".join(f"[{p!r}]" for p in path[:depth])
            got = f"keys {', '.join(map(str, value))[:80]}" if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{loc}: {where} has no key {name!r} ({got}); check prompt_dict_keys/response_dict_keys")
        value = value[name]
    return value


def chat_message(loc: str, key: str, m: Any) -> dict[str, Any]:
    """One chat message as the template reads it: role and content, an assistant's tool calls, a tool turn's name
    and call id."""
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    content = m.get("content") if isinstance(m, dict) else None
    if calls is not None and content is None:  # a turn that only calls tools
        content = ""
    if not isinstance(m, dict) or "role" not in m or not isinstance(content, str):
        raise DataError(f"{loc}: a message in {key} lacks role/content (each message must be "
                        "{'role': ..., 'content': '...'})")
    check_message_keys(loc, key, m, tool_calls=True)
    out: dict[str, Any] = {"role": str(m["role"]), "content": content}
    if calls is not None and len(calls) > 0:
        if out["role"] != "assistant":
            raise DataError(f"{loc}: a {out['role']!r} message in {key} has tool_calls; only assistant turns call "
                            "tools")
        out["tool_calls"] = [_tool_call(loc, key, c) for c in calls]
    if out["role"] == "tool":
        out.update({k: m[k] for k in TOOL_ROLE_KEYS if m.get(k) is not None})
    return out


def _tool_call(loc: str, key: str, call: Any) -> dict[str, Any]:
    """OpenAI's form of one call, its arguments an object (chat templates write them with `tojson`)."""
    call = _plain(call) if isinstance(call, dict) else call
    fn = call.get("function") if isinstance(call, dict) and call.get("function") is not None else call
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or fn.get("arguments") is None:
        raise DataError(f"{loc}: a tool call in {key} must be {{'type': 'function', 'function': {{'name': ..., "
                        f"'arguments': ...}}}}, got {json.dumps(call, default=str)[:80]}")
    args = fn["arguments"]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        raise DataError(f"{loc}: the arguments of tool call {fn['name']!r} in {key} must be a JSON object (or its "
                        f"text), got {str(fn['arguments'])[:60]!r}")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call, dict) and call.get("id") is not None:
        out["id"] = call["id"]
    return out


def calls_tools(messages: list[dict] | None) -> bool:
    return any(m.get("tool_calls") for m in messages or ())


class RowTemplate:
    """`inner` (a tokenizer) whose `apply_chat_template` also gets one row's tools and `enable_thinking` (the run's
    chat_template_kwargs stay bound under them); everything else is the inner tokenizer's."""

    def __init__(self, inner, variables: dict[str, Any]):
        self._inner, self._variables = inner, variables

    def apply_chat_template(self, messages, **kwargs):
        return self._inner.apply_chat_template(messages, **{**self._variables, **kwargs})

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def row_template(tokenizer, tools: list[dict] | None, thinking: bool | None):
    """The tokenizer a row renders with: its tools and `enable_thinking` bound, or the tokenizer as it is."""
    variables = {k: v for k, v in (("tools", tools), ("enable_thinking", thinking)) if v is not None}
    return RowTemplate(tokenizer, variables) if variables else tokenizer


def row_renderer(tokenizer, loc: str, messages: list[dict], tools: list[dict] | None, thinking: bool | None,
                 text: bool):
    """The tokenizer a row renders with (`text`: the row is rendered as text, not by the template): its tools and
    enable_thinking bound, the template checked to write its tools and tool calls."""
    if tools is None and thinking is None and not calls_tools(messages):
        return tokenizer
    if text:
        raise DataError(f"{loc}: the row has tools or enable_thinking, which only the chat template renders, and "
                        "the row is text; give it as messages, or set apply_chat_template=true")
    tokenizer = row_template(tokenizer, tools, thinking)
    check_rendered(tokenizer, loc, messages, tools)
    return tokenizer


def check_rendered(tokenizer, loc: str, messages: list[dict], tools: list[dict] | None) -> None:
    """One line when the chat template writes the row's tools or tool calls nowhere (the row would train as one
    without them). `tokenizer`: the row's, tools bound."""
    if not getattr(tokenizer, "chat_template", None):
        return  # rendering says so itself
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if tools and text == tokenizer.apply_chat_template(messages, tokenize=False, tools=None):
        raise DataError(f"{loc}: the chat template does not render the row's tools, so it would train without them; "
                        "use a model whose template renders tools (e.g. Qwen2.5's), or drop the tools column")
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    if calls_tools(messages) and text == tokenizer.apply_chat_template(bare, tokenize=False):
        raise DataError(f"{loc}: the chat template does not render tool_calls, so the assistant turns would train "
                        "without their calls; use a model whose template renders them (e.g. Qwen2.5's)")
