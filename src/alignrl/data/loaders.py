"""Load task datasets from disk into `Sample` records, and write them back.

Three on-disk layouts are understood, so that stock GSM8K dumps, verl-preprocessed datasets and
OpenRLHF prompt sets work without a conversion step:

* GSM8K: rows with `question` and `answer`, where the answer ends in `#### <final answer>`.
* verl: rows with `prompt` (chat messages), `data_source`, `reward_model` ({ground_truth, style})
  and optional `extra_info`.
* by column, when `prompt_key` is given (data.prompt_key; OpenRLHF's --input_key): the prompt and the
  answer come from the named columns (rules in `alignrl.data.row_formats`).

GSM8K and verl are detected from the columns when no `prompt_key` is given. Files may be `.jsonl`,
`.json` (one array of objects, or JSON lines) or `.parquet`. Problems with the user's data raise
`DataError` with a one-line message naming the file (and line or row) and the fix, instead of a deep
traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from alignrl.config.checks import data_files
# DataError lives in layouts (which raises it too); the package imports it from here
from alignrl.data.row_formats import (DataError, PromptKeys, chat_messages, json_array_rows, keys_sample,
                                  plain_ground_truth, with_system)
from alignrl.data.blend import blended_units
from alignrl.data.images import with_row_images
from alignrl.data.records import Sample
from alignrl.data.sources import is_library_dataset, library_count, library_rows
from alignrl.data.verl_dataset import dataset_class_rows, verl_data_config
from alignrl.utils.atomic import atomic_write

GSM8K_COLUMNS = ("question", "answer")
VERL_COLUMNS = ("prompt", "data_source", "reward_model")
_FORMATS = {"gsm8k": GSM8K_COLUMNS, "verl": VERL_COLUMNS}
_NEEDS = "GSM8K needs question, answer; verl needs prompt, data_source, reward_model"
_BY_COLUMN = "for other columns set data.prompt_key=<prompt column> and data.label_key=<answer column>"

# (location for error messages, row)
_Row = tuple[str, dict[str, Any]]


def load_samples(
    path: str | list[str],
    fmt: str = "auto",
    *,
    system_prompt: str | None = None,
    limit: int | None = None,
    key: str = "data.train_files",
    prompt_key: str | None = None,
    label_key: str | None = None,
    input_template: str | None = None,
    apply_chat_template: bool = True,
    image_key: str = "images",
) -> list[Sample]:
    """Read `path` (.jsonl, .json or .parquet, or a list of them, concatenated) in format "gsm8k",
    "verl" or "auto" (chosen by columns, per file); with `prompt_key`, by column instead (`label_key`,
    `input_template` and `apply_chat_template` as the data.* config keys of those names describe). Rows with
    images (the layouts of `alignrl.data.images`; `image_key` names the image column) carry them in `Sample.images`.

    `system_prompt`, when given, is prepended to chat prompts that do not already start with a system
    message. `limit` keeps only the first rows, which keeps smoke runs cheap on big files. `key` is
    the config key that named the file, for messages (e.g. "data.val_files").
    """
    keys = dict(prompt_key=prompt_key, label_key=label_key, input_template=input_template,
                apply_chat_template=apply_chat_template, image_key=image_key)
    if not isinstance(path, str):
        samples: list[Sample] = []
        for one in data_files(path):
            left = None if limit is None else limit - len(samples)
            if left is not None and left <= 0:
                break
            samples += load_samples(one, fmt, system_prompt=system_prompt, limit=left, key=key, **keys)
        if not samples:
            raise DataError(f"{key} is an empty list (give one or more .jsonl/.json/.parquet files)")
        return samples
    if fmt != "auto" and fmt not in _FORMATS:
        raise DataError(f"unknown data format {fmt!r} (use 'auto', 'gsm8k' or 'verl')")
    columns, rows = _read_rows(path, limit, key)
    if not rows:
        raise DataError(f"{path}: file has no rows (point {key} at a non-empty dataset)")
    base = Path(path).parent  # relative image paths may be relative to the data file

    def placed(loc: str, row: dict[str, Any], sample: Sample) -> Sample:
        return with_row_images(loc, dataclasses.replace(sample, source=loc), row, image_key, base)

    if prompt_key is not None:
        by_column = PromptKeys(prompt_key, label_key, input_template, apply_chat_template, image_key)
        return [placed(loc, row, keys_sample(loc, row, by_column, system_prompt)) for loc, row in rows]
    return _converted(rows, _detect_format(path, columns, fmt), system_prompt, placed)


def verl_samples(rows: list[dict[str, Any]], where: str, *, system_prompt: str | None = None,
                 image_key: str = "images") -> list[Sample]:
    """Rows in verl's layout made elsewhere (a verl dataset class, `data.verl_dataset`), as samples; `where` names
    their maker in messages. Relative image paths are taken from the working folder."""

    def placed(loc: str, row: dict[str, Any], sample: Sample) -> Sample:
        return with_row_images(loc, dataclasses.replace(sample, source=loc), row, image_key, None)

    return _converted([(f"{where} row {i}", row) for i, row in enumerate(rows)], "verl", system_prompt, placed)


def dataset_class_samples(d: Any, files: str | list[str], limit: int | None, key: str) -> list[Sample]:
    """The samples the data section's dataset class (`d.dataset_class`, `data.verl_dataset`) makes of `files`
    (data.train_files or data.val_files, named by `key`), at most `limit` of them."""
    rows = dataset_class_rows(d.dataset_class, data_files(files), verl_data_config(d), -1 if limit is None else limit)
    return verl_samples(rows if limit is None else rows[:limit], f"{key} through {d.dataset_class}",
                        system_prompt=d.system_prompt, image_key=d.image_key)


def dataset_class_count(d: Any) -> int:
    """The training rows the data section's dataset class makes (verl counts its epochs in them)."""
    return len(dataset_class_rows(d.dataset_class, data_files(d.train_files), verl_data_config(d), -1))


def _converted(rows: list[_Row], fmt: str, system_prompt: str | None,
               placed: Callable[[str, dict[str, Any], Sample], Sample]) -> list[Sample]:
    convert: Callable[[str, dict[str, Any], str | None], Sample] = (
        _gsm8k_sample if fmt == "gsm8k" else _verl_sample
    )
    samples = []
    for loc, row in rows:
        missing = [c for c in _FORMATS[fmt] if c not in row]
        if missing:
            raise DataError(f"{loc}: row is missing {', '.join(missing)} (every {fmt} row needs "
                            f"{', '.join(_FORMATS[fmt])})")
        samples.append(placed(loc, row, convert(loc, row, system_prompt)))
    return samples


def load_blended(paths: str | list[str], probs: Sequence[float], seed: int, fmt: str = "auto", *,
                 limit: int | None = None, key: str = "data.train_files", **keys: Any) -> list[Sample]:
    """The rows of several files blended by `probs` (`blend_order`; data.train_files_probs). `limit` caps as
    OpenRLHF's --max_samples does around its blend: each file's first `limit` rows, then the blend's first `limit`.
    `keys`: load_samples' keyword arguments."""
    per_file = [load_samples(one, fmt, limit=limit, key=key, **keys) for one in data_files(paths)]
    return [row for _, row in blended_units(per_file, probs, seed, limit, key)]


def gsm8k_ground_truth(answer: str) -> str | None:
    """The final answer after the last `####` (commas removed), or None when there is none."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


def write_gsm8k_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write rows (dicts with at least question/answer) as JSON lines, atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    atomic_write(path, write)


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
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def check_data_file(path: str, key: str = "data.train_files") -> None:
    """That `path` exists with a readable extension, else a DataError naming `key` (the config key
    that gave it): cheap enough to run before a launch, ahead of any model load. A dataset folder, .csv/.arrow file or
    Hub name (`alignrl.data.sources`) is checked when it is loaded."""
    if is_library_dataset(path):
        return
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {path} (set {key} to an existing .jsonl, .json or .parquet file)")
    if p.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"unsupported data file extension {p.suffix!r} for {path} (use .jsonl, .json, .parquet or "
                        ".csv, a dataset folder or a Hub dataset name)")


def check_sources(path: str, known: Collection[str], key: str = "data.train_files") -> None:
    """A DataError naming the first row whose `data_source` is not in `known` (the sources with a
    built-in reward), read before any model loads: otherwise the run fails at its first reward."""
    if is_library_dataset(path):  # not loaded twice before the run: a bad source fails at its first reward
        return
    if Path(path).suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            column = pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist()
        except Exception:  # no such column (GSM8K layout) or an unreadable file: load_samples reports it
            return
        located = ((f"{path} row {i}", v) for i, v in enumerate(column))
    else:
        located = ((loc, row.get("data_source")) for loc, row in _iter_json(path) if "data_source" in row)
    for loc, source in located:
        if source is not None and str(source) not in known:  # None: a by-column row's default (layouts)
            raise DataError(f"{loc}: no reward for data_source {source!r} (known: {', '.join(sorted(known))}; "
                            f"fix the data_source in {key} or pass algorithm.reward_fn=path/to/file.py:function)")


def count_rows(path: str, key: str = "data.train_files") -> int:
    """Rows of a data file without reading them all (parquet: from its footer), or of a library dataset's split."""
    if is_library_dataset(path):
        return library_count(path, key)
    check_data_file(path, key)
    if Path(path).suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as exc:  # pyarrow raises several types for a corrupt footer
            raise DataError(f"could not read parquet file {path}: {str(exc).strip()[:120]} "
                            "(check the file is a valid parquet table)") from None
    array = json_array_rows(path) if Path(path).suffix.lower() == ".json" else None
    if array is not None:
        return len(array)
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def read_rows(path: str, key: str, limit: int | None = None) -> list[_Row]:
    """The rows of a .jsonl/.json/.parquet file as (location for messages, row), each a dict of its columns;
    DataError naming `key` (the setting that named the file) when it cannot be read."""
    return _read_rows(path, limit, key)[1]


def _read_rows(path: str, limit: int | None, key: str = "data.train_files") -> tuple[list[str], list[_Row]]:
    if is_library_dataset(path):
        return library_rows(path, key, limit)
    check_data_file(path, key)
    if Path(path).suffix.lower() == ".parquet":
        return _read_parquet(path, limit)
    rows = []
    for row in _iter_json(path):
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


def _iter_json(path: str) -> Iterator[_Row]:
    """Rows of a .jsonl file, or of a .json file (one array, or JSON lines as OpenRLHF's loader takes)."""
    array = json_array_rows(path) if Path(path).suffix.lower() == ".json" else None
    yield from _iter_jsonl(path) if array is None else array


def _iter_jsonl(path: str) -> Iterator[_Row]:
    # Bytes, decoded line by line: a text-mode file decodes whole buffers ahead of the line being read,
    # so its UnicodeDecodeError would point at an earlier line than the bad byte's.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            loc = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM, as some editors write
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
        raise DataError(f"{path}: cannot tell the data format from columns {sorted(columns)} "
                        f"({_NEEDS}; {_BY_COLUMN})")
    missing = [c for c in _FORMATS[fmt] if c not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} for format {fmt!r} "
                        f"(found {sorted(columns)}; {_NEEDS})")
    return fmt


def _gsm8k_sample(loc: str, row: dict[str, Any], system_prompt: str | None) -> Sample:
    answer = str(row["answer"])
    truth = gsm8k_ground_truth(answer)
    if truth is None:
        raise DataError(f"{loc}: GSM8K answer has no '#### <answer>' line "
                        "(end every answer with '#### <final answer>')")
    messages = with_system([{"role": "user", "content": str(row["question"])}], system_prompt)
    return Sample(messages=messages, ground_truth=truth, data_source="gsm8k", extra={"answer": answer})


def _verl_sample(loc: str, row: dict[str, Any], system_prompt: str | None) -> Sample:
    messages = chat_messages(loc, row["prompt"], "prompt")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{loc}: reward_model has no ground_truth "
                        "(set reward_model to {'style': 'rule', 'ground_truth': ...})")
    return Sample(
        messages=with_system(messages, system_prompt),
        ground_truth=plain_ground_truth(reward_model["ground_truth"]),
        data_source=str(row["data_source"]),
        extra=_extra_info(loc, row.get("extra_info")),
    )


def _extra_info(loc: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{loc}: extra_info is a {type(value).__name__}, not an object (a dict of the row's extra "
                        "fields, passed to the reward function)")
    return dict(value)
