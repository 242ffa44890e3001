"""Checks of a Hugging Face model folder, and its tokenizer: every way a folder can be broken (no weights,
a corrupt config.json, a truncated safetensors file, no tokenizer or chat template) becomes one
`ModelError` naming the folder, the first line of the cause and what to do. transformers' own errors are
tracebacks several screens long, and some broken folders load without any error at all (a folder
without tokenizer files yields an empty tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alignrl.errors import UserError

SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
WEIGHT_FILES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
SCORE_INFO = "alignrl_score.json"  # what `alignrl train rm` says its folder's score means (models that score, not write)
RESAVE = "re-save it with save_pretrained or copy the file again from where the model came from"


class ModelError(UserError):
    """The model path cannot be loaded; the message says what to pass instead."""


def read_config(folder: str | Path) -> dict | None:
    """A local model folder's config.json as a dict; None when there is none to read (a hub name, or a file that is
    not JSON: the model load says what is wrong with those)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def folder_error(folder: str | Path, cause: str, fix: str) -> ModelError:
    return ModelError(f"model folder {folder}: {cause}; {fix}")


@contextmanager
def loading(folder: str | Path, what: str) -> Iterator[None]:
    """Whatever a load of `what` from `folder` raises (transformers, safetensors, torch) becomes one
    ModelError: these are errors in the folder, and the prechecks cannot foresee every one."""
    try:
        yield
    except ModelError:
        raise
    except Exception as exc:
        raise folder_error(folder, f"the {what} cannot be loaded ({first_line(exc)})",
                           "check that the folder is complete, or " + RESAVE) from exc


def weight_files(folder: Path) -> list[Path]:
    """The weight files the folder's layout names (the shards of an index too); ModelError when none."""
    present = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise folder_error(folder, f"no weights file (looked for {', '.join(WEIGHT_FILES)})",
                           "copy the weights into it, or point the path at the complete model folder")
    name = present[0]
    if not name.endswith(".index.json"):
        return [folder / name]
    try:
        shards = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise folder_error(folder, f"{name} is not a valid shard index ({first_line(exc)})", RESAVE) from exc
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise folder_error(folder, f"{name} lists {len(missing)} shard(s) that are missing, e.g. {missing[0]}",
                           "copy the missing shards in, or " + RESAVE)
    return [folder / s for s in shards]


def check_model_folder(folder: Path) -> None:
    """What every loader needs: a readable config.json and complete weight files. Safetensors headers
    are opened (not the tensors), which is what catches a truncated download."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise folder_error(folder, f"config.json is not valid JSON ({first_line(exc)})", RESAVE) from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise folder_error(folder, "config.json has no model_type", RESAVE)
    from safetensors import safe_open

    for path in weight_files(folder):
        if path.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as exc:  # SafetensorError, OSError: the header or the data is cut short or garbled
            raise folder_error(folder, f"{path.name} is truncated or corrupt ({first_line(exc)})", RESAVE) from exc


def load_tokenizer(folder: Path, chat: bool = True):
    """The folder's tokenizer, with a pad token and, when `chat` (training templates every prompt), a chat
    template."""
    from transformers import AutoTokenizer

    # without these files transformers builds an empty tokenizer instead of failing
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise folder_error(folder, f"no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})",
                           "copy the tokenizer from the base model in (tokenizer.save_pretrained(folder))")
    with loading(folder, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if chat and not tokenizer.chat_template:
        raise folder_error(folder, "the tokenizer has no chat template",
                           "copy chat_template.jinja (or tokenizer_config.json's chat_template) from the instruct "
                           "model the folder derives from, or set tokenizer.chat_template and save it")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def weights_fingerprint(folder: Path) -> str | None:
    """A digest of the folder's weights that tells two models of the same shapes apart: each tensor's name, shape,
    dtype and first row (first 64 elements of a vector), read from the safetensors files without loading the
    model. Two processes that load the same weights agree on it whatever dtype they load them in. None for
    weights in another format (.bin), which would have to be loaded whole."""
    import hashlib

    import torch
    from safetensors import safe_open

    files = weight_files(folder)
    if not all(f.suffix == ".safetensors" for f in files):
        return None
    digest = hashlib.sha256()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                shape = part.get_shape()
                head = part[0:1] if len(shape) > 1 else part[0:min(64, shape[0])] if shape else f.get_tensor(name)
                digest.update(f"{name}{shape}{part.get_dtype()}".encode())
                digest.update(head.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def auto_class(config):
    """The transformers Auto class that builds a model of `config` (a transformers config) as alignrl loads it: the
    image-text-to-text model for a config with a vision part (its image encoder included), else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
