"""verl's custom dataset classes (data.custom_cls, alignrl's data.dataset_class = "path/to/file.py:Class"): the class
reads the data files and makes the rows, alignrl templates and trains on them.

A verl dataset class subclasses verl's `RLHFDataset` and is made as verl makes it, `cls(data_files=..., tokenizer=...,
config=<the data section, verl's key names>, processor=None, max_samples=...)`; its constructor reads the files
(`_download`, then `_read_files_and_tokenize`, which leaves the rows in `self.dataframe`). Recipes override those two
and the map functions they call (verl's ReTool recipe maps AIME's Problem/Answer columns to verl's layout there).
alignrl reads the rows of `self.dataframe` (a `datasets.Dataset`, a pandas DataFrame or a list of dicts) in verl's
layout: prompt (chat messages), data_source, reward_model.ground_truth, extra_info. Where verl is not installed, the
class's `from verl.utils.dataset import RLHFDataset` gets `RLHFDataset` below, which reads parquet and JSON files.

A class that overrides `__getitem__` builds its model inputs itself (images processed, prompts tokenized); alignrl
templates the rows itself, so such a class is refused in one line: write its rows to a parquet file in verl's layout
instead.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
from pathlib import Path
from typing import Any

from alignrl.data.row_formats import DataError
from alignrl.utils.user_files import import_user_file, provide_modules

KEY = "data.dataset_class"


class RLHFDataset:
    """verl's RLHFDataset as far as a subclass reads it: its constructor, attributes and file reading."""

    def __init__(self, data_files: str | list[str], tokenizer: Any, config: Any, processor: Any = None,
                 max_samples: int = -1):
        self.data_files = [data_files] if isinstance(data_files, str) else list(data_files)
        self.original_data_files = list(self.data_files)
        self.tokenizer, self.processor, self.config, self.max_samples = tokenizer, processor, config, max_samples
        self.cache_dir = os.path.expanduser(config.get("cache_dir", "~/.cache/verl/rlhf"))
        self.prompt_key = config.get("prompt_key", "prompt")
        self.image_key = config.get("image_key", "images")
        self.video_key = config.get("video_key", "videos")
        self.max_prompt_length = config.get("max_prompt_length", 1024)
        self.return_raw_chat = config.get("return_raw_chat", False)
        self.truncation = config.get("truncation", "error")
        self.filter_overlong_prompts = config.get("filter_overlong_prompts", True)
        self.num_workers = 1
        self.serialize_dataset = False
        self._download()
        self._read_files_and_tokenize()

    def _download(self, use_origin_parquet: bool = False) -> None:
        """verl copies remote files to a local cache here; alignrl reads local files only."""

    def _read_files_and_tokenize(self) -> None:
        """The files' rows: a `datasets.Dataset` as verl's, where the datasets package is installed (a subclass may
        map it further), else a list of dicts."""
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None:
            parts = [datasets.load_dataset("parquet" if str(path).endswith(".parquet") else "json",
                                           data_files=str(path))["train"] for path in self.data_files]
            self.dataframe = datasets.concatenate_datasets(parts)
        else:
            self.dataframe = [row for path in self.data_files for row in _file_rows(str(path))]
        if self.max_samples is not None and 0 < self.max_samples < len(self.dataframe):
            keep = range(self.max_samples)
            self.dataframe = self.dataframe[:self.max_samples] if datasets is None else self.dataframe.select(keep)
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

    def maybe_filter_out_long_prompts(self, dataframe):
        """Kept whole: alignrl drops overlong prompts itself (data.filter_overlong_prompts), tools' schemas counted."""
        return dataframe

    def __len__(self) -> int:
        return len(self.dataframe)

    def __getitem__(self, item: int) -> dict:
        return dict(self.dataframe[item])


def _file_rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def dataset_base() -> type:
    """The RLHFDataset classes subclass: an installed verl's, else the one above, provided under verl's names."""
    try:
        from verl.utils.dataset import RLHFDataset as installed  # type: ignore[import-not-found]

        return installed
    except ImportError:
        provide_modules({"verl.utils.dataset": {"RLHFDataset": RLHFDataset},
                         "verl.utils.dataset.rl_dataset": {"RLHFDataset": RLHFDataset}},
                        "verl's dataset class, as alignrl provides it (verl is not installed)")
        return RLHFDataset


def load_dataset_class(spec: str) -> type:
    """The class of "path/to/file.py:Class"; one DataError line for what is wrong with it."""
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str or not name:
        raise DataError(f"{KEY}={spec!r} is not of the form path/to/file.py:ClassName (verl's data.custom_cls.path "
                        "and .name)")
    path = Path(path_str)
    if not path.is_file():
        raise DataError(f"{KEY} file not found: {path_str} (from {Path.cwd()}; give an existing .py file)")
    base = dataset_base()
    cls = getattr(import_user_file(path, KEY, DataError, "alignrl_dataset_"), name, None)
    if not isinstance(cls, type):
        raise DataError(f"{KEY} file {path_str} has no class {name!r} (define it or fix the name after the colon)")
    if not issubclass(cls, base):
        raise DataError(f"{KEY} {spec}: {name} does not subclass verl's RLHFDataset (from verl.utils.dataset import "
                        "RLHFDataset)")
    if cls.__getitem__ is not base.__getitem__:
        raise DataError(f"{KEY} {spec}: {name} overrides __getitem__ (it builds model inputs itself), which alignrl "
                        "does not call; make the rows in _read_files_and_tokenize, or write them to a parquet file in "
                        "verl's layout (prompt, data_source, reward_model, extra_info)")
    return cls


def _frame_rows(frame: Any, where: str) -> list[dict]:
    if hasattr(frame, "to_dict") and hasattr(frame, "columns"):  # pandas
        return frame.to_dict("records")
    if hasattr(frame, "to_list"):  # datasets.Dataset
        return frame.to_list()
    if isinstance(frame, list) and all(isinstance(r, dict) for r in frame):
        return frame
    raise DataError(f"{where}: self.dataframe is a {type(frame).__name__}; alignrl reads a datasets.Dataset, a "
                    "pandas DataFrame or a list of dicts")


@functools.lru_cache(maxsize=8)
def _made_rows(spec: str, files: tuple[str, ...], key_json: str, max_samples: int) -> tuple[dict, ...]:
    from omegaconf import OmegaConf

    cls = load_dataset_class(spec)
    config = OmegaConf.create(json.loads(key_json)[1])
    kwargs = dict(data_files=list(files), tokenizer=None, config=config, processor=None)
    params = inspect.signature(cls.__init__).parameters
    if "max_samples" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["max_samples"] = max_samples  # verl 0.7's; older dataset classes do not take it
    where = f"{KEY} {spec}"
    try:
        made = cls(**kwargs)
    except DataError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(f"{where} failed on {', '.join(files)}: {type(exc).__name__}: {text}") from exc
    rows = _frame_rows(getattr(made, "dataframe", None), where)
    if not rows:
        raise DataError(f"{where} made no rows from {', '.join(files)}")
    return tuple(rows)


def dataset_class_rows(spec: str, files: list[str], data_config: dict, max_samples: int = -1) -> list[dict]:
    """The rows `spec`'s class makes from `files`, given verl's data config (`data_config`, verl's key names). Made
    once per process for the same arguments: the epoch count, the run and its checks read the same rows."""
    # keyed by the absolute paths: the same relative names from another working folder are other files
    where = (os.path.abspath(spec.rpartition(":")[0]), tuple(os.path.abspath(f) for f in files))
    made = _made_rows(spec, tuple(files), json.dumps([where, data_config], sort_keys=True, default=str), max_samples)
    return copy.deepcopy(list(made))  # the cached rows stay as the class made them


def verl_data_config(d: Any) -> dict:
    """alignrl's data section (`d`, a DataConfig) under verl's key names, as a dataset class reads its config."""
    path, _, name = d.dataset_class.rpartition(":")
    return {"train_files": d.train_files, "val_files": d.val_files, "prompt_key": d.prompt_key or "prompt",
            "image_key": d.image_key, "video_key": "videos", "max_prompt_length": d.max_prompt_length,
            # alignrl drops overlong prompts itself (tools' schemas counted); an installed verl's class would need the
            # tokenizer, which the rows are made without
            "truncation": d.truncation, "filter_overlong_prompts": False, "return_raw_chat": True,
            "train_batch_size": d.train_batch_size, "shuffle": d.shuffle,
            "apply_chat_template_kwargs": dict(d.chat_template_kwargs), "custom_cls": {"path": path, "name": name}}

