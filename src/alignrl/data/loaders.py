"""Load task datasets from disk into `Sample` records, and write them back.

Two on-disk layouts are understood, so that stock GSM8K dumps and verl-preprocessed datasets work
without a conversion step:

* GSM8K: rows with `question` and `answer`, where the answer ends in `#### <final answer>`.
* verl: rows with `prompt` (chat messages), `data_source`, `reward_model` ({ground_truth, style})
  and optional `extra_info`.

Both may be stored as `.jsonl` or `.parquet`. Problems with the user's data raise `DataError` with a
one-line message naming the file (and line or row) and the fix, instead of a deep traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from alignrl.config.checks import data_files
from alignrl.data.records import Sample

GSM8K_COLUMNS = ("question", "answer")
VERL_COLUMNS = ("prompt", "data_source", "reward_model")
_FORMATS = {"gsm8k": GSM8K_COLUMNS, "verl": VERL_COLUMNS}
_NEEDS = "GSM8K needs question, answer; verl needs prompt, data_source, reward_model"

# (location for error messages, row)
_Row = tuple[str, dict[str, Any]]


class DataError(ValueError):
    """A dataset file is missing or malformed; the message says what to change."""


def load_samples(
    path: str | list[str],
    fmt: str = "auto",
    *,
    system_prompt: str | None = None,
    limit: int | None = None,
    key: str = "data.train_files",
) -> list[Sample]:
    """Read `path` (.jsonl or .parquet, or a list of them, concatenated) in format "gsm8k", "verl" or
    "auto" (chosen by columns, per file).

    `system_prompt`, when given, is prepended to prompts that do not already start with a system
    message. `limit` keeps only the first rows, which keeps smoke runs cheap on big files. `key` is
    the config key that named the file, for messages (e.g. "data.val_files").
    """
    if not isinstance(path, str):
        samples: list[Sample] = []
        for one in data_files(path):
            left = None if limit is None else limit - len(samples)
            if left is not None and left <= 0:
                break
            samples += load_samples(one, fmt, system_prompt=system_prompt, limit=left, key=key)
        if not samples:
            raise DataError(f"{key} is an empty list (give one or more .jsonl/.parquet files)")
        return samples
    if fmt != "auto" and fmt not in _FORMATS:
        raise DataError(f"unknown data format {fmt!r} (use 'auto', 'gsm8k' or 'verl')")
    columns, rows = _read_rows(path, limit, key)
    if not rows:
        raise DataError(f"{path}: file has no rows (point {key} at a non-empty dataset)")
    fmt = _detect_format(path, columns, fmt)
    convert: Callable[[str, dict[str, Any], str | None], Sample] = (
        _gsm8k_sample if fmt == "gsm8k" else _verl_sample
    )
    samples = []
    for loc, row in rows:
        missing = [c for c in _FORMATS[fmt] if c not in row]
        if missing:
            raise DataError(f"{loc}: row is missing {', '.join(missing)} (every {fmt} row needs "
                            f"{', '.join(_FORMATS[fmt])})")
        samples.append(dataclasses.replace(convert(loc, row, system_prompt), source=loc))
    return samples


def gsm8k_ground_truth(answer: str) -> str | None:
    """The final answer after the last `####` (commas removed), or None when there is none."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


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


def write_gsm8k_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write rows (dicts with at least question/answer) as JSON lines, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    _atomic_write(path, write)


def write_verl_parquet(samples: list[Sample], path: str | os.PathLike[str]) -> None:
    """Write samples in verl's parquet layout, atomically, so verl and `load_samples` can read it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records: list[dict[str, Any]] = [
        {
            "data_source": s.data_source,
            "prompt": [{"role": m["role"], "content": m["content"]} for m in s.messages],
            "reward_model": {"style": "rule", "ground_truth": s.ground_truth},
            "extra_info": dict(s.extra),
        }
        for s in samples
    ]
    # Parquet cannot store a struct with no fields, so an all-empty extra_info column is dropped.
    if all(not r["extra_info"] for r in records):
        for r in records:
            del r["extra_info"]
    table = pa.Table.from_pylist(records)
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def check_data_file(path: str, key: str = "data.train_files") -> None:
    """That `path` exists with a readable extension, else a DataError naming `key` (the config key
    that gave it): cheap enough to run before a launch, ahead of any model load."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {path} (set {key} to an existing .jsonl or .parquet file)")
    if p.suffix.lower() not in (".jsonl", ".parquet"):
        raise DataError(f"unsupported data file extension {p.suffix!r} for {path} (use .jsonl or .parquet)")


def check_sources(path: str, known: Collection[str], key: str = "data.train_files") -> None:
    """A DataError naming the first row whose `data_source` is not in `known` (the sources with a
    built-in reward), read before any model loads: otherwise the run fails at its first reward."""
    if Path(path).suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            column = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        except Exception:  # no such column (GSM8K layout) or an unreadable file: load_samples reports it
            return
        located = ((f"{path} row {i}", v) for i, v in enumerate(column))
    else:
        located = ((loc, row.get("data_source")) for loc, row in _iter_jsonl(path) if "data_source" in row)
    for loc, source in located:
        if str(source) not in known:
            raise DataError(f"{loc}: no reward for data_source {source!r} (known: {', '.join(sorted(known))}; "
                            f"fix the data_source in {key} or pass algorithm.reward_fn=path/to/file.py:function)")


def count_rows(path: str) -> int:
    """Rows of a data file without reading them all (parquet: from its footer)."""
    check_data_file(path)
    if Path(path).suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as exc:  # pyarrow raises several types for a corrupt footer
            raise DataError(f"could not read parquet file {path}: {str(exc).strip()[:120]} "
                            "(check the file is a valid parquet table)") from None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _read_rows(path: str, limit: int | None, key: str = "data.train_files") -> tuple[list[str], list[_Row]]:
    check_data_file(path, key)
    if Path(path).suffix.lower() == ".parquet":
        return _read_parquet(path, limit)
    rows = []
    for row in _iter_jsonl(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(row)
    return (list(rows[0][1]) if rows else []), rows


def _read_parquet(path: str, limit: int | None) -> tuple[list[str], list[_Row]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"could not read parquet file {path}: {first_line} "
                        "(check the file is a valid parquet table)") from exc
    if limit is not None:
        table = table.slice(0, limit)
    return table.column_names, [(f"{path} row {i}", r) for i, r in enumerate(table.to_pylist())]


def _iter_jsonl(path: str) -> Iterator[_Row]:
    # Bytes, decoded line by line: a text-mode file decodes whole buffers ahead of the line being read,
    # so its UnicodeDecodeError would point at an earlier line than the bad byte's.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            loc = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{loc}: line is not UTF-8 text (re-save the file as UTF-8 JSON lines)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{loc}: line is not valid JSON ({exc.msg}) "
                                "(each line of a .jsonl file must be one JSON object)") from None
            if not isinstance(row, dict):
                raise DataError(f"{loc}: line is a JSON {type(row).__name__}, not an object "
                                "(each line of a .jsonl file must be one JSON object)")
            yield loc, row


def _detect_format(path: str, columns: list[str], fmt: str) -> str:
    if fmt == "auto":
        for name, required in _FORMATS.items():
            if all(c in columns for c in required):
                return name
        raise DataError(f"{path}: cannot tell the data format from columns {sorted(columns)} ({_NEEDS})")
    missing = [c for c in _FORMATS[fmt] if c not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} for format {fmt!r} "
                        f"(found {sorted(columns)}; {_NEEDS})")
    return fmt


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _gsm8k_sample(loc: str, row: dict[str, Any], system_prompt: str | None) -> Sample:
    answer = str(row["answer"])
    truth = gsm8k_ground_truth(answer)
    if truth is None:
        raise DataError(f"{loc}: GSM8K answer has no '#### <answer>' line "
                        "(end every answer with '#### <final answer>')")
    messages = _with_system([{"role": "user", "content": str(row["question"])}], system_prompt)
    return Sample(messages=messages, ground_truth=truth, data_source="gsm8k", extra={"answer": answer})


def _verl_sample(loc: str, row: dict[str, Any], system_prompt: str | None) -> Sample:
    prompt = row["prompt"]
    if isinstance(prompt, (str, dict)) or not hasattr(prompt, "__iter__"):
        raise DataError(f"{loc}: prompt must be a list of chat messages "
                        "(e.g. [{'role': 'user', 'content': '...'}])")
    messages = []
    for m in prompt:  # any sequence of dicts, e.g. a numpy array from pandas-built rows
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{loc}: prompt message {m!r:.80} lacks role/content "
                            "(each message must be {'role': ..., 'content': ...})")
        messages.append({"role": str(m["role"]), "content": str(m["content"])})
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{loc}: reward_model has no ground_truth "
                        "(set reward_model to {'style': 'rule', 'ground_truth': ...})")
    return Sample(
        messages=_with_system(messages, system_prompt),
        ground_truth=plain_ground_truth(reward_model["ground_truth"]),
        data_source=str(row["data_source"]),
        extra=dict(row.get("extra_info") or {}),
    )


def _atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Write via a temp file in the target directory, so readers never see a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
