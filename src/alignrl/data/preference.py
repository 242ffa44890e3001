"""Preference pairs: loading (.jsonl / .parquet) and collation into token tensors.

Three row layouts are understood:

* TRL's: `prompt`, `chosen`, `rejected` (other column names through `PairColumns`, OpenRLHF's --prompt_key,
  --chosen_key, --rejected_key). Either plain strings, or chat messages: `prompt` a list of
  {"role", "content"} ending with the user turn and `chosen` / `rejected` lists holding the assistant
  turn (TRL's conversational form). Without a `prompt` key, `chosen` and `rejected` are full texts or
  full conversations and their shared beginning is the prompt (TRL's implicit prompt, as its
  `maybe_extract_prompt` splits it); with one, responses that repeat the prompt first (full conversations, or
  texts that both start with the prompt's text) keep only what follows it.
  Optional: `margin` (float, the Llama-2 preference margin) and the safety labels `is_chosen_safe`,
  `is_rejected_safe` (bool; required to train a cost model).
* PKU-SafeRLHF's: `prompt`, `response_0`, `response_1`, `is_response_0_safe`,
  `is_response_1_safe`, `better_response_id`, `safer_response_id`; `prefer="better"` (helpfulness)
  or `"safer"` (harmlessness) picks which id makes a response "chosen".
* the Safe-MM-DPO project's: `prompt`, `chosen_response`, `rejected_response` (strings), optional
  `safety_labels: {"chosen": ±1, "rejected": ±1}` (Safe RLHF's sign: +1 harmful, -1 harmless) and `dimension`
  (which file it came from; not read).

A pair's prompt is rendered with the tokenizer's chat template; with `chat_template=False` a string prompt is text:
as it is (TRL's way), or with `input_template` OpenRLHF's text (`sft_rows.openrlhf_text`), each response after the
prompt formatted into the template (an implicit prompt is not formatted, as OpenRLHF formats only a prompt column).
A prompt of chat messages is always templated, and refused with `input_template`, which needs a string.

`builtin:<name>` names a shipped file (`builtin:helpful`, `builtin:harmless_test`, ...). Problems in a
file raise `DataError` with one line naming file:line and the key. Left out: multi-response rankings
and unpaired (KTO-style) feedback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignrl.data.collate import left_pad, right_pad
from alignrl.data.loaders import DataError, _read_rows
from alignrl.data.sft_rows import needs_string_prompt, openrlhf_text

SHIPPED = Path(__file__).parent / "preference"
PKU_KEYS = ("prompt", "response_0", "response_1", "better_response_id", "safer_response_id")
_LAYOUTS = ("TRL layout needs chosen, rejected (and prompt unless they are full conversations); "
            "PKU-SafeRLHF layout needs " + ", ".join(PKU_KEYS))


@dataclass(frozen=True)
class PreferencePair:
    """One prompt with a preferred and a dispreferred response, before tokenisation."""

    prompt: list[dict[str, str]]  # chat messages ending with the user turn
    chosen: str  # preferred assistant response
    rejected: str  # dispreferred assistant response
    chosen_safe: bool | None = None  # Safe RLHF label of each response; None when the file has none
    rejected_safe: bool | None = None
    margin: float = 0.0  # Llama-2 preference margin (0: plain Bradley-Terry)
    loc: str = ""  # file:line, for messages
    text: str | None = None  # the prompt as the row gave it when a string (None: chat messages)
    implicit: bool = False  # `text` is the shared beginning of whole texts (TRL's implicit prompt)


def resolve_data_path(path: str) -> str:
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        target = SHIPPED / f"{name}.jsonl"
        if not target.is_file():
            known = sorted(p.stem for p in SHIPPED.glob("*.jsonl"))
            raise DataError(f"no shipped preference file {path!r}; known: {', '.join('builtin:' + k for k in known)}")
        return str(target)
    return path


@dataclass(frozen=True)
class PairColumns:
    """The columns a TRL-layout row keeps its prompt and responses in (OpenRLHF's --prompt_key, --chosen_key,
    --rejected_key); the defaults are TRL's fixed names."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    def renamed(self, loc: str, row: dict[str, Any]) -> dict[str, Any]:
        """`row` with the named columns under TRL's names. A column named but absent is the file's mistake, except
        the prompt's: without it the responses' shared beginning is the prompt, as TRL's implicit prompt."""
        theirs = {c: t for c, t in ((self.prompt, "prompt"), (self.chosen, "chosen"), (self.rejected, "rejected"))
                  if c != t}
        if not theirs or "response_0" in row or "response_1" in row or "chosen_response" in row:
            return row  # TRL's names, or the PKU-SafeRLHF / Safe-MM-DPO layouts with their own
        missing = [f"{c} ({t}_key)" for c, t in theirs.items() if c not in row and t != "prompt"]
        if missing:
            raise DataError(f"{loc}: row is missing {', '.join(missing)}; its columns: {', '.join(map(str, row))}")
        kept = {k: v for k, v in row.items() if k not in theirs.values() and k not in theirs}
        return {**kept, **{t: row[c] for c, t in theirs.items() if c in row}}


def load_pairs(path: str, prefer: str = "better", limit: int | None = None,
               key: str = "the config's data file key", columns: PairColumns = PairColumns()) -> list[PreferencePair]:
    """Pairs of a .jsonl / .parquet file (or a `builtin:` name) in either layout (see module doc); `key`: the
    setting that named the file, for the errors; `columns`: where a TRL-layout row keeps its prompt and responses."""
    if prefer not in ("better", "safer"):
        raise ValueError(f"prefer must be 'better' or 'safer', got {prefer!r}")
    _, rows = _read_rows(resolve_data_path(path), limit, key=key)
    if not rows:
        raise DataError(f"{path}: file has no rows (a preference file needs one pair per line)")
    return [_pair(loc, columns.renamed(loc, row), prefer) for loc, row in rows]


def _text(loc: str, key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    msgs = _messages(loc, key, value)
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        raise DataError(f"{loc}: {key} must be a string or one assistant message "
                        "([{'role': 'assistant', 'content': ...}])")
    return msgs[0]["content"]


def _messages(loc: str, key: str, value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict) or not hasattr(value, "__iter__"):
        raise DataError(f"{loc}: {key} must be a string or a list of chat messages")
    out = []
    for m in value:  # any sequence of dicts, e.g. a numpy array from pandas-built parquet rows
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{loc}: a message in {key} lacks role/content "
                            "(each message must be {'role': ..., 'content': ...})")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    if not out:
        raise DataError(f"{loc}: {key} is an empty list of messages")
    return out


def _flag(loc: str, row: dict, key: str) -> bool | None:
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise DataError(f"{loc}: {key} must be true or false, got {value!r}")
    return value


def _differ(loc: str, keys: str, a: str, b: str) -> None:
    """A pair of identical responses has no preference to learn (its loss gradient is zero and it
    counts as a half-right pair in accuracy), so it is most likely a data bug: say so, by row."""
    if a == b:
        raise DataError(f"{loc}: {keys} are the same text, so the pair prefers nothing; drop the row or "
                        "fix one of the responses")


def _pair(loc: str, row: dict[str, Any], prefer: str) -> PreferencePair:
    if "response_0" in row or "response_1" in row:
        return _pku_pair(loc, row, prefer)
    if "chosen_response" in row or "rejected_response" in row:
        return _response_pair(loc, row)
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{loc}: row is missing {', '.join(missing)} ({_LAYOUTS})")
    text, implicit = _as_text(row.get("prompt")), "prompt" not in row
    if not implicit:
        prompt = _messages(loc, "prompt", row["prompt"])
        chosen, rejected = (_text(loc, key, _without_prompt(row["prompt"], prompt, row[key], row))
                            for key in ("chosen", "rejected"))
    else:
        prompt, chosen, rejected = _implicit_prompt(loc, row["chosen"], row["rejected"])
        text = prompt[0]["content"] if isinstance(row["chosen"], str) else None
    if prompt[-1]["role"] != "user":
        raise DataError(f"{loc}: prompt must end with a user message, not {prompt[-1]['role']!r}")
    margin = row.get("margin", 0.0)
    if not isinstance(margin, (int, float)) or isinstance(margin, bool):
        raise DataError(f"{loc}: margin must be a number, got {margin!r}")
    _differ(loc, "chosen and rejected", chosen, rejected)
    return PreferencePair(prompt, chosen, rejected, _flag(loc, row, "is_chosen_safe"),
                          _flag(loc, row, "is_rejected_safe"), float(margin), loc, text, implicit)


def _as_text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _without_prompt(raw_prompt: Any, prompt: list[dict[str, str]], value: Any, row: dict[str, Any]) -> Any:
    """A response that repeats its row's prompt (TRL's prompt + full conversation): the part after it. Both responses
    must repeat it for a text to count as repeated, so an answer that merely starts with the question's words stays."""
    if isinstance(value, str):
        both = isinstance(raw_prompt, str) and raw_prompt and all(
            isinstance(row[k], str) and row[k].startswith(raw_prompt) for k in ("chosen", "rejected"))
        return value[len(raw_prompt):] if both else value
    if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
        return value  # _text names what is wrong with it
    messages = list(value)
    n = len(prompt)
    if len(messages) > n and [dict(role=str(m.get("role")), content=str(m.get("content")))
                              for m in messages[:n] if isinstance(m, dict)] == prompt:
        return messages[n:]
    return messages


def _shared_prefix(a: Sequence, b: Sequence) -> int:
    """How long the beginning `a` and `b` share is; in text, a space before the first difference goes with the
    responses (as TRL's extract_prompt splits "The sky is| blue." / "The sky is| green.")."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if isinstance(a, str) and 0 < n < min(len(a), len(b)) and a[n - 1] == " ":
        n -= 1
    return n


def _implicit_prompt(loc: str, chosen: Any, rejected: Any) -> tuple[list[dict[str, str]], str, str]:
    """TRL's implicit prompt: chosen and rejected are whole texts, or whole conversations, and their shared
    beginning is the prompt (for texts, one user message holding it)."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = _shared_prefix(chosen, rejected)
        if not chosen[:n].strip():
            raise DataError(f"{loc}: row is missing prompt, and chosen and rejected share no beginning to take as "
                            "the prompt (give a prompt key, or full texts that start with the same prompt)")
        return [{"role": "user", "content": chosen[:n]}], chosen[n:], rejected[n:]
    c, r = _messages(loc, "chosen", chosen), _messages(loc, "rejected", rejected)
    n = _shared_prefix(c, r)
    rest = (c[n:], r[n:])
    if n == 0 or any(len(x) != 1 or x[0]["role"] != "assistant" for x in rest):
        raise DataError(f"{loc}: row is missing prompt (without it, chosen and rejected must be conversations "
                        "that differ only in their last, assistant message)")
    return c[:n], rest[0][0]["content"], rest[1][0]["content"]


def _pku_pair(loc: str, row: dict[str, Any], prefer: str) -> PreferencePair:
    id_key = f"{prefer}_response_id"
    missing = [k for k in ("prompt", "response_0", "response_1", id_key) if k not in row]
    if missing:
        raise DataError(f"{loc}: row is missing {', '.join(missing)} (PKU-SafeRLHF layout)")
    best = row[id_key]
    if isinstance(best, float) and best in (0.0, 1.0):  # pandas writes an int column with nulls as floats
        best = int(best)
    if best not in (0, 1) or type(best) is not int:
        raise DataError(f"{loc}: {id_key} must be 0 or 1, got {best!r}")
    safe = [_flag(loc, row, f"is_response_{i}_safe") for i in (0, 1)]
    responses = [_text(loc, f"response_{i}", row[f"response_{i}"]) for i in (0, 1)]
    _differ(loc, "response_0 and response_1", *responses)
    return PreferencePair(_messages(loc, "prompt", row["prompt"]), responses[best], responses[1 - best],
                          safe[best], safe[1 - best], 0.0, loc, _as_text(row["prompt"]))


def _response_pair(loc: str, row: dict[str, Any]) -> PreferencePair:
    """The Safe-MM-DPO project's rows (module doc)."""
    missing = [k for k in ("prompt", "chosen_response", "rejected_response") if k not in row]
    if missing:
        raise DataError(f"{loc}: row is missing {', '.join(missing)} (prompt/chosen_response/rejected_response layout)")
    chosen, rejected = (_text(loc, k, row[k]) for k in ("chosen_response", "rejected_response"))
    _differ(loc, "chosen_response and rejected_response", chosen, rejected)
    labels = row.get("safety_labels")
    safe: list[bool | None] = [None, None]
    if labels is not None:
        if not isinstance(labels, dict) or any(labels.get(k) not in (1, -1) or isinstance(labels.get(k), bool)
                                               for k in ("chosen", "rejected")):
            raise DataError(f"{loc}: safety_labels must be {{\"chosen\": ±1, \"rejected\": ±1}} (+1 harmful, "
                            f"-1 harmless), got {labels!r}")
        safe = [labels["chosen"] == -1, labels["rejected"] == -1]
    return PreferencePair(_messages(loc, "prompt", row["prompt"]), chosen, rejected, safe[0], safe[1], 0.0, loc,
                          _as_text(row["prompt"]))


def require_safety_labels(pairs: Sequence[PreferencePair], path: str) -> None:
    for p in pairs:
        if p.chosen_safe is None or p.rejected_safe is None:
            raise DataError(f"{p.loc or path}: row is missing is_chosen_safe/is_rejected_safe (or safety_labels) "
                            "(a cost model needs a safety label for both responses)")


# ---------------------------------------------------------------- tokenisation and collation


@dataclass(frozen=True)
class EncodedPair:
    prompt: list[int]  # chat-templated prompt with the generation prompt, left-truncated
    chosen: list[int]  # response tokens + eos, right-truncated
    rejected: list[int]
    index: int  # position in the dataset (keys precomputed reference log-probs)


def encode_pairs(tokenizer, pairs: Sequence[PreferencePair], max_length: int, chat_template: bool = True,
                 input_template: str | None = None) -> tuple[list[EncodedPair], int]:
    """Token ids of every pair, and how many were truncated. The prompt keeps at most half of
    `max_length` (its end, so the generation prompt stays); each response gets the rest. The prompt renders with
    the variables bound to `tokenizer` (chat_template_kwargs, `models.loader.with_template_variables`), or as text
    (`chat_template=False`, module doc)."""
    out, truncated = [], 0
    for i, p in enumerate(pairs):
        if not chat_template and input_template is not None:
            if p.text is None:
                raise needs_string_prompt(p.loc or "a pair")
            prompt, c, r = _openrlhf_pair(tokenizer, p, input_template)
        else:
            prompt = _prompt_ids(tokenizer, p, chat_template)
            c, r = (tokenizer(t + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                    for t in (p.chosen, p.rejected))
        prompt_cut = prompt[-(max_length // 2):]
        room = max_length - len(prompt_cut)
        truncated += len(prompt_cut) < len(prompt) or len(c) > room or len(r) > room
        out.append(EncodedPair(prompt_cut, c[:room], r[:room], i))
    return out, truncated


def _prompt_ids(tokenizer, p: PreferencePair, chat_template: bool) -> list[int]:
    """The prompt with the chat template's generation prompt; a string prompt without the chat template as it is,
    without special tokens (TRL's DPOTrainer tokenises a text prompt so)."""
    if not chat_template and p.text is not None:
        return list(tokenizer(p.text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _openrlhf_pair(tokenizer, p: PreferencePair, template: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids whose prompt + response is each response's OpenRLHF text exactly. The prompt is
    the prompt's own tokens (OpenRLHF's prompt_ids_len), or fewer where a token merging across its end differs
    between the two responses; each response keeps at least its last token (eos)."""
    head = str(p.text) if p.implicit else template.format(p.text)
    (c, n), (r, _) = (openrlhf_text(tokenizer, head, t) for t in (p.chosen, p.rejected))
    k = 0
    while k < min(n, len(c) - 1, len(r) - 1) and c[k] == r[k]:
        k += 1
    return c[:k], c[k:], r[k:]


def truncation_note(encoded: Sequence[EncodedPair], truncated: int, max_length: int) -> str:
    """The log's words for what encode_pairs cut: how many pairs, and how many of those lost the difference between
    their responses (both cut inside a shared beginning): they teach nothing, or for a cost model the same tokens as
    safe and unsafe."""
    same = sum(e.chosen == e.rejected for e in encoded)
    note = f"{truncated} pairs truncated to max_length={max_length}"
    return note + (f", {same} of them now with identical responses (raise max_length)" if same else "")


@dataclass
class PreferenceBatch:
    """B pairs stacked as 2B rows: rows [0, B) are the chosen responses, [B, 2B) the rejected ones,
    each after its own (left-padded) prompt, so one forward pass scores both."""

    prompt_ids: torch.Tensor  # (2B, P) long, left-padded
    prompt_mask: torch.Tensor  # (2B, P) bool
    response_ids: torch.Tensor  # (2B, R) long, right-padded
    response_mask: torch.Tensor  # (2B, R) bool
    index: torch.Tensor  # (B,) long, dataset positions of the pairs
    chosen_unsafe: torch.Tensor  # (B,) float 1/0 (0 where unlabelled)
    rejected_unsafe: torch.Tensor  # (B,) float
    margin: torch.Tensor  # (B,) float
    weight: torch.Tensor  # (B,) float: 1, or 0 on padding pairs that only keep ranks in step

    @property
    def n_pairs(self) -> int:
        return self.index.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> PreferenceBatch:
        return PreferenceBatch(*(t.to(device, non_blocking=non_blocking) for t in (
            self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask, self.index,
            self.chosen_unsafe, self.rejected_unsafe, self.margin, self.weight)))

    def pin_memory(self) -> PreferenceBatch:  # called by DataLoader(pin_memory=True)
        return PreferenceBatch(*(t.pin_memory() for t in (
            self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask, self.index,
            self.chosen_unsafe, self.rejected_unsafe, self.margin, self.weight)))


def collate_pairs(encoded: Sequence[EncodedPair], pairs: Sequence[PreferencePair], pad_id: int,
                  weights: Sequence[float] | None = None) -> PreferenceBatch:
    prompts = [e.prompt for e in encoded] * 2
    responses = [e.chosen for e in encoded] + [e.rejected for e in encoded]
    pi, pm = left_pad(prompts, pad_id)
    ri, rm = right_pad(responses, pad_id)
    src = [pairs[e.index] for e in encoded]
    flag = lambda v: 0.0 if v is None else float(not v)  # noqa: E731  unsafe = 1
    return PreferenceBatch(pi, pm, ri, rm, torch.tensor([e.index for e in encoded], dtype=torch.long),
                           torch.tensor([flag(p.chosen_safe) for p in src]),
                           torch.tensor([flag(p.rejected_safe) for p in src]),
                           torch.tensor([p.margin for p in src]),
                           torch.tensor(list(weights) if weights is not None else [1.0] * len(encoded)))
