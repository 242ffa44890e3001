"""Supervised fine-tuning rows: loading (.jsonl / .json / .parquet), tokenising with the trained-token mask, and
collation into right-padded batches.

Three row layouts are understood, TRL's (the key names are settings, so verl's SFT parquet with question/answer
columns reads through `prompt_key=question response_key=answer`):

* conversational: `messages`, a list of {"role", "content"}; rendered whole with the chat template. With
  `assistant_only_loss` only the assistant turns are trained (OpenRLHF's multiturn SFT, TRL's assistant_only_loss):
  each turn's tokens are found by rendering the conversation up to it, with and without the turn.
* prompt–completion: `prompt` and `completion`, each a string or a list of messages. With the chat template a
  string prompt is one user turn rendered with the generation prompt, and a string completion follows it as text,
  closed by the tokenizer's eos; message lists render as one conversation. With `completion_only_loss` (TRL's
  default) only the completion is trained.
* language modelling: `text`, every token trained, closed by eos.

A sequence longer than `max_length` is cut there (OpenRLHF's rule: the whole sequence, from its end); a row with no
trained token left is dropped. Problems in a file raise `DataError` with one line naming file:line and the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alignrl.data.collate import right_pad
from alignrl.data.loaders import DataError, _read_rows


@dataclass(frozen=True)
class SFTKeys:
    """Which columns hold what, and how rows become tokens (the `alignrl train sft` settings of the same names)."""

    prompt: str = "prompt"
    response: str = "completion"
    messages: str = "messages"
    text: str = "text"
    chat_template: bool = True  # render prompts and conversations with the tokenizer's chat template
    completion_only: bool = True  # prompt-completion rows: loss on the completion alone
    assistant_only: bool = True  # conversations: loss on the assistant turns alone


@dataclass(frozen=True)
class SFTRow:
    """One training example before tokenisation: a conversation, a prompt with its completion, or a plain text."""

    loc: str  # file:line, for messages
    messages: list[dict[str, str]] | None = None
    prompt: str | list[dict[str, str]] | None = None
    completion: str | list[dict[str, str]] | None = None
    text: str | None = None


@dataclass(frozen=True)
class EncodedRow:
    ids: list[int]
    trained: list[bool]  # trained[i]: token i is a target (the model predicts it from the tokens before it)
    index: int  # position in the data set

    @property
    def n_trained(self) -> int:
        return sum(self.trained[1:])  # the first token has nothing before it to be predicted from


def load_rows(path: str, keys: SFTKeys, limit: int | None = None, key: str = "train_files") -> list[SFTRow]:
    """The rows of one file in any of the three layouts; `key`: the setting that named the file, for the errors."""
    _, rows = _read_rows(path, limit, key=key)
    if not rows:
        raise DataError(f"{path}: file has no rows ({key} needs one example per line)")
    return [_row(loc, row, keys) for loc, row in rows]


def _row(loc: str, row: dict[str, Any], keys: SFTKeys) -> SFTRow:
    if keys.messages in row:
        messages = _messages(loc, keys.messages, row[keys.messages])
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{loc}: {keys.messages} has no assistant message, so nothing to train on")
        return SFTRow(loc, messages=messages)
    if keys.prompt in row or keys.response in row:
        missing = [k for k in (keys.prompt, keys.response) if k not in row]
        if missing:
            raise DataError(f"{loc}: row has {keys.prompt if keys.prompt in row else keys.response} but is missing "
                            f"{missing[0]} (prompt-completion rows need both; set prompt_key/response_key)")
        prompt, completion = (_text_or_messages(loc, k, row[k]) for k in (keys.prompt, keys.response))
        return SFTRow(loc, prompt=prompt, completion=completion)
    if keys.text in row:
        if not isinstance(row[keys.text], str) or not row[keys.text]:
            raise DataError(f"{loc}: {keys.text} must be a non-empty string, got {row[keys.text]!r:.60}")
        return SFTRow(loc, text=row[keys.text])
    raise DataError(f"{loc}: row has none of {keys.messages} (conversation), {keys.prompt}+{keys.response} (prompt-"
                    f"completion), {keys.text} (plain text); its keys are {', '.join(map(str, row))[:120]} (set "
                    "messages_key, prompt_key/response_key or text_key)")


def _text_or_messages(loc: str, key: str, value: Any) -> str | list[dict[str, str]]:
    return value if isinstance(value, str) else _messages(loc, key, value)


def _messages(loc: str, key: str, value: Any) -> list[dict[str, str]]:
    if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
        raise DataError(f"{loc}: {key} must be a list of chat messages ({{'role': ..., 'content': ...}}), "
                        f"got {type(value).__name__}")
    out = []
    for m in value:  # any sequence of dicts, e.g. a numpy array from pandas-built parquet rows
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise DataError(f"{loc}: a message in {key} lacks role/content (each message must be "
                            "{'role': ..., 'content': '...'})")
        out.append({"role": str(m["role"]), "content": m["content"]})
    if not out:
        raise DataError(f"{loc}: {key} is an empty list of messages")
    return out


# ---------------------------------------------------------------- tokenisation


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _split_fails(loc: str, what: str) -> DataError:
    return DataError(f"{loc}: the chat template renders {what} differently once later turns follow (e.g. it drops "
                     "earlier reasoning), so the trained tokens cannot be found; set assistant_only_loss=false "
                     "(or completion_only_loss=false) to train every token, or fix the row")


def encode_conversation(tokenizer, row: SFTRow, assistant_only: bool) -> tuple[list[int], list[bool]]:
    """The whole conversation's ids, and which are trained: the assistant turns (each as the template closes it), or
    every token. A turn's span runs from the end of the conversation rendered up to it with the generation prompt to
    the end of the conversation rendered through it; both must be beginnings of the whole rendering."""
    messages = row.messages or []
    ids = _render(tokenizer, messages, False)
    if not assistant_only:
        return ids, [True] * len(ids)
    trained = [False] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = _render(tokenizer, messages[:k], True) if k else [], _render(tokenizer, messages[:k + 1], False)
        if ids[:len(start)] != start or ids[:len(end)] != end or len(end) <= len(start):
            raise _split_fails(row.loc, f"the turns before assistant message {k}")
        trained[len(start):len(end)] = [True] * (len(end) - len(start))
    return ids, trained


def encode_prompt_completion(tokenizer, row: SFTRow, keys: SFTKeys) -> tuple[list[int], list[bool]]:
    """Prompt then completion (closed by eos); the prompt untrained with `keys.completion_only`."""
    prompt, completion = row.prompt, row.completion
    if isinstance(completion, list):
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + completion
        head, ids = _render(tokenizer, messages[:len(messages) - len(completion)], True), _render(tokenizer, messages,
                                                                                                  False)
        if ids[:len(head)] != head:
            raise _split_fails(row.loc, "the prompt")
        head_len = len(head)
    else:
        if keys.chat_template:
            as_messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            head = _render(tokenizer, as_messages, True)
        else:
            head = tokenizer(prompt)["input_ids"]  # the tokenizer's own bos, as TRL tokenizes a text prompt
        tail = tokenizer(completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids, head_len = list(head) + list(tail), len(head)
    return ids, [not keys.completion_only or i >= head_len for i in range(len(ids))]


def encode_rows(tokenizer, rows: Sequence[SFTRow], keys: SFTKeys, max_length: int) -> tuple[list[EncodedRow], int, int]:
    """(the encoded rows, how many were cut at `max_length`, how many were dropped: cut before any trained token).
    Chat rendering uses the variables bound to `tokenizer` (chat_template_kwargs)."""
    out, cut, dropped = [], 0, 0
    for row in rows:
        if row.text is not None:
            ids = list(tokenizer(row.text + tokenizer.eos_token)["input_ids"])
            trained = [True] * len(ids)
        elif row.messages is not None:
            ids, trained = encode_conversation(tokenizer, row, keys.assistant_only)
        else:
            ids, trained = encode_prompt_completion(tokenizer, row, keys)
        cut += len(ids) > max_length
        enc = EncodedRow(ids[:max_length], trained[:max_length], len(out))
        if enc.n_trained == 0:
            dropped += 1
            continue
        out.append(enc)
    return out, cut, dropped


def needs_template(rows: Sequence[SFTRow]) -> str | None:
    """The first row that cannot be tokenised without a chat template (one holding messages), or None."""
    for row in rows:
        if row.messages is not None or isinstance(row.prompt, list) or isinstance(row.completion, list):
            return row.loc
    return None


# ---------------------------------------------------------------- batches


@dataclass
class SFTBatch:
    """Right-padded rows with the mask of their trained tokens; `global_tokens`: the trained tokens of the whole
    optimizer step (every micro-batch on every rank), what the summed loss is divided by."""

    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) bool
    loss_mask: torch.Tensor  # (B, L) bool: token t is a target (predicted at position t - 1)
    index: torch.Tensor  # (B,) long
    global_tokens: float

    @property
    def n_rows(self) -> int:
        return self.index.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> SFTBatch:
        return SFTBatch(*(t.to(device, non_blocking=non_blocking) for t in (
            self.input_ids, self.attention_mask, self.loss_mask, self.index)), self.global_tokens)

    def pin_memory(self) -> SFTBatch:  # called by DataLoader(pin_memory=True)
        return SFTBatch(*(t.pin_memory() for t in (self.input_ids, self.attention_mask, self.loss_mask, self.index)),
                        self.global_tokens)


def collate_rows(encoded: Sequence[EncodedRow], pad_id: int, global_tokens: float) -> SFTBatch:
    ids, mask = right_pad([e.ids for e in encoded], pad_id)
    trained, _ = right_pad([[int(t) for t in e.trained] for e in encoded], 0)
    trained[:, 0] = 0  # nothing predicts a row's first token
    return SFTBatch(ids, mask, trained.bool() & mask, torch.tensor([e.index for e in encoded], dtype=torch.long),
                    float(global_tokens))
