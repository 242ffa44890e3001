"""KTO rows: unpaired feedback, a prompt with one completion labelled desirable or not; loading (.jsonl / .json /
.parquet), tokenising, and collation with the mismatched completions that estimate KL(π‖π_ref).

Two row layouts are understood (the key names are settings):

* unpaired (TRL's `prompt`, `completion`, `label`; OpenRLHF's `--input_key`, `--output_key`, `--label_key`): the
  label is a boolean (or 0/1), true for a desirable completion;
* paired (`prompt`, `chosen`, `rejected`): unpaired into two rows, the chosen completion desirable and the rejected
  one not (TRL's `unpair_preference_dataset`).

A prompt or completion is a string or a list of chat messages; both are tokenised as `data.sft_rows` tokenises a
prompt-completion row: rows holding messages always through the chat template; string rows with it (the prompt a
user turn with the generation prompt, the completion the assistant's reply as the template closes it), as
OpenRLHF's text with `input_template` (OpenRLHF's --input_template; `sft_rows.openrlhf_text`), or as text (the
completion closed by eos). A row longer than `max_length` keeps at most half of it for the prompt (from
its end) and cuts the completion at its end. Problems in a file raise `DataError` with one line naming file:line
and the key.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alignrl.data.collate import left_pad, right_pad
from alignrl.data.loaders import DataError, _read_rows
from alignrl.data.sft_rows import SFTKeys, SFTRow, _text_or_messages, encode_prompt_completion, openrlhf_text


@dataclass(frozen=True)
class KTOKeys:
    """Which columns hold what (the `alignrl train kto` settings of the same names)."""

    prompt: str = "prompt"
    completion: str = "completion"
    label: str = "label"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class KTORow:
    loc: str  # file:line, for messages
    prompt: str | list[dict[str, str]]
    completion: str | list[dict[str, str]]
    desirable: bool


def load_rows(path: str, keys: KTOKeys, limit: int | None = None, key: str = "train_files") -> list[KTORow]:
    """The rows of one file (a paired row gives two); `key`: the setting that named the file, for the errors."""
    _, rows = _read_rows(path, limit, key=key)
    if not rows:
        raise DataError(f"{path}: file has no rows ({key} needs one example per line)")
    return [out for loc, row in rows for out in _rows(loc, row, keys)]


def _rows(loc: str, row: dict[str, Any], keys: KTOKeys) -> list[KTORow]:
    if keys.completion in row:
        for k in (keys.prompt, keys.label):
            if k not in row:
                raise DataError(f"{loc}: row has {keys.completion} but is missing {k} (unpaired rows need "
                                f"{keys.prompt}, {keys.completion} and {keys.label}; set prompt_key/label_key)")
        return [KTORow(loc, _text_or_messages(loc, keys.prompt, row[keys.prompt]),
                       _text_or_messages(loc, keys.completion, row[keys.completion]),
                       _label(loc, keys.label, row[keys.label]))]
    if keys.chosen in row or keys.rejected in row:
        missing = [k for k in (keys.prompt, keys.chosen, keys.rejected) if k not in row]
        if missing:
            raise DataError(f"{loc}: paired row is missing {missing[0]} (paired rows need {keys.prompt}, "
                            f"{keys.chosen} and {keys.rejected})")
        prompt = _text_or_messages(loc, keys.prompt, row[keys.prompt])
        return [KTORow(loc, prompt, _text_or_messages(loc, keys.chosen, row[keys.chosen]), True),
                KTORow(loc, prompt, _text_or_messages(loc, keys.rejected, row[keys.rejected]), False)]
    raise DataError(f"{loc}: row has neither {keys.completion} (unpaired: {keys.prompt}, {keys.completion}, "
                    f"{keys.label}) nor {keys.chosen}/{keys.rejected} (paired); its keys are "
                    f"{', '.join(map(str, row))[:120]} (set prompt_key, completion_key, label_key)")


def _label(loc: str, key: str, value: Any) -> bool:
    """True for a desirable completion: a boolean (numpy's too, from parquet) or the integers 0 and 1."""
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    raise DataError(f"{loc}: {key} must be true or false (desirable or not), got {value!r:.60}")


# ---------------------------------------------------------------- tokenisation


@dataclass(frozen=True)
class EncodedKTO:
    prompt: list[int]
    completion: list[int]
    desirable: bool
    index: int  # position in the data set
    # OpenRLHF's text (input_template): the formatted prompt and the completion, which a mismatched row joins as text
    texts: tuple[str, str] | None = None


def encode_rows(tokenizer, rows: Sequence[KTORow], chat_template: bool, max_length: int,
                input_template: str | None = None) -> tuple[list[EncodedKTO], int]:
    """(the encoded rows, how many were cut at `max_length`); `chat_template`: string rows through it too; else with
    `input_template`, string rows as OpenRLHF's text. Chat rendering uses the variables bound to `tokenizer`
    (chat_template_kwargs)."""
    keys = SFTKeys(chat_template=chat_template, completion_only=True, input_template=input_template)
    out, cut = [], 0
    for row in rows:
        ids, trained = encode_prompt_completion(tokenizer, SFTRow(row.loc, prompt=row.prompt,
                                                                  completion=row.completion), keys)
        head = trained.index(True) if True in trained else len(ids)
        prompt, completion = ids[:head], ids[head:]
        if len(prompt) + len(completion) > max_length:
            cut += 1
            prompt = prompt[len(prompt) - min(len(prompt), max(max_length // 2, max_length - len(completion))):]
            completion = completion[:max_length - len(prompt)]
        if not completion:
            raise DataError(f"{row.loc}: the completion has no tokens")
        texts = (input_template.format(row.prompt), str(row.completion)) if (
            input_template is not None and not chat_template and isinstance(row.prompt, str)) else None
        out.append(EncodedKTO(prompt, completion, row.desirable, len(out), texts))
    return out, cut


# ---------------------------------------------------------------- batches


@dataclass
class KTOBatch:
    """Rows [0, B): each prompt with its own completion; rows [B, 2B), when the loss needs the KL estimate: each prompt
    with a mismatched completion. The prompt is left-padded and the completion right-padded (`pair_logps` reads it
    as it reads a preference batch's chosen and rejected halves). `weight` 0 marks the padding rows of an evaluation
    share; `global_rows`: the rows of the whole optimizer step, what the summed loss is divided by."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    desirable: torch.Tensor  # (B,) bool
    index: torch.Tensor  # (B,) long
    weight: torch.Tensor  # (B,) float
    global_rows: float

    @property
    def n_pairs(self) -> int:  # `pair_logps`' name for B
        return self.index.shape[0]

    @property
    def has_kl(self) -> bool:
        return self.prompt_ids.shape[0] == 2 * self.n_pairs

    def _map(self, fn) -> KTOBatch:
        return KTOBatch(*(fn(t) for t in (self.prompt_ids, self.prompt_mask, self.response_ids, self.response_mask,
                                          self.desirable, self.index, self.weight)), self.global_rows)

    def to(self, device: torch.device, non_blocking: bool = False) -> KTOBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KTOBatch:  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


def shifted(items: Sequence) -> list:
    """Row i's mismatched partner: row i + 1, the last row taking the first (OpenRLHF's pairing)."""
    return list(items[1:]) + list(items[:1])


def mismatched(rows: Sequence[EncodedKTO], tokenizer=None) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, completions) of the mismatched rows: row i's prompt with row i + 1's completion (`shifted`). Rows
    of OpenRLHF's text are that joined text tokenized anew, as OpenRLHF's KL rows are (a token merging across the
    prompt's end merges with the other completion); other rows join the ids."""
    prompts, completions = [], []
    for own, other in zip(rows, shifted(rows)):
        if tokenizer is not None and own.texts is not None and other.texts is not None:
            ids, head = openrlhf_text(tokenizer, own.texts[0], other.texts[1])
            prompts.append(ids[:head])
            completions.append(ids[head:])
        else:
            prompts.append(own.prompt)
            completions.append(other.completion)
    return prompts, completions


def collate_rows(encoded: Sequence[EncodedKTO], pad_id: int, global_rows: float, kl_completions=None,
                 weights: Sequence[float] | None = None, max_length: int | None = None,
                 kl_prompts: Sequence[list[int]] | None = None) -> KTOBatch:
    """A batch of `encoded`; with `kl_completions` (one per row) the mismatched rows too, each cut at `max_length`,
    on each row's own prompt or on `kl_prompts`."""
    prompts, completions = [e.prompt for e in encoded], [e.completion for e in encoded]
    if kl_completions is not None:
        kl_p = list(kl_prompts) if kl_prompts is not None else prompts
        room = [max(1, (max_length or 10**9) - len(p)) for p in kl_p]
        prompts, completions = prompts + kl_p, completions + [c[:r] for c, r in zip(kl_completions, room)]
    pi, pm = left_pad(prompts, pad_id)
    ri, rm = right_pad(completions, pad_id)
    return KTOBatch(pi, pm, ri, rm, torch.tensor([e.desirable for e in encoded], dtype=torch.bool),
                    torch.tensor([e.index for e in encoded], dtype=torch.long),
                    torch.tensor(list(weights) if weights is not None else [1.0] * len(encoded)), float(global_rows))
