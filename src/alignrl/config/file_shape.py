"""The shape of a config file before OmegaConf sees it: UTF-8 text, sections given as mappings, and
the multi-node launcher's `config/nodes.yaml` layout (top-level `training:` / `models:`) mapped onto our keys.

These checks exist because OmegaConf's own errors for such files name no line and no key.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class LayoutError(ValueError):
    """A config file or key of the wrong shape (`alignrl.config.load` reports it as a ConfigError)."""


def read_text(path: Path) -> str:
    """The file as UTF-8; a bad byte is reported with its line, which a decoder's byte offset is not."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise LayoutError(f"{path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8 text; re-save the file "
                          "as UTF-8") from None


def _section(cls: type, name: str) -> type | None:
    """The config section class of field `name` of `cls`, or None when it is a value (or unknown)."""
    for f in dataclasses.fields(cls):
        if f.name == name and isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            return f.default_factory
    return None


def check_sections(cls: type, raw: Any, where: str = "", prefix: str = "") -> None:
    """A value given where a section belongs (`actor: 5`, `actor=5`) is named by its key; OmegaConf's
    merge error for it names none. `where` prefixes the message (the file)."""
    if not isinstance(raw, dict):
        return
    for name, value in raw.items():
        section = _section(cls, name)
        if section is None:
            continue
        if not isinstance(value, dict):
            keys = [f.name for f in dataclasses.fields(section)]
            raise LayoutError(f"{where}'{prefix}{name}' is a config section, not a value (got {value!r:.40}); "
                              f"set its keys instead, e.g. {prefix}{name}.{keys[0]}=... "
                              "(`alignrl config --reference` lists them)")
        check_sections(section, value, where, f"{prefix}{name}.")


def read_config_file(p: Path, root: type) -> Any:
    """The file's contents in our layout, sections checked against `root`. Problems are LayoutErrors
    naming the file and line; OmegaConf's own errors pass through (the caller names their key)."""
    if not p.is_file():
        raise LayoutError(f"config file not found: {p} (pass --config with an existing YAML file)")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(io.StringIO(read_text(p))))
    except (OmegaConfBaseException, LayoutError):
        raise
    except Exception as e:  # YAML syntax errors: their first line has no position, the mark does
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise LayoutError(f"cannot parse {where}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
    if raw is not None and not isinstance(raw, dict):
        raise LayoutError(f"{p}: the file must map section names to keys (model:, data:, actor:, ...), "
                          f"not be a {type(raw).__name__}")
    raw = from_seed_layout(raw or {}, p)
    check_sections(root, raw, f"{p}: ")
    return raw


# the multi-node launcher's `config/nodes.yaml` layout -> our keys (the rest of such a file merges as usual).
SEED_KEYS = {"training.master_node": "trainer.master_addr", "training.master_port": "trainer.master_port",
             "training.hostfile": "trainer.hostfile",
             "training.services.generation.url": "services.generation_url",
             "training.services.reference.url": "services.reference_url",
             "training.services.reward.url": "services.reward_url",
             "models.train.path": "model.path", "models.output.path": "trainer.output_dir",
             "models.output.checkpoint_dir": "trainer.checkpoint_dir", "models.output.log_dir": "trainer.log_dir"}
# the model's folder when models.train.path is not given: models.base_path/models.train.name, as the seed's file
# spells the same path both ways
SEED_MODEL_PARTS = ("models.base_path", "models.train.name")


def unknown_seed_key(key: str) -> str:
    return f"unknown key '{key}' in the nodes.yaml layout; known: {', '.join(sorted([*SEED_KEYS, *SEED_MODEL_PARTS]))}"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def from_seed_layout(raw: Any, path: Path) -> Any:
    """A YAML with top-level `training:` / `models:` (the multi-node launcher's nodes.yaml) mapped onto our keys; the
    run folder is then `models.output.path` itself (checkpoints and logs inside it, as in the seed). As in
    the seed's project, `hostfile` and `deepspeed/zero3.json` beside the file are the launcher's hosts and
    the training engine (DeepSpeed ZeRO-3 from that JSON) unless the file names others."""
    if not isinstance(raw, dict) or not ({"training", "models"} & set(raw)):
        return raw
    raw = dict(raw)
    seed = {k: raw.pop(k) for k in ("training", "models") if k in raw}
    flat = _flatten(seed)
    base, name = (flat.pop(k, None) for k in SEED_MODEL_PARTS)
    if "models.train.path" not in flat and name is not None:  # else the demo model trained without a word
        flat["models.train.path"] = str(Path(str(base)) / str(name)) if base is not None else str(name)
    for key, value in flat.items():
        if key not in SEED_KEYS:
            raise LayoutError(f"{path}: {unknown_seed_key(key)}")
        section, name = SEED_KEYS[key].split(".")
        raw.setdefault(section, {})[name] = value
    if "models" in seed and "output" in seed["models"]:
        raw.setdefault("trainer", {}).setdefault("experiment_name", "")
    # the seed's project keeps its hostfile and DeepSpeed config beside nodes.yaml, which names neither
    trainer = raw.setdefault("trainer", {})
    if (path.parent / "hostfile").is_file():
        trainer.setdefault("hostfile", str(path.parent / "hostfile"))
    zero3 = path.parent / "deepspeed" / "zero3.json"
    if zero3.is_file() and "strategy" not in trainer and "deepspeed_config" not in trainer:
        trainer.update(strategy="deepspeed", deepspeed_config=str(zero3))
    return raw
