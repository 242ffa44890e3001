"""Datasets that are not one of alignrl's own data files, read through the `datasets` library the way OpenRLHF's and
TRL's loaders read them: a Hub dataset name (`owner/name`, with a `#config` suffix and OpenRLHF's `@data_dir`), a
folder written by `Dataset.save_to_disk`, a folder laid out as a Hub dataset repository (`data/train-*.parquet`, ...),
or a `.csv` / `.arrow` file. alignrl's own files (`.jsonl`, `.json`, `.parquet`) keep their readers in
`alignrl.data.loaders`, whose messages name the line of a bad row.

A dataset with several splits gives `train` to training settings and `test` to held-out ones (the defaults of
OpenRLHF's offline scripts' `--dataset_split` / `--eval_split`); a held-out setting takes `validation` when there is
no `test`, and `train` when there is neither, said once. A dataset with a single split gives that one to both.
Another split is named after the dataset in brackets, `owner/name[dev]`, which is what OpenRLHF's and TRL's split
flags become."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from alignrl.errors import DataError

OWN_SUFFIXES = (".jsonl", ".json", ".parquet")
LIBRARY_SUFFIXES = (".csv", ".arrow")
# `owner/name` or `name`: what a Hub dataset id looks like
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_SPLIT = re.compile(r"^(.*)\[([\w.-]+)\]$")
# a name ending so is a file that is not there, not a Hub id (ids may hold dots: `owner/set-v1.5`)
_FILE_SUFFIXES = OWN_SUFFIXES + LIBRARY_SUFFIXES + (".txt", ".tsv", ".gz", ".zip", ".yaml", ".yml", ".py")
_SAID: set[str] = set()
_HELD_OUT_SPLITS = ("test", "validation", "valid", "val")
_FIX = ("give a .jsonl/.json/.parquet file, or a dataset folder or Hub dataset name the `datasets` library can load; "
        "on a machine without network, download it first and give its folder")


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset as named on the command line, `name#config@data_dir[split]`: its path or Hub id, its configuration
    (`load_dataset`'s name), OpenRLHF's `@data_dir`, and the split to read when it is not the setting's default."""

    name: str
    config: str | None = None
    data_dir: str | None = None
    split: str | None = None

    def text(self) -> str:
        """The spec as written: `name#config@data_dir[split]`."""
        return (self.name + (f"#{self.config}" if self.config else "") + (f"@{self.data_dir}" if self.data_dir else "")
                + (f"[{self.split}]" if self.split else ""))

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        if Path(text).exists():  # a local path is taken whole, whatever characters it holds
            return cls(text)
        bracket = _SPLIT.match(text)
        rest, split = (bracket.group(1), bracket.group(2)) if bracket else (text, None)
        name, _, data_dir = rest.partition("@")
        name, _, config = name.partition("#")
        return cls(name.strip(), config.strip() or None, data_dir.strip() or None, split)


def is_own_file(path: str) -> bool:
    """A path alignrl reads itself (by its suffix), whether or not it exists: a missing one is reported as a file."""
    return Path(path).suffix.lower() in OWN_SUFFIXES


def is_library_dataset(path: str) -> bool:
    """A dataset the `datasets` library reads: a .csv/.arrow file or a folder on disk, or what looks like a Hub id."""
    if is_own_file(path):
        return False
    name = DatasetSpec.parse(path).name
    local = Path(name)
    if name in ("", "."):  # no name, or the working folder: not a dataset anyone means
        return False
    if local.exists():
        return local.is_dir() or local.suffix.lower() in LIBRARY_SUFFIXES
    return bool(_HUB_NAME.match(name)) and not name.startswith(".") and local.suffix.lower() not in _FILE_SUFFIXES


def held_out(key: str) -> bool:
    """Whether the setting `key` names held-out rows (data.val_files, --eval_dataset, ...), which take `test`."""
    return any(word in key.lower() for word in ("val", "eval", "test"))


def library_rows(path: str, key: str, limit: int | None = None) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """(columns, [(location, row)]) of a library dataset's split for the setting `key`; DataError naming `key` when it
    cannot be loaded. Image columns come as {"bytes", "path"} items (verl's layout), not decoded pictures."""
    data, split = _split(_load(path, key), path, key)
    if limit is not None:  # before the image cast, which rewrites every row it keeps
        data = data.select(range(min(limit, len(data))))
    data = _undecoded_images(data)
    where = f"{path} [{split}]" if split else path
    return list(data.column_names), [(f"{where} row {i}", dict(row)) for i, row in enumerate(data)]


def library_count(path: str, key: str) -> int:
    """The rows of a library dataset's split for `key` (loading it once: the library caches it for the later read)."""
    return len(_split(_load(path, key), path, key)[0])


def _load(path: str, key: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{key}={path}: reading a dataset folder, .csv/.arrow file or Hub name needs the `datasets` "
                        "package (pip install datasets), or give a .jsonl/.json/.parquet file") from None
    spec = DatasetSpec.parse(path)
    local = Path(spec.name)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # the library's retry chatter: the outcome is said in one line below
    try:
        if local.is_dir() and _saved_to_disk(local):
            return datasets.load_from_disk(str(local))
        if local.is_file():
            kind = local.suffix.lower().lstrip(".")
            return datasets.load_dataset(kind, data_files=str(local))
        return datasets.load_dataset(spec.name, spec.config, data_dir=spec.data_dir)
    except Exception as exc:  # the library raises many types (connection, not found, bad files, bad config)
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        if not local.exists():  # a mistyped local folder is looked up on the Hub: say both
            reason = f"no local file or folder {spec.name} (from {Path.cwd()}), and from the Hub: {reason}"
        raise DataError(f"{key}: could not load dataset {path!r}: {reason[:300]} ({_FIX})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _saved_to_disk(folder: Path) -> bool:
    """A folder `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json) wrote."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _split(data, path: str, key: str):
    """(the split of `data` the setting `key` reads, its name; None for a dataset without splits)."""
    if not hasattr(data, "keys"):  # one Dataset (save_to_disk of a split)
        return data, None
    spec, names = DatasetSpec.parse(path), list(data.keys())
    if len(names) == 1 and spec.split in (None, names[0]):
        return data[names[0]], names[0]
    wanted = (spec.split,) if spec.split else _HELD_OUT_SPLITS if held_out(key) else ("train",)
    split = next((name for name in wanted if name in names), None)
    if split is None and not spec.split and held_out(key) and "train" in names:
        _say_once(f"note: {key}: dataset {path!r} has no test or validation split; its train split is held out")
        split = "train"
    if split is None:
        raise DataError(f"{key}: dataset {path!r} has splits {', '.join(names)} and none named "
                        f"{' or '.join(wanted)} (name the one to read after the dataset: {spec.name}[split])")
    return data[split], split


def _undecoded_images(data):
    """`data` with image columns (an Image feature, or a list of them) read as {"bytes", "path"} items."""
    import datasets

    for column, feature in data.features.items():
        inner = getattr(feature, "feature", None)  # List(Image()) / Sequence(Image())
        if isinstance(feature, datasets.Image) and feature.decode:
            data = data.cast_column(column, datasets.Image(decode=False))
        elif isinstance(inner, datasets.Image) and inner.decode:
            data = data.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return data


def without_split(path: str) -> str:
    """`path` without a split named in brackets: the split its setting reads unasked."""
    bracket = None if Path(path).exists() or not is_library_dataset(path) else _SPLIT.match(path)
    return bracket.group(1) if bracket else path


def _say_once(line: str) -> None:
    """A note on stderr, once per process (a dataset is read by several loaders: counts, rows, held-out)."""
    if line not in _SAID:
        _SAID.add(line)
        print(f"alignrl: {line}", file=sys.stderr, flush=True)


def with_config(path: str, config: str) -> str:
    """`path` reading its dataset configuration `config` (`name#config`, TRL's --dataset_config); a file as it is."""
    return replace(DatasetSpec.parse(path), config=config).text() if is_library_dataset(path) else path


def with_split(path: str, split: str) -> str:
    """`path` reading its split `split`: a library dataset named with it in brackets (in place of one named before);
    one of alignrl's own files as it is, since a file is read whole."""
    if not is_library_dataset(path):
        return path
    bracket = None if Path(path).exists() else _SPLIT.match(path)
    return f"{bracket.group(1) if bracket else path}[{split}]"
