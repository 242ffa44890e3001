"""Loading a run config: YAML file (optional) + verl-style `a.b.c=value` overrides merged by OmegaConf onto
the defaults, then validated; and the config written back out (YAML, the README reference table).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from alignrl.config.checks import check_combinations, check_ranges, did_you_mean
from alignrl.config.file_shape import LayoutError, check_sections, read_config_file
from alignrl.config.schema import ConfigError, RunConfig
from alignrl.config.counts import resolve_counts
from alignrl.config.verl_keys import list_not_used, translate, verl_defaults


def _one_line(e: OmegaConfBaseException, fallback_key: str = "?") -> str:
    key = getattr(e, "full_key", None) or fallback_key
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        node = RunConfig()
        for part in filter(None, parent.split(".")):
            node = getattr(node, part, None)
        names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        where = f"under '{parent}'" if parent else "at the top level"
        return f"unknown config key '{key}'{did_you_mean(key, names)}; allowed {where}: {', '.join(names) or '?'}"
    return f"bad value for '{key}': {msg}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides merged onto the defaults, then validated. Overrides may
    use verl/Search-R1 spellings (`alignrl.config.verl_keys`)."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} must look like key.sub=value (e.g. actor.lr=1e-5)")
    verl = translate(overrides)
    try:
        merged = OmegaConf.structured(RunConfig)
        given = set(verl.explicit)
        if path is not None:
            from_file = read_config_file(Path(path), RunConfig)
            given |= _file_keys(from_file)
            merged = OmegaConf.unsafe_merge(merged, from_file)
        for o in verl.overrides:  # one at a time, so an error without OmegaConf's key still names the override's
            merged = _merge_one(merged, o)
        for o in verl_defaults(verl, given, merged.algorithm.adv_estimator, bool(merged.actor.use_kl_loss)):
            merged = _merge_one(merged, o)
        if verl.output_is_run_dir and "trainer.experiment_name" not in given:  # as in a nodes.yaml file
            merged = _merge_one(merged, "trainer.experiment_name=''")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    check_ranges(cfg)
    cfg = resolve_counts(cfg, given, verl.global_micro)
    check_combinations(cfg)
    list_not_used(verl)
    return cfg


def keys_given(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The alignrl keys the config file or the overrides set (verl and seed spellings translated), as opposed
    to those left at their defaults. Call after `load_config` accepted the same arguments."""
    given = set(translate(overrides).explicit)
    return given | _file_keys(read_config_file(Path(path), RunConfig)) if path is not None else given


def _file_keys(from_file: Any) -> set[str]:
    return _dotted_keys(from_file if isinstance(from_file, dict) else OmegaConf.to_container(from_file))


def dotted_item(schema: type, override: str) -> Any:
    """One `key=value` override as a config tree; one value given to a key whose schema type is `list` is a list
    of one (`trainer.logger=wandb` means [wandb], as in verl)."""
    key, _, value = override.partition("=")
    field_ = _field(schema, key)
    try:
        item = OmegaConf.from_dotlist([override])
    except Exception as e:  # the value is parsed as YAML: yaml's own errors, each a traceback otherwise
        if _is_text(field_):
            return _raw_text(key, value)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"cannot read the value of {key}={value!r} ({first}): quote it, or close its brackets "
                          "(lists look like [a,b])") from None
    if _is_text(field_):  # `User: {}` reads as a YAML mapping, `[x]` as a list: a text key wants the text
        picked = OmegaConf.select(item, key, default=None, throw_on_resolution_failure=False)
        # `key=` on a text key is the empty text (e.g. no service: services.generation_url=), not YAML's null
        # YAML 1.1 reads `no`/`off`/`yes`/`on` as booleans: a text key wants the word (save_strategy=no)
        if (OmegaConf.is_dict(picked) or OmegaConf.is_list(picked) or isinstance(picked, bool)
                or (value == "" and field_.type in (str, "str"))):
            return _raw_text(key, value)
        if picked is None and value.strip() not in ("", "null", "Null", "NULL", "~"):  # `#...` reads as a comment
            return _raw_text(key, value)
    if field_ is not None and field_.type in (list, "list"):
        value = OmegaConf.select(item, key, default=None, throw_on_resolution_failure=False)  # `${...}`: later
        if value is not None and not OmegaConf.is_list(value):
            OmegaConf.update(item, key, [value], merge=False)
    return item


def _is_text(field_: dataclasses.Field | None) -> bool:
    return field_ is not None and field_.type in (str, "str", "str | None")


def _raw_text(key: str, value: str) -> Any:
    """`key` set to `value` as it was typed (the shell has already taken its quotes off), YAML aside."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    tree: dict = {}
    node = tree
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return OmegaConf.create(tree)


def _field(schema: type, key: str) -> dataclasses.Field | None:
    node: Any = schema
    for part in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            return None
        found = fields[part]
        node = found.default_factory if found.default_factory is not dataclasses.MISSING else None
    return found


def _merge_one(merged: Any, override: str) -> Any:
    """`override` merged into `merged` in place (unsafe_merge): OmegaConf.merge copies the whole tree for each
    override, which was most of a config's load (~10 ms each); `merged` is this load's own tree, and a failed merge
    ends the load, so a half-merged one is never used."""
    item = dotted_item(RunConfig, override)
    check_sections(RunConfig, OmegaConf.to_container(item))
    try:
        return OmegaConf.unsafe_merge(merged, item)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e, override.split("=", 1)[0])) from None
    except TypeError as e:  # a list given for a mapping (or the reverse): OmegaConf's own TypeError, no key in it
        raise ConfigError(f"bad value for '{override.split('=', 1)[0]}': {e} (a list where the key takes a mapping, "
                          "or the reverse; `alignrl config --reference` lists each key's type)") from None


def _dotted_keys(tree: Any, prefix: str = "") -> set[str]:
    if not isinstance(tree, dict):
        return {prefix.rstrip(".")}
    return set().union(*(_dotted_keys(v, f"{prefix}{k}.") for k, v in tree.items())) if tree else set()


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def reference_markdown() -> str:
    """The config reference table for the README, generated from the field metadata."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                walk(f.default_factory, prefix + f.name + ".")  # type: ignore[arg-type]
                continue
            m = f.metadata
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            allowed = " / ".join(map(str, m["choices"])) if m.get("choices") else " ".join(
                f"{w} {m[b]}" for b, w in (("ge", "≥"), ("gt", ">"), ("le", "≤")) if m.get(b) is not None)
            rows.append(f"| `{prefix}{f.name}` | `{default}` | {allowed} | {m['help']} |")

    walk(RunConfig, "")
    return "\n".join(rows)
