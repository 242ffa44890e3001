"""verl's choice of training engine for the actor and the critic, as alignrl's one engine for both
(`trainer.strategy`, `trainer.zero_stage`, `trainer.offload`): Hydra's selection of verl's own config groups
(`actor@actor_rollout_ref.actor=ds_actor`, `critic=ds_critic`), the `strategy` keys, and the settings of verl's
DeepSpeed engine (`actor_rollout_ref.actor.deepspeed.*`, `critic.deepspeed_config.*`). `engine` reads such a key
while `verl_keys.translate` reads the overrides; `finish` turns what it gathered into alignrl's keys once every
override is known. The actor's engine is the run's; a critic setting that differs is listed as not applied."""

from __future__ import annotations

from alignrl.config.schema import ConfigError
from alignrl.config.verl_pass import TranslationPass
from alignrl.config.verl_recent import parsed
from alignrl.config.verl_tables import A, STRATEGIES

FSDP = {"strategy": "fsdp"}
# verl's engine/deepspeed.yaml, which ds_actor and ds_critic select: ZeRO-2, nothing offloaded
DEEPSPEED = {"strategy": "deepspeed", "zero_stage": 2, "offload": False}

# The groups of main_ppo's ppo_trainer.yaml alignrl follows, by the package they fill: (the group's name, its options
# -> the engine each picks; None: verl's only or default option, which says nothing alignrl has a setting for).
# verl has no DeepSpeed reference or rollout group: its DeepSpeed worker hosts both beside the actor.
GROUPS: dict[str, tuple[str, dict[str, dict | None]]] = {
    "actor_rollout_ref.actor": ("actor", {"dp_actor": FSDP, "ds_actor": DEEPSPEED}),
    "critic": ("critic", {"dp_critic": FSDP, "ds_critic": DEEPSPEED}),
    "actor_rollout_ref.ref": ("ref", {"dp_ref": None}),
    "actor_rollout_ref.rollout": ("rollout", {"rollout": None}),
    "actor_rollout_ref.model": ("model", {"hf_model": None}),
    "critic.model": ("model", {"hf_model": None}),
    "data": ("data", {"legacy_data": None}),
}
# a group given without `@package` fills the package of its own name (Hydra's rule): these two are verl's
_BARE = ("critic", "data")
ROLES = {A: "actor", "critic.": "critic"}
# verl's DeepSpeed worker reads its engine's settings under either name (deepspeed_config first)
_DS_SECTIONS = ("deepspeed.", "deepspeed_config.")
_DS_FIELDS = ("zero_stage", "offload", "optimizer_offload")
OFFLOAD_TARGETS = ("none", "cpu", "nvme", "auto")


def supported() -> str:
    return ", ".join(f"{g if p == g else g + '@' + p}={'|'.join(opts)}" for p, (g, opts) in GROUPS.items())


def engine(st: TranslationPass, key: str, value: str) -> bool:
    """A group selection or a strategy / DeepSpeed key of the actor or the critic, gathered into `st`; False: not
    one of them."""
    if "@" in key or key in _BARE:
        _group(st, key, value)
        return True
    if key in ("actor", "ref", "rollout") and any(g == key and value in opts for g, opts in GROUPS.values()):
        package = next(p for p, (g, opts) in GROUPS.items() if g == key and value in opts)
        raise ConfigError(f"{key}={value}: verl's {key} group fills {package}; write {key}@{package}={value}")
    found = _field(key)
    if found is None:
        return False
    st.verl = True
    role, name = found
    st.engine.setdefault(role, {})[name] = (f"{key}={value}", _read(key, name, value, st))
    return True


def _group(st: TranslationPass, key: str, value: str) -> None:
    group, _, package = key.partition("@")
    package = package or group
    option = str(parsed(value))
    if package not in GROUPS or GROUPS[package][0] != group:
        raise ConfigError(f"{key}={value} selects a Hydra config group alignrl does not read; verl's groups it "
                          f"follows: {supported()} (other settings go on the command line as keys)")
    options = GROUPS[package][1]
    if option not in options:
        if "megatron" in option:
            raise ConfigError(f"{key}={value} selects verl's Megatron engine, which is not supported ({STRATEGIES})")
        engines = f" ({STRATEGIES})" if group in ("actor", "critic") else ""
        raise ConfigError(f"{key}={value} is not one of verl's {group} options alignrl follows: "
                          f"{'|'.join(options)}{engines}")
    st.verl = True
    role = {"actor_rollout_ref.actor": "actor", "critic": "critic"}.get(package)
    if role is not None:
        st.engine.setdefault(role, {})["group"] = (f"{key}={value}", options[option])


def _field(key: str) -> tuple[str, str] | None:
    """(role, setting) of a strategy or DeepSpeed key of the actor or the critic; None for any other key."""
    for prefix, role in ROLES.items():
        if key == prefix + "strategy":
            return role, "strategy"
        for section in _DS_SECTIONS:
            name = key.removeprefix(prefix + section)
            if key.startswith(prefix + section) and name in _DS_FIELDS:
                return role, name
    return None


def _read(key: str, name: str, text: str, st: TranslationPass) -> object:
    """The setting's value as alignrl's keys take it; a value verl does not take is one line."""
    v = parsed(text)
    if name == "strategy":
        if str(v) not in ("fsdp", "fsdp2", "deepspeed"):
            raise ConfigError(f"{key}={text} is not supported ({STRATEGIES})")
        return "deepspeed" if v == "deepspeed" else "fsdp"
    if name == "zero_stage":
        if isinstance(v, bool) or v not in (0, 1, 2, 3):
            raise ConfigError(f"{key}={text} must be a ZeRO stage: 0, 1, 2 or 3")
        return v
    if name == "optimizer_offload":
        if not isinstance(v, bool):
            raise ConfigError(f"{key}={text} must be true or false")
        return v
    target = "none" if v is None else str(v).lower()  # verl: null offloads nothing
    if target not in OFFLOAD_TARGETS:
        raise ConfigError(f"{key}={text} is not one of verl's offload targets: {', '.join(OFFLOAD_TARGETS)}")
    if target == "nvme":
        st.notes.append(f"{key}={text}: alignrl offloads the optimizer state to CPU memory (ZeRO-Offload), not to "
                        "NVMe")
    return target != "none"


def settings(given: dict[str, tuple[str, object]]) -> dict[str, tuple[object, str]]:
    """One role's engine as verl would run it: setting -> (value, the override it comes from); a setting no override
    speaks of is left out. An explicit key wins over its group's default (Hydra applies the group first); verl
    offloads the optimizer only from ZeRO-2 on."""
    group_source, group = given.get("group", (None, None))
    source, strategy = given.get("strategy", (group_source, group["strategy"] if group else None))
    out: dict[str, tuple[object, str]] = {}
    if strategy is not None:
        # the engine's defaults come with the group that selects it, else with the strategy key
        by = group_source if group and group["strategy"] == strategy else source
        out = {k: (v, by) for k, v in (DEEPSPEED if strategy == "deepspeed" else FSDP).items()}
        out["strategy"] = (strategy, source)
    for name in ("zero_stage", "offload"):
        if name in given:
            out[name] = (given[name][1], given[name][0])
    if given.get("optimizer_offload", ("", False))[1]:
        out["offload"] = (True, given["optimizer_offload"][0])
    if "offload" in out and out.get("zero_stage", (2, ""))[0] < 2:
        out["offload"] = (False, out["offload"][1])
    return out


def finish(st: TranslationPass) -> list[str]:
    """alignrl's trainer.strategy / zero_stage / offload for the actor's engine, unless alignrl's own keys give them
    (they win, as elsewhere); an engine setting the run does not follow goes to `st.not_applied`, with the reason."""
    if not st.engine:
        return []
    own = {}  # alignrl's own keys as given (the last one)
    for o in st.out:
        k, _, v = o.partition("=")
        if k in ("trainer.strategy", "trainer.zero_stage", "trainer.offload"):
            own[k.removeprefix("trainer.")] = parsed(v)
    actor = settings(st.engine.get("actor", {}))
    run = {name: own[name] if name in own else actor[name][0] if name in actor else default
           for name, default in (("strategy", "fsdp"), ("zero_stage", 2), ("offload", False))}
    run["strategy"] = "fsdp" if run["strategy"] == "fsdp2" else run["strategy"]
    deepspeed = run["strategy"] == "deepspeed"
    ds_only = (f"DeepSpeed's settings apply to a DeepSpeed run (actor@actor_rollout_ref.actor=ds_actor); this one "
               f"trains with trainer.strategy={run['strategy']}")
    for name in ("zero_stage", "offload"):
        if name in actor and not deepspeed and _ds_key(actor[name][1]):
            _not_applied(st, actor[name][1], ds_only)
    if deepspeed and "offload" not in own and not run["offload"]:  # the actor's stage is under 2
        for k in ("offload", "optimizer_offload"):
            source, on = st.engine.get("actor", {}).get(k, ("", False))
            if on:
                _not_applied(st, source, "verl offloads the optimizer only from ZeRO stage 2 on")
    _critic(st, run, ds_only)
    return [f"trainer.{name}={actor[name][0]}" for name in ("strategy", "zero_stage", "offload")
            if name in actor and name not in own and (name == "strategy" or deepspeed)]


def _critic(st: TranslationPass, run: dict[str, object], ds_only: str) -> None:
    """The critic's engine settings that differ from the run's, listed as not applied (one engine trains both)."""
    deepspeed = run["strategy"] == "deepspeed"
    engine_ = ", ".join(f"trainer.{n}={str(v).lower()}" for n, v in run.items() if n == "strategy" or deepspeed)
    one_engine = f"alignrl trains the actor and the critic with one engine, the actor's ({engine_})"
    for name, (value, source) in settings(st.engine.get("critic", {})).items():
        if name == "strategy" or deepspeed:
            if value != run[name]:
                _not_applied(st, source, one_engine)
        elif _ds_key(source):  # a DeepSpeed key of its own, not its group's default
            _not_applied(st, source, ds_only)


def _ds_key(source: str) -> bool:
    found = _field(source.split("=", 1)[0])
    return found is not None and found[1] != "strategy"


def _not_applied(st: TranslationPass, source: str, why: str) -> None:
    key, _, value = source.partition("=")
    st.not_applied[key] = (value, why)
