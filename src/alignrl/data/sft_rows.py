"""Supervised fine-tuning rows: loading (.jsonl / .json / .parquet), tokenising with the trained-token mask, and
collation into right-padded batches.

Three row layouts are understood, TRL's (the key names are settings: verl's question/answer parquet reads through
`prompt_key=question response_key=answer`):

* conversational: `messages`, a list of {"role", "content"}; rendered whole with the chat template. With
  `assistant_only_loss` only the assistant turns are trained (OpenRLHF's multiturn SFT, TRL's assistant_only_loss):
  each turn's tokens are found by rendering the conversation up to it, with and without the turn. A response column
  beside it is appended as the last assistant turn (OpenRLHF's `--multiturn --output_key`).
* prompt–completion: `prompt` and `completion`, each a string or a list of messages. Rows holding messages are always
  rendered with the chat template; a prompt of messages with no completion column is a conversation whose last
  (assistant) message is the completion (OpenRLHF's `--input_key` without `--output_key`). String rows are text, the
  completion closed by eos (TRL's way), unless `chat_template`: then the prompt is a user turn and the completion the
  assistant's reply, both rendered by the template (OpenRLHF's `--apply_chat_template`). With `input_template`
  (OpenRLHF's `--input_template`) a string row is OpenRLHF's text instead: the prompt formatted into the template,
  the completion after it, trailing newlines dropped and " " + eos appended (`openrlhf_text`); OpenRLHF needs a
  string prompt there, so a row of messages is refused. With `completion_only_loss` (TRL's default) only the
  completion is trained.
* language modelling: `text`, every token trained, closed by eos.

Rows with images (verl's `<image>` placeholders with an `images` column, TRL's image items) are read and rendered
by `data.sft_images`, through the processor's chat template. A row's tools, tool calls, `tool` turns and
`enable_thinking`, and verl's nested columns, are `data.sft_tools`'. Either way the trained tokens are found as above.

eos is appended only to a text not already ending with it. A sequence longer than `max_length` is cut there (from
its end); a row with no trained token left is dropped. A bad row is one `DataError` line naming file:line and key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from alignrl.data.collate import right_pad
from alignrl.data.images import ImageRows
from alignrl.data.loaders import DataError, _read_rows
from alignrl.data.sft_images import RowPictures, read_image_row, renderer_for
from alignrl.data.sft_tools import chat_message, drilled, read_thinking, read_tools, row_renderer


@dataclass(frozen=True)
class SFTKeys:
    """Which columns hold what, and how rows become tokens (the `alignrl train sft` settings of the same names)."""

    prompt: str = "prompt"
    response: str = "completion"
    messages: str = "messages"
    text: str = "text"
    chat_template: bool = False  # string prompt-completion rows through the chat template too (messages always are)
    completion_only: bool = True  # prompt-completion rows: loss on the completion alone
    assistant_only: bool = True  # conversations: loss on the assistant turns alone
    input_template: str | None = None  # without chat_template: string rows as OpenRLHF's text, the prompt formatted in
    image: str = "images"  # column of a row's images (verl's data.image_key; TRL's one-image `image` is read too)
    tools: str = "tools"  # column of a row's tool schemas, for its chat template (verl's data.multiturn.tools_key)
    thinking: str = "enable_thinking"  # column of a row's enable_thinking (verl's data.enable_thinking_key)
    prompt_path: tuple[str, ...] = ()  # verl's prompt_dict_keys: the prompt found inside the prompt column's dicts
    response_path: tuple[str, ...] = ()  # verl's response_dict_keys


@dataclass(frozen=True)
class SFTRow:
    """One training example before tokenisation: a conversation, a prompt with its completion, or a plain text."""

    loc: str  # file:line, for messages
    messages: list[dict[str, str]] | None = None
    prompt: str | list[dict[str, str]] | None = None
    completion: str | list[dict[str, str]] | None = None
    text: str | None = None
    images: tuple = ()  # a row with images: their sources (paths or bytes), in the order of its image items
    tools: list[dict] | None = None  # tool schemas for the chat template (`data.sft_tools`)
    thinking: bool | None = None  # the row's enable_thinking for the chat template


@dataclass(frozen=True)
class EncodedRow:
    ids: list[int]
    trained: list[bool]  # trained[i]: token i is a target (the model predicts it from the tokens before it)
    index: int  # position in the data set
    # a row packed from whole sequences (`sft_packing.pack_dataset`, TRL's bfd): their lengths, in order, each
    # attending to itself alone with position ids from 0; (): one sequence
    lengths: tuple[int, ...] = ()
    images: RowPictures | None = None  # a row with images: their sources and patch grids, loaded for each batch

    @property
    def n_trained(self) -> int:
        return sum(self.trained[1:])  # the first token has nothing before it to be predicted from


def load_rows(path: str, keys: SFTKeys, limit: int | None = None, key: str = "train_files") -> list[SFTRow]:
    """The rows of one file in any of the three layouts; `key`: the setting that named the file, for the errors."""
    _, rows = _read_rows(path, limit, key=key)
    if not rows:
        raise DataError(f"{path}: file has no rows ({key} needs one example per line)")
    base = Path(path).parent  # where relative image paths may also be found
    return [_row(loc, row, keys, base) for loc, row in rows]


# what a row may hold that these rows cannot train as it asks: a column -> what it is
UNREAD_COLUMNS = {"videos": "videos", "video": "a video"}


def _row(loc: str, row: dict[str, Any], keys: SFTKeys, base: Path | None = None) -> SFTRow:
    unread = next((k for k in UNREAD_COLUMNS if _given(row.get(k))), None)
    if unread is not None:  # trained without it, the row would teach something else than it says
        raise DataError(f"{loc}: the row has {unread} ({UNREAD_COLUMNS[unread]}), which alignrl train sft does not "
                        "read (it trains on the messages' role and content, images, or text); drop the column")
    row, (prompt, response) = drilled(loc, row, (keys.prompt, keys.prompt_path), (keys.response, keys.response_path))
    keys = replace(keys, prompt=prompt, response=response)
    tools, thinking = read_tools(loc, keys.tools, row.get(keys.tools)), read_thinking(loc, keys, row)
    pictured = _image_row(loc, row, keys, base)
    if pictured is not None:
        if tools or thinking is not None:
            raise DataError(f"{loc}: rows with images take no {keys.tools} or {keys.thinking} here; drop the column")
        return pictured
    got = _layout(loc, row, keys)
    return got if tools is None and thinking is None else replace(got, tools=tools, thinking=thinking)


def _layout(loc: str, row: dict[str, Any], keys: SFTKeys) -> SFTRow:  # one of the three layouts
    if keys.messages in row:
        messages = _messages(loc, keys.messages, row[keys.messages])
        if keys.response in row:  # OpenRLHF's --multiturn --output_key: the response closes the conversation
            messages += _reply(loc, keys.response, row[keys.response])
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{loc}: {keys.messages} has no assistant message, so nothing to train on")
        return SFTRow(loc, messages=messages)
    if keys.prompt in row or keys.response in row:
        if keys.response not in row and _is_list(row[keys.prompt]):
            return _last_turn(loc, keys.prompt, _messages(loc, keys.prompt, row[keys.prompt]))
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


def _image_row(loc: str, row: dict[str, Any], keys: SFTKeys, base: Path | None) -> SFTRow | None:
    """The row with its images (`data.sft_images`): a conversation, or a prompt and completion. None: none."""
    got = read_image_row(loc, row, keys, base)
    if got is None:
        return None
    if got.prompt_len is None:
        return SFTRow(loc, messages=got.messages, images=got.images)
    return SFTRow(loc, prompt=got.messages[:got.prompt_len], completion=got.messages[got.prompt_len:],
                  images=got.images)


def _last_turn(loc: str, key: str, messages: list[dict[str, str]]) -> SFTRow:
    """A prompt of messages without a response column (OpenRLHF's reading): the last message is the completion."""
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{loc}: {key} holds messages and the row has no response column, so its last message is the "
                        f"completion, but that one is {messages[-1]['role']!r}, not 'assistant'")
    return SFTRow(loc, prompt=messages[:-1], completion=messages[-1:])


def _reply(loc: str, key: str, value: Any) -> list[dict[str, str]]:
    """A response column's value as messages: a string is the assistant's reply; a message or a list as given."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return _messages(loc, key, [value] if isinstance(value, dict) else value)


def _is_list(value: Any) -> bool:
    return not isinstance(value, (str, dict)) and hasattr(value, "__iter__")


def _given(value: Any) -> bool:
    """Whether a column holds something: not None and, for a list (or array), not empty."""
    if value is None:
        return False
    return len(value) > 0 if _is_list(value) or isinstance(value, (str, dict)) else True


def _text_or_messages(loc: str, key: str, value: Any) -> str | list[dict[str, str]]:
    return value if isinstance(value, str) else _messages(loc, key, value)


def _messages(loc: str, key: str, value: Any) -> list[dict[str, str]]:
    if not _is_list(value):
        raise DataError(f"{loc}: {key} must be a list of chat messages ({{'role': ..., 'content': ...}}), "
                        f"got {type(value).__name__}")
    out = [chat_message(loc, key, m) for m in value]  # any sequence of dicts, e.g. a numpy array from parquet
    if not out:
        raise DataError(f"{loc}: {key} is an empty list of messages")
    return out


# ---------------------------------------------------------------- tokenisation


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool, loc: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{loc}: a row of chat messages needs the chat template, and the tokenizer has none (give the "
                        "prompt and completion as strings, or a model whose tokenizer has a template)")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _split_fails(loc: str, what: str) -> DataError:
    return DataError(f"{loc}: the chat template renders {what} differently once later turns follow (e.g. it drops "
                     "earlier reasoning), so the trained tokens cannot be found; set assistant_only_loss=false to "
                     "train every token, or fix the row")


def _with_eos(tokenizer, text: str) -> str:
    """`text` closed by eos, unless it already ends with it (TRL's and OpenRLHF's rule: one eos, trained once)."""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def encode_conversation(tokenizer, row: SFTRow, assistant_only: bool) -> tuple[list[int], list[bool]]:
    """The whole conversation's ids, and which are trained: the assistant turns (each as the template closes it), or
    every token. A turn's span runs from the end of the conversation rendered up to it with the generation prompt to
    the end of the conversation rendered through it; both must be beginnings of the whole rendering."""
    messages = row.messages or []
    ids = _render(tokenizer, messages, False, row.loc)
    if not assistant_only:
        return ids, [True] * len(ids)
    trained = [False] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:k], True, row.loc) if k else []
        end = _render(tokenizer, messages[:k + 1], False, row.loc)
        if ids[:len(start)] != start or ids[:len(end)] != end or len(end) <= len(start):
            raise _split_fails(row.loc, f"the turns before assistant message {k}")
        trained[len(start):len(end)] = [True] * (len(end) - len(start))
    return ids, trained


def encode_prompt_completion(tokenizer, row: SFTRow, keys: SFTKeys) -> tuple[list[int], list[bool]]:
    """Prompt then completion; the prompt untrained with `keys.completion_only`. Rows holding messages, and string
    rows with `keys.chat_template`, render through the chat template (a string completion as the assistant's reply,
    closed as the template closes a turn); with `keys.input_template`, string rows are OpenRLHF's text; other rows
    are text, the completion closed by eos."""
    messages = isinstance(row.prompt, list) or isinstance(row.completion, list)
    if messages and keys.input_template is not None and not keys.chat_template:
        raise needs_string_prompt(row.loc)
    if messages or keys.chat_template:
        ids, head_len = _templated(tokenizer, row, keys.completion_only)
    elif keys.input_template is not None:
        ids, head_len = openrlhf_text(tokenizer, keys.input_template.format(row.prompt), str(row.completion))
    else:
        ids, head_len = _joined(tokenizer, str(row.prompt), _with_eos(tokenizer, str(row.completion)))
    return ids, [not keys.completion_only or i >= head_len for i in range(len(ids))]


def _templated(tokenizer, row: SFTRow, split: bool) -> tuple[list[int], int]:
    """The rendered conversation and the prompt's length in it: the prompt rendered with the generation prompt,
    which must begin the whole rendering when the split is needed (OpenRLHF cuts the reply off the same way)."""
    prompt = _as_messages(row.prompt, "user")
    ids = _render(tokenizer, prompt + _as_messages(row.completion, "assistant"), False, row.loc)
    if not split:
        return ids, 0
    head = _render(tokenizer, prompt, True, row.loc) if prompt else []
    if ids[:len(head)] != head:
        raise DataError(f"{row.loc}: the chat template renders the prompt differently once the completion follows, "
                        "so the completion's tokens cannot be found; fix the row, or (sft) train every token "
                        "with completion_only_loss=false")
    return ids, len(head)


def _as_messages(value, role: str) -> list[dict[str, str]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value or [])


def _for_row(tokenizer, row: SFTRow, keys: SFTKeys):
    """The tokenizer `row` renders with: its tools and enable_thinking bound (`data.sft_tools.row_renderer`)."""
    messages = row.messages if row.messages is not None else [*_as_messages(row.prompt, "user"),
                                                               *_as_messages(row.completion, "assistant")]
    text = row.text is not None or (row.messages is None and not keys.chat_template and isinstance(row.prompt, str)
                                    and isinstance(row.completion, str))
    return row_renderer(tokenizer, row.loc, messages, row.tools, row.thinking, text)


def _joined(tokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """Prompt and completion tokenised as one text, the prompt's own token count the boundary (TRL's way: tokenised
    alone, a SentencePiece tokenizer would start the completion with a spurious '▁'). Where the joint tokens do not
    begin with the prompt's (a token merges across the boundary) the two are tokenised apart, so that the boundary
    is a token boundary. The prompt keeps the tokenizer's own bos, as TRL tokenizes a text prompt."""
    head = list(tokenizer(prompt)["input_ids"])
    ids = list(tokenizer(prompt + completion)["input_ids"])
    if ids[:len(head)] != head:
        ids = head + list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    return ids, len(head)


def needs_string_prompt(loc: str) -> DataError:
    """A row of chat messages where `input_template` asks for OpenRLHF's text, which formats a string prompt."""
    return DataError(f"{loc}: the row holds chat messages, and input_template (OpenRLHF's --input_template) formats a "
                     "string prompt; render the messages with apply_chat_template=true (--apply_chat_template), or "
                     "give the prompt and response as strings")


def openrlhf_text(tokenizer, prompt: str, response: str) -> tuple[list[int], int]:
    """OpenRLHF's text of a prompt (already formatted into its input_template) and a response, and where the
    response begins in it: `(prompt + response)` without trailing newlines, then " " + eos unless it already ends
    with eos, tokenised whole without special tokens (no bos); the boundary is the prompt's own token count, as
    OpenRLHF's prompt_ids_len, even where a token merges across it."""
    eos = tokenizer.eos_token or ""
    text = (prompt + response).rstrip("\n")
    if not text.endswith(eos):
        text += " " + eos
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids, len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encode_rows(tokenizer, rows: Sequence[SFTRow], keys: SFTKeys, max_length: int) -> tuple[list[EncodedRow], int, int]:
    """(the encoded rows, how many were cut at `max_length`, how many were dropped: cut before any trained token).
    Chat rendering uses the variables bound to `tokenizer` (chat_template_kwargs)."""
    out, cut, dropped = [], 0, 0
    for row in rows:
        pictures = None
        if row.images:  # rendered by the processor, its images' tokens in place (data.sft_images)
            renderer, pictures = renderer_for(tokenizer, row.loc, row.images)
            ids, trained = _encode_one(renderer, row, keys)
            renderer.check(ids)
            if renderer.image_id in ids[max_length:]:  # a row cut inside its images would not match them
                raise _cuts_images(row.loc, max_length, ids, renderer.image_id)
        else:
            ids, trained = _encode_one(_for_row(tokenizer, row, keys), row, keys)
        cut += len(ids) > max_length
        enc = EncodedRow(ids[:max_length], trained[:max_length], len(out), images=pictures)
        if enc.n_trained == 0:
            dropped += 1
            continue
        out.append(enc)
    return out, cut, dropped


def _cuts_images(loc: str, max_length: int, ids: list[int], image_id: int) -> DataError:
    last = max(i for i, t in enumerate(ids) if t == image_id)
    return DataError(f"{loc}: max_length={max_length} would cut the row's image tokens (they run to token {last + 1} "
                     f"of {len(ids)}); raise max_length, or lower max_pixels so each image has fewer tokens")


def _encode_one(tokenizer, row: SFTRow, keys: SFTKeys) -> tuple[list[int], list[bool]]:
    """(ids, trained) of one row, whole."""
    if row.text is not None:
        ids = list(tokenizer(_with_eos(tokenizer, row.text))["input_ids"])
        return ids, [True] * len(ids)
    if row.messages is None:
        return encode_prompt_completion(tokenizer, row, keys)
    if keys.input_template is not None and not keys.chat_template:
        raise needs_string_prompt(row.loc)
    return encode_conversation(tokenizer, row, keys.assistant_only)


# ---------------------------------------------------------------- batches


@dataclass
class SFTBatch:
    """Right-padded rows with the mask of their trained tokens; `global_tokens`: the trained tokens of the whole
    optimizer step (every micro-batch on every rank), what the summed loss is divided by. A packed batch
    (`preference.sft_packing`) has `position_ids`: several rows per sequence, each counted from 0."""

    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) bool: a row's token (not padding)
    loss_mask: torch.Tensor  # (B, L) bool: token t is a target (predicted at position t - 1)
    index: torch.Tensor  # (rows,) long
    global_tokens: float
    position_ids: torch.Tensor | None = None  # (B, L) long, packed batches only
    images: ImageRows | None = None  # rows with images: their pixels (kept on the CPU; the forward moves them)

    @property
    def n_rows(self) -> int:
        return self.index.shape[0]

    def _map(self, fn) -> SFTBatch:
        return SFTBatch(*(fn(t) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.index)),
                        self.global_tokens, None if self.position_ids is None else fn(self.position_ids), self.images)

    def to(self, device: torch.device, non_blocking: bool = False) -> SFTBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> SFTBatch:  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


def collate_rows(encoded: Sequence[EncodedRow], pad_id: int, global_tokens: float) -> SFTBatch:
    ids, mask = right_pad([e.ids for e in encoded], pad_id)
    trained, _ = right_pad([[int(t) for t in e.trained] for e in encoded], 0)
    trained[:, 0] = 0  # nothing predicts a row's first token
    images = ImageRows([e.images.load() if e.images is not None else None for e in encoded])
    return SFTBatch(ids, mask, trained.bool() & mask, torch.tensor([e.index for e in encoded], dtype=torch.long),
                    float(global_tokens), images=images if images.any() else None)
