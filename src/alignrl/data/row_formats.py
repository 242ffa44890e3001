"""Row layouts shared by the loaders: chat-message parsing, verl's ground-truth values, `.json` arrays,
and the by-column layout (OpenRLHF's `--input_key/--label_key`, verl's `data.prompt_key`).

The by-column layout reads one row as:

* prompt: `row[prompt_key]`, a string or a list of {role, content} messages. With the chat template
  (the default) a string becomes one user turn; without it the string is the prompt text itself, or
  `input_template.format(string)`, tokenized as it is (messages cannot be used untemplated).
* ground truth: `row[label_key]` when `label_key` is set (every row needs a value); otherwise verl's
  `reward_model.ground_truth` when the row has one, else "" (OpenRLHF's empty label: the reward then
  comes from a reward model, and the rule reward scores 0).
* data_source: the row's `data_source` column when present, else "math": its rule reward extracts the
  last `\\boxed{}`, else the last `####` line, else the last expression, and compares it with the label
  symbolically, which suits the short answers (numbers, expressions) OpenRLHF's math prompt sets carry.
* extra: the row's `extra_info` object when present, else nothing. With no `label_key` (TRL's layout: a reward
  function reads the columns it needs) every column of the row, as it is, rides beside those items, not among
  them (`rewards.trl_reward.WithColumns`), which only TRL's reward functions read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from alignrl.data.images import parse_message_list
from alignrl.data.records import Sample
from alignrl.errors import DataError  # noqa: F401  (the data package's error, imported from here)
from alignrl.rewards.trl_reward import WithColumns

DEFAULT_SOURCE = "math"  # the data_source of by-column rows that name none


@dataclass(frozen=True)
class PromptKeys:
    """How to read a by-column file (the data.prompt_key, label_key, input_template and
    apply_chat_template config keys)."""

    prompt_key: str
    label_key: str | None = None
    input_template: str | None = None
    apply_chat_template: bool = True
    image_key: str = "images"  # the image column, which rides in Sample.images, not in extra


def with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def chat_messages(loc: str, value: Any, column: str) -> list[dict[str, str]]:
    """`value` (any sequence of {role, content} dicts, e.g. a numpy array from pandas-built rows) as plain
    chat messages, else a DataError naming the row and `column`."""
    if isinstance(value, (str, dict, bytes)) or not hasattr(value, "__iter__"):
        raise DataError(f"{loc}: {column} must be a list of chat messages "
                        "(e.g. [{'role': 'user', 'content': '...'}])")
    messages = []
    for m in value:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{loc}: {column} message {m!r:.80} lacks role/content "
                            "(each message must be {'role': ..., 'content': ...})")
        content = m["content"]
        if not isinstance(content, str) and hasattr(content, "__iter__") and not isinstance(content, (dict, bytes)):
            content = [dict(item) if isinstance(item, dict) else item for item in content]  # text/image items
        else:
            content = str(content)
        messages.append({"role": str(m["role"]), "content": content})
    if not messages:  # nothing to answer: the chat template refuses it when a step draws the row
        raise DataError(f"{loc}: {column} is an empty list of chat messages; give every row a prompt, or drop the row")
    return messages


def plain_ground_truth(value: Any) -> str | list[Any] | dict[str, Any]:
    """`reward_model.ground_truth` as reward functions expect it: a structure (Search-R1's
    `{"target": [...]}`, a list) stays a structure, of plain dicts and lists (parquet read through
    pandas gives numpy arrays, which break `==` and JSON); a scalar becomes its string, as verl's
    GSM8K/MATH rewards compare text."""
    if value is None:  # a struct field that this row leaves empty
        return None  # type: ignore[return-value]
    if isinstance(value, dict):
        return {str(k): plain_ground_truth(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy array or scalar
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain_ground_truth(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def json_array_rows(path: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The rows of a `.json` file holding one JSON array of objects; None when the file is JSON lines
    instead (its first non-blank character is not `[`), which the caller reads line by line."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path}: file is not UTF-8 text (re-save it as UTF-8 JSON)") from None
    if not text.lstrip().startswith("["):
        return None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}) "
                        "(a .json file holds one array of objects, or one object per line)") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {i}: a JSON {type(row).__name__}, not an object "
                            "(a .json array must hold one object per row)")
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


def keys_sample(loc: str, row: dict[str, Any], keys: PromptKeys, system_prompt: str | None) -> Sample:
    """One by-column row as a Sample (the rules in the module docstring)."""
    column = keys.prompt_key
    if column not in row:
        raise DataError(f"{loc}: row has no {column!r} column (data.prompt_key names the prompt "
                        f"column; this row has {sorted(row)})")
    prompt = parse_message_list(row[column])  # LMM-R1 stores its messages as a JSON string
    text = prompt if isinstance(prompt, str) else None
    if text is None and not isinstance(prompt, (dict, bytes)) and hasattr(prompt, "__iter__"):
        messages = chat_messages(loc, prompt, column)
    elif text is None:
        raise DataError(f"{loc}: {column} is a {type(prompt).__name__}, not a string or a list of chat messages")
    else:
        messages = [{"role": "user", "content": text}]
    if text is not None and not text.strip():  # nothing to answer: the engine refuses it, hours into a run
        raise DataError(f"{loc}: {column} is empty; give every row a prompt, or drop the row")
    prompt_text = None
    if keys.apply_chat_template:
        messages = with_system(messages, system_prompt)
    elif text is None:
        raise DataError(f"{loc}: {column} holds chat messages, which need the chat template (set "
                        "data.apply_chat_template=true, --apply_chat_template for ppo-ray)")
    else:
        prompt_text = keys.input_template.format(text) if keys.input_template else text
    return Sample(messages=messages, ground_truth=_label(loc, row, keys.label_key),
                  data_source=str(row["data_source"]) if row.get("data_source") is not None else DEFAULT_SOURCE,
                  extra=_extra(row, keys),
                  prompt_text=prompt_text)


def _extra(row: dict[str, Any], keys: PromptKeys) -> dict[str, Any]:
    """The row's extra_info object (or nothing), with every column of a label-less row under ROW_COLUMNS: TRL
    passes its reward functions each column by name, data_source, extra_info and images included."""
    extra = dict(row["extra_info"]) if isinstance(row.get("extra_info"), dict) else {}
    return extra if keys.label_key is not None else WithColumns(extra, dict(row))


def _label(loc: str, row: dict[str, Any], label_key: str | None) -> str | list[Any] | dict[str, Any]:
    if label_key is not None:
        if row.get(label_key) is None:
            raise DataError(f"{loc}: row has no {label_key!r} value (data.label_key names the "
                            "answer column: give every row one, or unset it to score with a reward model)")
        return plain_ground_truth(row[label_key])
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return plain_ground_truth(reward_model["ground_truth"])
    return ""
