"""The split and configuration flags of OpenRLHF's and TRL's offline scripts (`--train_split`, `--eval_split`,
`--dataset_train_split`, `--dataset_test_split`, `--dataset_config`): which split of a dataset folder or Hub dataset
the training and held-out dataset flags read. Files are read whole. Nothing here imports torch.
"""

from __future__ import annotations

import json
from typing import Any

from alignrl.config import ConfigError
from alignrl.data.sources import with_config, with_split
from alignrl.preference.notes import say

LIST_KEYS = ("train_files", "eval_files", "train_files_probs")  # keys that take OpenRLHF's comma-separated lists
# OpenRLHF's and TRL's split flags: the split of a dataset folder or Hub dataset (alignrl.data.sources) that the
# training or the held-out dataset flag reads; the split each reads unasked (train; test, else validation) needs none
SPLIT_FLAGS = {"dataset_split": "train", "train_split": "train", "dataset_train_split": "train",
               "eval_split": "eval", "dataset_test_split": "eval", "dataset_config": "config"}  # TRL's `name#config`
UNASKED_SPLITS = {"train": "train", "eval": "test"}


def split_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the line without its split flags, {"train" or "eval": the split asked for}), leaving out a split the
    setting reads unasked."""
    rest, splits, i = [], {}, 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        if name not in SPLIT_FLAGS:
            rest.append(word)
            i += 1
            continue
        if not eq and (nxt is None or nxt.startswith("--")):
            raise ConfigError(f"--{name} needs a value (--{name} {name.split('_')[-1].upper()})")
        value, i = (value, i + 1) if eq else (nxt, i + 2)
        splits[SPLIT_FLAGS[name]] = value.strip()
    return rest, {kind: split for kind, split in splits.items() if split != UNASKED_SPLITS.get(kind)}


def with_splits(overrides: list[str], own_names: Any, splits: dict[str, str]) -> list[str]:
    """The dataset overrides reading the splits the line asked for (`own_names`: the command's
    `flag_names.CommandFlags`); a held-out split without a held-out dataset
    reads that split of the training datasets (TRL's --dataset_test_split of --dataset_name)."""
    keys = {"train": own_names.names.get("dataset"), "eval": own_names.names.get("eval_dataset")}
    config = splits.get("config")  # TRL's --dataset_config: of --dataset_name, and of its held-out split
    out, given = [], {}
    for word in overrides:
        key, _, value = word.partition("=")
        kind = next((k for k, v in keys.items() if v == key), None)
        if kind:
            given[kind] = value
        if kind and (kind in splits or (config and kind == "train")):
            own_config = config if kind == "train" else None
            word = f"{key}={_dataset_value(value, key in LIST_KEYS, splits.get(kind), own_config)}"
        out.append(word)
    if "eval" in splits and "eval" not in given and "train" in given and keys["eval"]:
        held = _dataset_value(given["train"], keys["eval"] in LIST_KEYS, splits["eval"], config)
        out.append(f"{keys['eval']}={held}")
    lost = [kind for kind in splits if kind not in given and not (kind in ("eval", "config") and "train" in given)]
    if lost:
        which = {"train": "a training split flag", "eval": "a held-out split flag", "config": "--dataset_config"}
        raise ConfigError(f"{which[lost[0]]} picks from the dataset named by --dataset/--dataset_name"
                          f"{' or --eval_dataset' if lost[0] == 'eval' else ''} on the same line; name the dataset "
                          "that way, or its split in brackets after it (train_files=[owner/name[split]])")
    return out


def _dataset_value(value: str, listed: bool, split: str | None, config: str | None) -> str:
    """A dataset value (one path, or a list key's list: JSON, or `[a,b]` as given) reading the split `split` and the
    configuration `config` of each dataset folder or Hub dataset (files are read whole)."""
    if not listed:
        items = [value]
    else:
        items = json.loads(value) if value.startswith("[\"") else [v.strip() for v in value[1:-1].split(",")]
    items = [str(v) for v in items if str(v)]
    read = [with_config(v, config) if config else v for v in items]
    read = [with_split(v, split) if split else v for v in read]
    if read == items and (split or config):
        say(f"note: the {'split ' + repr(split) if split else 'configuration ' + repr(config)} changes nothing for "
            ".jsonl/.json/.parquet files, which are read whole")
    return json.dumps(read) if listed else read[0]
