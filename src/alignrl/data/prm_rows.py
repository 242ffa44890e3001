"""Process-reward rows: a solution cut into steps, a label for each step; loading (.jsonl / .json / .parquet),
tokenising and collation for `alignrl train prm`.

Two row layouts are read (the column names are settings):

* placeholder text (OpenRLHF's `--input_key`, `--label_key`): `{"input": "step one ки\\nstep two ки", "label":
  ["+", "-"]}`, each step ending in the placeholder token, one label per placeholder;
* stepwise (TRL's stepwise supervision): `{"prompt": ..., "completions": [step, ...], "labels": [true, ...]}`,
  which becomes the placeholder form: the prompt, then each step followed by the placeholder and `step_separator`.

A label is one of the reward tokens ("+"), a boolean (true: the first reward token, the positive one; false: the
second) or a number p in [0, 1] (a soft label: p on the first of two reward tokens, 1 - p on the second). Each is kept
as its target distribution over the reward tokens. Read without reward tokens (the whole-vocabulary loss, OpenRLHF's
--reward_tokens unset), a label is a text alone, the label token itself: the rows keep their texts, and once every
file's distinct labels are known (`distinct_labels`, `positive_first`) `over_label_tokens` makes them one-hot targets
over those.

No special tokens are added (OpenRLHF's `add_special_tokens=False`). A placeholder-text row is tokenised whole, as
OpenRLHF and a plain-transformers reader tokenise it, and the placeholder's ids in it are the steps, when there is one
per label. Where the whole text holds another count (the placeholder merged with a neighbour into another token, as
" ки" can), its pieces between placeholders are tokenised one by one with the placeholder's id put between them, so
that every step still has its position; such rows are counted. A stepwise row is always tokenised piece by piece (TRL
tokenises each step on its own too; the prompt goes with the first step). A row longer than
`max_length` keeps its whole steps that fit (the text after the last of them is cut) and the count of labels dropped
is reported; a row none of whose steps fits is dropped. Problems raise `DataError` with one line naming file:line.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from alignrl.data.collate import right_pad
from alignrl.data.loaders import DataError, _read_rows


@dataclass(frozen=True)
class PRMKeys:
    """Which columns hold what (the `alignrl train prm` settings of the same names)."""

    input: str = "input"
    prompt: str = "prompt"
    completions: str = "completions"
    label: str = "labels"


@dataclass(frozen=True)
class PRMRow:
    loc: str  # file:line, for messages
    pieces: tuple[str, ...]  # the text before each placeholder, then the text after the last one
    targets: tuple[tuple[float, ...], ...]  # one distribution over the reward tokens per step
    text: str | None = None  # a placeholder-text row's own text, tokenised whole first; None: a stepwise row
    labels: tuple[str, ...] = ()  # read without reward tokens: each step's label text, until `over_label_tokens`

    @property
    def n_steps(self) -> int:
        return len(self.targets) or len(self.labels)


def load_rows(path: str, keys: PRMKeys, placeholder: str, reward_tokens: Sequence[str], step_separator: str = "\n",
              limit: int | None = None, key: str = "train_files") -> list[PRMRow]:
    """The rows of one file; `key`: the setting that named the file, for the errors."""
    _, rows = _read_rows(path, limit, key=key)
    if not rows:
        raise DataError(f"{path}: file has no rows ({key} needs one solution per line)")
    return [read_row(loc, row, keys, placeholder, reward_tokens, step_separator) for loc, row in rows]


def read_row(loc: str, row: dict, keys: PRMKeys, placeholder: str, reward_tokens: Sequence[str],
             step_separator: str = "\n") -> PRMRow:
    """One row of either layout in the placeholder form."""
    if keys.label not in row:
        raise DataError(f"{loc}: row has no {keys.label} (one label per step; its keys are "
                        f"{', '.join(map(str, row))[:120]}; set label_key)")
    labels = _labels(loc, keys.label, row[keys.label], reward_tokens)  # targets, or texts without reward tokens
    text = None
    if keys.completions in row:
        pieces = _stepwise(loc, row, keys, placeholder, step_separator, len(labels))
    elif keys.input in row:
        text = row[keys.input]
        if not isinstance(text, str):
            raise DataError(f"{loc}: {keys.input} must be a text with a placeholder after each step, got "
                            f"{type(text).__name__}")
        pieces = tuple(text.split(placeholder))
        if len(pieces) - 1 != len(labels):
            raise DataError(f"{loc}: {len(pieces) - 1} placeholders ({placeholder!r}) in {keys.input} but "
                            f"{len(labels)} labels in {keys.label}; each step ends in one placeholder and has one "
                            "label" + ("; set placeholder_token to the rows' own" if len(pieces) == 1 else ""))
    else:
        raise DataError(f"{loc}: row has neither {keys.input} (a text with placeholders) nor {keys.completions} "
                        f"(stepwise: {keys.prompt}, {keys.completions}, {keys.label}); its keys are "
                        f"{', '.join(map(str, row))[:120]} (set input_key or completions_key)")
    if not reward_tokens:
        return PRMRow(loc, pieces, (), text, labels)
    return PRMRow(loc, pieces, labels, text)


def _stepwise(loc: str, row: dict, keys: PRMKeys, placeholder: str, separator: str, n_labels: int
              ) -> tuple[str, ...]:
    steps, prompt = row[keys.completions], row.get(keys.prompt, "")
    if not isinstance(prompt, str):
        raise DataError(f"{loc}: {keys.prompt} must be a text, got {type(prompt).__name__} (chat messages are not "
                        "read as a stepwise prompt)")
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, str) for s in steps):
        raise DataError(f"{loc}: {keys.completions} must be a list of step texts")
    if len(steps) != n_labels:
        raise DataError(f"{loc}: {len(steps)} steps in {keys.completions} but {n_labels} labels in {keys.label}; "
                        "give one label per step")
    for i, text in enumerate([prompt, *steps]):
        if placeholder in text:
            where = keys.prompt if i == 0 else f"step {i} of {keys.completions}"
            raise DataError(f"{loc}: {where} holds the placeholder token {placeholder!r} itself; pick a "
                            "placeholder_token no row's text contains")
    # the prompt joins the first step's text; each step's end (its placeholder) is followed by the separator
    return (prompt + steps[0], *(separator + s for s in steps[1:]), separator) if steps else (prompt,)


def _labels(loc: str, key: str, value, reward_tokens: Sequence[str]) -> tuple:
    if hasattr(value, "tolist"):  # a parquet column's array
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{loc}: {key} must be a non-empty list, one label per step, got {value!r:.60}")
    if not reward_tokens:
        return tuple(label_text(loc, key, v) for v in value)
    return tuple(label_target(loc, key, v, reward_tokens) for v in value)


def label_text(loc: str, key: str, value) -> str:
    """A label read without reward tokens: the text of its label token (OpenRLHF's labels as tokens)."""
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
        raise DataError(f"{loc}: a boolean label ({value}) of {key} means the first or second reward token, and "
                        "reward_tokens=[] (the whole-vocabulary loss) names none: give reward_tokens, e.g. "
                        "--reward_tokens + -, or write each label as its token's text")
    if isinstance(value, numbers.Real):
        raise DataError(f"{loc}: a number label ({value}) of {key} is a soft label, which needs two reward tokens "
                        "(OpenRLHF asserts it too): give reward_tokens, e.g. --reward_tokens + -")
    if not isinstance(value, str) or not value:
        raise DataError(f"{loc}: label {value!r:.40} of {key} is not a label token's text (with reward_tokens=[] "
                        "each label is the text of one token, e.g. \"+\")")
    return value


# (positive, negative) label texts whose sides can be told apart without being named: the first is what a scorer
# reads as "this step is good"
POSITIVE_NEGATIVE = (("+", "-"), ("yes", "no"), ("Yes", "No"), ("good", "bad"), ("Good", "Bad"),
                     ("correct", "incorrect"), ("Correct", "Incorrect"), ("true", "false"), ("True", "False"),
                     ("right", "wrong"), ("Right", "Wrong"), ("positive", "negative"), ("Positive", "Negative"))


def distinct_labels(rows: Sequence[PRMRow]) -> list[str]:
    """The distinct label texts of rows read without reward tokens, in order of first appearance."""
    return list(dict.fromkeys(t for row in rows for t in row.labels))


def positive_first(texts: Sequence[str]) -> tuple[list[str], str | None]:
    """(the label texts ordered for scoring, the positive one or None): where every text is a side of one known
    (positive, negative) pair, the pair itself, positive first (its other side added when the data had one side
    only); else the texts as given, which one is positive unknown."""
    for pair in POSITIVE_NEGATIVE:
        if texts and set(texts) <= set(pair):
            return list(pair), pair[0]
    return list(texts), None


def over_label_tokens(rows: Sequence[PRMRow], tokens: Sequence[str]) -> list[PRMRow]:
    """Rows read without reward tokens with each step's target one-hot over `tokens` (which hold every label)."""
    return [replace(row, targets=tuple(tuple(float(t == label) for t in tokens) for label in row.labels))
            if row.labels else row for row in rows]


def label_target(loc: str, key: str, value, reward_tokens: Sequence[str]) -> tuple[float, ...]:
    """A label's target distribution over the reward tokens."""
    k = len(reward_tokens)
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
        return tuple(float(i == (0 if value else 1)) for i in range(k))
    if isinstance(value, str):
        if value not in reward_tokens:
            raise DataError(f"{loc}: label {value!r} of {key} is not one of the reward tokens "
                            f"{' '.join(reward_tokens)} (set reward_tokens)")
        return tuple(float(t == value) for t in reward_tokens)
    if isinstance(value, numbers.Real) and 0.0 <= float(value) <= 1.0:
        if k != 2:
            raise DataError(f"{loc}: a number label ({value}) is a soft label, P(the first reward token), which needs "
                            f"exactly two reward tokens, not {k}")
        return (float(value), 1.0 - float(value))
    raise DataError(f"{loc}: label {value!r:.40} of {key} is neither a reward token ({' '.join(reward_tokens)}), a "
                    "boolean, nor a number in [0, 1]")


# ---------------------------------------------------------------- tokenisation


def single_token(tokenizer, text: str, key: str) -> int:
    """The id of `text` when the tokenizer reads it as one token; else a one-line error saying how to fix it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise DataError(f"{key} {text!r} is {len(ids)} tokens in this tokenizer, not one; pick a text that is one "
                        "token, or add it to the tokenizer as a special token (tokenizer.add_special_tokens and "
                        "model.resize_token_embeddings, then save the model)")
    return ids[0]


@dataclass(frozen=True)
class EncodedPRM:
    ids: list[int]
    steps: list[int]  # the position of each step's placeholder in ids
    targets: list[tuple[float, ...]]
    index: int  # position in the data set


def encode_pieces(tokenizer, pieces: Sequence[str], placeholder_id: int) -> tuple[list[int], list[int]]:
    """(ids, placeholder positions) of text pieces with the placeholder between each two."""
    ids: list[int] = []
    steps: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(pieces) - 1:
            steps.append(len(ids))
            ids.append(placeholder_id)
    return ids, steps


def encode_text(tokenizer, text: str | None, pieces: Sequence[str], placeholder_id: int
                ) -> tuple[list[int], list[int], bool]:
    """(ids, placeholder positions, whether the pieces stood in for `text`): `text` (a placeholder-text row's own)
    tokenised whole when its placeholder ids number the steps (len(pieces) - 1), else, or with no `text`, the
    pieces with the placeholder's id between them (`encode_pieces`)."""
    if text is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        steps = [i for i, t in enumerate(ids) if t == placeholder_id]
        if len(steps) == len(pieces) - 1:
            return ids, steps, False
    ids, steps = encode_pieces(tokenizer, pieces, placeholder_id)
    return ids, steps, text is not None


def encode_rows(tokenizer, rows: Sequence[PRMRow], placeholder_id: int, max_length: int
                ) -> tuple[list[EncodedPRM], dict[str, int]]:
    """(the encoded rows, counts: rows cut at max_length, labels dropped by the cut, rows dropped whole, and
    placeholder-text rows tokenised piece by piece as their whole text did not hold one placeholder per label)."""
    out: list[EncodedPRM] = []
    notes = {"truncated_rows": 0, "dropped_labels": 0, "dropped_rows": 0, "piece_rows": 0}
    for row in rows:
        ids, steps, by_pieces = encode_text(tokenizer, row.text, row.pieces, placeholder_id)
        notes["piece_rows"] += by_pieces
        targets = list(row.targets)
        if len(ids) > max_length:
            kept = sum(p < max_length for p in steps)
            notes["truncated_rows"] += 1
            notes["dropped_labels"] += len(steps) - kept
            if kept == 0:
                notes["dropped_rows"] += 1
                continue
            steps, targets = steps[:kept], targets[:kept]
            ids = ids[:steps[-1] + 1]  # whole steps only: the text after the last one that fits goes
        out.append(EncodedPRM(ids, steps, targets, len(out)))
    return out, notes


# ---------------------------------------------------------------- batches


@dataclass
class PRMBatch:
    """Right-padded rows; `step_mask` marks the placeholder positions that count, `targets` (B, T, K) their target
    distributions (zeros elsewhere); `total_steps`: the counted steps of the whole optimizer step."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    step_mask: torch.Tensor
    targets: torch.Tensor
    index: torch.Tensor
    total_steps: float

    @property
    def n_pairs(self) -> int:  # `common.train_pairs`' name for the rows
        return self.index.shape[0]

    def _map(self, fn) -> PRMBatch:
        return PRMBatch(*(fn(t) for t in (self.input_ids, self.attention_mask, self.step_mask, self.targets,
                                          self.index)), self.total_steps)

    def to(self, device: torch.device, non_blocking: bool = False) -> PRMBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PRMBatch:  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


def counted_steps(row: EncodedPRM, last_only: bool) -> list[int]:
    """Which of a row's steps count: all, or with `last_only` (TRL's train_on_last_step_only) its last one."""
    return [len(row.steps) - 1] if last_only and row.steps else list(range(len(row.steps)))


def collate_rows(rows: Sequence[EncodedPRM], pad_id: int, n_tokens: int, total_steps: float = 0.0,
                 last_only: bool = False, counted: Sequence[bool] | None = None) -> PRMBatch:
    """A batch of `rows` over `n_tokens` reward tokens; `counted[i]` false: row i counts no step (the padding rows of
    an evaluation share)."""
    ids, mask = right_pad([r.ids for r in rows], pad_id)
    steps = torch.zeros(ids.shape, dtype=torch.bool)
    targets = torch.zeros((*ids.shape, n_tokens), dtype=torch.float32)
    for i, row in enumerate(rows):
        if counted is not None and not counted[i]:
            continue
        for j in counted_steps(row, last_only):
            steps[i, row.steps[j]] = True
            targets[i, row.steps[j]] = torch.tensor(row.targets[j])
    return PRMBatch(ids, mask, steps, targets, torch.tensor([r.index for r in rows], dtype=torch.long),
                    float(total_steps))
