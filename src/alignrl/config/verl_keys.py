"""verl / Search-R1 command-line spellings mapped onto alignrl's keys, so that a verl script runs with
`python3 -m verl.trainer.main_ppo` replaced by `alignrl train ppo` and nothing else changed.

Four kinds of verl keys:

* renamed: same behaviour under an alignrl key (`actor_rollout_ref.actor.optim.lr` -> `actor.lr`; the
  actor's engine, fsdp by default as in verl, -> `trainer.strategy=fsdp`: FSDP2 over the ranks, unsharded on
  one; verl's DeepSpeed engine (`actor@actor_rollout_ref.actor=ds_actor`, `strategy=deepspeed`, its
  `zero_stage` and `offload`) -> `trainer.strategy=deepspeed` with its stage and offload: `verl_groups`);
* not used on this device: settings of GPU memory, FSDP, vLLM or HDFS that change no result here
  (offload, `gpu_memory_utilization`, the deprecated global micro-batch sizes of log-prob passes, ...);
  accepted and listed once;
* accepted at one value only: switches whose other value alignrl does not implement
  (`+trainer.val_only=true`, `algorithm.no_think_rl=true`) are a one-line error, not a silent no-op;
* accepted, not applied: keys of Search-R1's ppo_trainer.yaml alignrl has no setting for (mini-batch
  `shuffle`, the critic's own mini-batch size and epochs, the state-masking markers, v0.3's format-reward
  credits); a value other than the one alignrl behaves as is listed once at start with the reason.

Anything else goes through unchanged, so alignrl's own keys work beside verl's and a misspelt key
still gets the usual "unknown config key" line. A verl-spelled command line also gets its verl's defaults
where alignrl's differ, unless the key is given: Search-R1's (`SEARCH_R1_DEFAULTS`) when it gives a key only
Search-R1 reads, verl 0.7's (`VERL07_DEFAULTS`) otherwise, so a verl user who leaves a key out gets what that verl
would have done. verl 0.7's newer spellings are read by `verl_recent`. Hydra's config selection (`--config-name`)
other than main_ppo's own `ppo_trainer` is refused by the command line (`alignrl.cli`); a YAML file goes in
`--config`. Hydra's selection of verl's own config groups is read by `verl_groups`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import sys
from dataclasses import dataclass, field

from alignrl.config.checks import nearest_sibling
from alignrl.config.file_shape import SEED_KEYS, SEED_MODEL_PARTS, unknown_seed_key
from alignrl.config.schema import CLIP_C_LOSSES, ConfigError, RunConfig
from alignrl.config.verl_groups import engine as _engine, finish as finish_engine
from alignrl.config.verl_multi_turn import multi_turn
from alignrl.config.verl_pass import TranslationPass, UnknownKeyError
from alignrl.config.verl_recent import finish as finish_recent, parsed as _value, recent as _recent
from alignrl.config.verl_tables import (A, ALIASES, CKPT_TO_KEEP, CRITIC_FOLLOWS_ACTOR, MISSING, NOT_APPLIED,
                                        NOT_USED, NOTED, ONLY_VALUE, R, RENAMES, SEARCH_R1_DEFAULTS, search_r1_spelled,
                                        VERL07_CLIP_RATIO_C, VERL07_DEFAULTS, VERL_SECTIONS)


KWARGS = "custom_reward_function.reward_kwargs"  # verl's keyword arguments of the reward function
TEMPLATE_KWARGS = "data.apply_chat_template_kwargs"  # verl's variables of the chat template: data.chat_template_kwargs


@dataclass(frozen=True)
class Translation:
    overrides: list[str]  # in alignrl's spelling, in the order given
    explicit: set[str] = field(default_factory=set)  # alignrl keys the overrides set
    not_used: list[str] = field(default_factory=list)  # verl keys accepted without effect here
    notes: list[str] = field(default_factory=list)  # verl settings alignrl follows its own way, named
    verl_style: bool = False  # some verl spelling was used: VERL_DEFAULTS apply
    output_is_run_dir: bool = False  # nodes.yaml's models.output.path=...: the run folder itself, unless named
    global_micro: int | None = None  # verl's deprecated global ppo_micro_batch_size: divided by the world size
    missing: list[str] = field(default_factory=list)  # verl features alignrl does not have, asked for: one line each
    search_r1: bool = False  # a Search-R1-only key was given: Search-R1's verl defaults, else verl 0.7's


def translate(overrides: list[str] | tuple[str, ...]) -> Translation:
    """Overrides in verl's spellings (Hydra's `+`/`++` prefixes allowed) rewritten to alignrl's keys."""
    st = TranslationPass(overrides, search_r1=search_r1_spelled(overrides))
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            st.out.append(o)  # load_config names the malformed override
            continue
        key = ALIASES.get(key.lstrip("+"), key.lstrip("+"))
        st.verl = st.verl or o.startswith("+") or key.startswith(("actor_rollout_ref.", "critic.optim.",
                                                                  "critic.model."))
        # one chain of cases, split in six: the first case that matches the key takes it
        if not (_engine(st, key, value) or multi_turn(st, key, value) or _renamed(st, key, value)
                or _recent(st, key, value) or _accepted(st, key, value)):
            _other(st, key, value)
    return _finish(st)


def _renamed(st: TranslationPass, key: str, value: str) -> bool:
    """verl keys with an alignrl key of their own (renamed or converted); False: not one of them."""
    if key in ("data.val_data_num", "data.val_max_samples") and _value(value) in (None, -1):  # verl: every row
        st.verl = True
        st.notes.append(f"{key}={value}: alignrl evaluates the first data.val_size held-out rows")
    elif key == TEMPLATE_KWARGS or key.startswith(TEMPLATE_KWARGS + "."):
        st.verl = True  # the whole mapping, or one of its entries (`+data.apply_chat_template_kwargs.x=v`)
        st.out.append(f"data.chat_template_kwargs{key[len(TEMPLATE_KWARGS):]}={value}")
    elif key in RENAMES:
        st.verl = True
        if key == "trainer.default_local_dir":  # verl's path is relative to the working directory
            value = os.path.abspath(value)
        if "sandbox_fusion" in key and _value(value) is None:  # verl's null: no sandbox (programs run locally)
            value = ""
        if key == A + "clip_ratio":  # only the fallback of clip_ratio_low/high given beside it (as in verl)
            st.out[:0] = [f"{target}={value}" for target in RENAMES[key]]
        else:
            st.out += [f"{target}={value}" for target in RENAMES[key]]
    elif key == A + "ppo_micro_batch_size" and isinstance(_value(value), int):
        st.verl, st.global_micro = True, _value(value)  # all ranks together, as verl divides it (resolve_counts)
    elif key == A + "use_gpg_loss":  # verl's earlier switch of GPG's loss (now policy_loss.loss_mode=gpg)
        st.verl = True
        if _value(value) is True:
            st.out.append("actor.policy_loss=gpg")
    elif key == "trainer.critic_warmup" and isinstance(_value(value), int):
        # verl trains the actor from global step critic_warmup (steps count from 1); alignrl after
        # critic.warmup_steps critic-only steps
        st.verl = True
        st.out.append(f"critic.warmup_steps={max(0, _value(value) - 1)}")
    else:
        return False
    return True


def _accepted(st: TranslationPass, key: str, value: str) -> bool:
    """verl keys accepted without an alignrl key (one value only, noted, not applied, not used); False: not one."""
    if key in ONLY_VALUE:
        st.verl = True
        allowed, instead = ONLY_VALUE[key]
        if _value(value) != allowed:
            raise ConfigError(f"{key}={value} is not supported ({instead})")
    elif key in NOTED:
        st.verl = True
        if _value(value) is False:
            st.notes.append(f"{key}={value}: {NOTED[key]}")
    elif key in NOT_APPLIED:
        st.verl = True
        followed, why = NOT_APPLIED[key]
        if _value(value) != followed:
            st.not_applied[key] = (value, why)
        else:
            st.not_applied.pop(key, None)
    elif key in CRITIC_FOLLOWS_ACTOR:
        st.verl = True
        st.critic_follows[key] = value
    elif key in CKPT_TO_KEEP:
        st.verl = True
        st.keep[key] = _checkpoints_to_keep(key, value)
        # one folder holds actor and critic: keep what the larger request keeps (0: every one)
        st.out.append(f"trainer.max_checkpoints={0 if 0 in st.keep.values() else max(st.keep.values())}")
    elif any(fnmatch.fnmatchcase(key, pattern) for pattern in MISSING):
        st.verl = True
        feature, off = next(MISSING[p] for p in MISSING if fnmatch.fnmatchcase(key, p))
        if _value(value) not in off:
            asked = st.missing.setdefault(feature, [])
            asked[:] = [k for k in asked if not k.startswith(key + "=")] + [f"{key}={value}"]
    elif any(fnmatch.fnmatchcase(key, pattern) for pattern in NOT_USED):
        st.verl = True
        if key not in st.not_used:
            st.not_used.append(key)
    else:
        return False
    return True


def _other(st: TranslationPass, key: str, value: str) -> None:
    """nodes.yaml's spellings, verl's custom reward function, an unknown verl key, or an alignrl key as given."""
    if key in SEED_KEYS:  # the multi-node launcher's nodes.yaml spellings, as its file takes them
        st.out.append(f"{SEED_KEYS[key]}={value}")
        st.output_is_run_dir = st.output_is_run_dir or key == "models.output.path"
    elif key in SEED_MODEL_PARTS:  # beside models.train.path they only name it; alone they would not apply
        if not any(o.startswith("models.train.path=") for o in st.overrides):
            raise ConfigError(f"{key} builds the model's folder only inside a nodes.yaml; on the command line "
                              "give the folder itself: models.train.path=PATH")
    elif key.startswith(("training.", "models.")):  # a mistyped seed key: not "unknown config key 'training'"
        raise ConfigError(unknown_seed_key(key))
    elif key in ("custom_reward_function.path", "custom_reward_function.name"):
        st.verl = True
        st.custom[key.rsplit(".", 1)[1]] = value
    elif key.startswith((KWARGS, "reward." + KWARGS)):  # the mapping, or one entry (+...reward_kwargs.x=v)
        st.verl = True
        st.out.append(f"algorithm.reward_fn_kwargs{key.split(KWARGS, 1)[1]}={value}")
    elif key in ("data.custom_cls.path", "data.custom_cls.name"):  # verl's dataset class: both parts, or neither
        st.verl = True
        st.dataset_cls[key.rsplit(".", 1)[1]] = value
    elif key.startswith(VERL_SECTIONS):
        raise UnknownKeyError(f"unknown config key '{key}'{nearest_sibling(key, RENAMES)}: not a verl/Search-R1 key "
                          "alignrl knows (docs/verl-keys.md lists them; `alignrl config --reference` "
                          "lists alignrl's own keys)")
    else:
        st.out.append(f"{key}={value}")


def reads(key: str, value: str) -> bool:
    """Whether alignrl reads the override `key=value`: one of its own keys, or a verl key it maps, accepts or names
    (a value it refuses still counts: the run's config load names it)."""
    try:
        t = translate([f"{key}={value}"])
    except UnknownKeyError:
        return False
    except ConfigError:
        return True
    return all(_alignrl_key(o.split("=", 1)[0].lstrip("+")) for o in t.overrides)


_DEFAULT_CONFIG = RunConfig()  # walked by _alignrl_key, once per key of a user's Hydra file


def _alignrl_key(key: str) -> bool:
    """Whether `key` (dotted) names a setting of alignrl's RunConfig."""
    node: object = _DEFAULT_CONFIG
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def _finish(st: TranslationPass) -> Translation:
    """What needs every override first: the critic's keys against the actor's, the reward function, n_agent."""
    out, not_applied, custom = st.out, st.not_applied, st.custom
    for key, value in st.critic_follows.items():
        if value == "${actor_rollout_ref.%s}" % CRITIC_FOLLOWS_ACTOR[key]:  # verl's own default: the actor's
            continue
        actor = [o.split("=", 1)[1] for o in out if o.startswith(CRITIC_FOLLOWS_ACTOR[key] + "=")]
        if not actor or _value(actor[-1]) != _value(value):
            not_applied[key] = (value, "alignrl's critic trains on the actor's mini-batches and epochs "
                                       "(actor_rollout_ref.actor.ppo_mini_batch_size and ppo_epochs)")
    out += finish_recent(st)
    out += finish_engine(st)  # also puts the critic's engine settings the run does not follow in not_applied
    _sum_pi_squared(st, out)
    notes = st.notes + _grouped(not_applied) + _estimator_notes(out)
    if custom.get("path") not in (None, "null"):  # verl's default function name is compute_score
        out.append(f"algorithm.reward_fn={custom['path']}:{custom.get('name', 'compute_score')}")
    out += _dataset_class(st.dataset_cls)
    # n_agent is Search-R1's group size; verl's rollout.n beside it is the vLLM sample count (1)
    agent_n = [o for o in st.overrides if o.lstrip("+").startswith(R + "n_agent=")]
    if agent_n:
        n_agent = agent_n[-1].split("=", 1)[1]
        out = [o for o in out if not o.startswith("rollout.n=")] + [f"rollout.n={n_agent}"]
        unit_given = any(o.startswith("actor.ppo_mini_batch_unit=") for o in out)
        if _value(n_agent) != 1 and not unit_given:  # Search-R1 multiplies it by verl's rollout.n (1), not n_agent
            out.append("actor.ppo_mini_batch_unit=sequences")
    explicit = {o.split("=", 1)[0] for o in out} | ({"actor.ppo_micro_batch_size"} if st.global_micro else set())
    missing = [f"{feature}: {', '.join(keys)}" for feature, keys in st.missing.items()]
    return Translation(out, explicit, st.not_used, notes, st.verl, st.output_is_run_dir, st.global_micro, missing,
                       st.search_r1)


def _grouped(not_applied: dict[str, tuple[str, str]]) -> list[str]:
    """One line per reason, naming every key it holds for (the three format credits share one)."""
    by_why: dict[str, list[str]] = {}
    for key, (value, why) in not_applied.items():
        by_why.setdefault(why, []).append(f"{key}={value}")
    return [f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} accepted but not applied: {why}"
            for why, keys in by_why.items()]


def _estimator_notes(out: list[str]) -> list[str]:
    """The estimator settings verl reads and leaves without effect, followed as verl does and named once: its trainer
    passes norm_adv_by_std_in_grpo to its grpo alone, so its grpo_vectorized divides by the group std whatever the
    flag says."""
    last = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in out if "=" in o}
    if (_value(last.get("algorithm.adv_estimator", "")) == "grpo_vectorized"
            and _value(last.get("algorithm.norm_adv_by_std_in_grpo", "true")) is False):
        return ["algorithm.norm_adv_by_std_in_grpo=False is not applied to algorithm.adv_estimator=grpo_vectorized, "
                "as in verl (whose trainer passes it to grpo alone): the advantages are divided by the group std; "
                "for Dr.GRPO use algorithm.adv_estimator=grpo"]
    return []


def _sum_pi_squared(st: TranslationPass, out: list[str]) -> None:
    """verl's actor.calculate_sum_pi_squared beside its optimal token baselines: what they read, computed here for them
    whatever the key says, so True is applied (no note) and False, on which verl's trainer stops, is refused."""
    last = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in out if "=" in o}
    estimator = _value(last.get("algorithm.adv_estimator", ""))
    if estimator not in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return
    st.not_applied.pop(A + "calculate_sum_pi_squared", None)
    given = [o.split("=", 1)[1] for o in st.overrides if o.lstrip("+").startswith(A + "calculate_sum_pi_squared=")]
    if given and _value(given[-1]) is False:
        raise ConfigError(f"{A}calculate_sum_pi_squared={given[-1]}: algorithm.adv_estimator={estimator} reads each "
                          "token's sum of squared probabilities (verl stops without it): set it True, or drop it "
                          "(alignrl computes it for this estimator)")


def _checkpoints_to_keep(key: str, text: str) -> int:
    """verl's max_*_ckpt_to_keep as alignrl's trainer.max_checkpoints: null, 0 or less keep every checkpoint
    (verl deletes only for a positive count)."""
    value = _value(text)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={text} must be a whole number or null (null keeps every checkpoint)")
    return max(0, value)


def verl_defaults(t: Translation, given: set[str], adv_estimator: str, use_kl_loss: bool) -> list[str]:
    """The overrides that give a verl-spelled run its verl's defaults for the keys it leaves out: Search-R1's
    (verl 0.1) when it gives a Search-R1-only key, verl 0.7's otherwise (`given`: the keys set by the overrides or
    the config file; `use_kl_loss`: the merged actor.use_kl_loss, from either of them)."""
    if not t.verl_style:
        return []
    out = [f"{k}={v}" for k, v in (SEARCH_R1_DEFAULTS if t.search_r1 else VERL07_DEFAULTS).items() if k not in given]
    if t.search_r1 and "algorithm.use_kl_in_reward" not in given:  # its verl applies the KL in the reward whenever
        use_kl_loss = use_kl_loss and "actor.use_kl_loss" in given  # the loss has none (False: the table's)
        out.append(f"algorithm.use_kl_in_reward={not use_kl_loss}")
    if not t.search_r1 and "actor.clip_ratio_c" not in given and _policy_loss(t, given) in CLIP_C_LOSSES:
        out.append(f"actor.clip_ratio_c={VERL07_CLIP_RATIO_C}")  # verl 0.7's vanilla loss dual-clips, DPPO truncates
    estimator = adv_estimator if "algorithm.adv_estimator" in given else "gae"  # the table's when none is given
    if "critic.enable" not in given:
        out.append(f"critic.enable={estimator == 'gae'}")
    if estimator in ("gae", "opo") and "rollout.n" not in given:  # verl samples one response a prompt (OPO: each
        out.append("rollout.n=1")  # then keeps its reward); a group estimator keeps alignrl's 8 (verl's 1 has none)
    if t.search_r1 and "agent.max_response_length" not in given:
        # Search-R1 keeps a trajectory's first max_prompt_length tokens; verl's agent loop caps an episode's response
        # at rollout.response_length, data.max_response_length unless given (alignrl's 0: rollout.max_new_tokens)
        out.append("agent.max_response_length=${data.max_prompt_length}")
    if "model.dtype" not in given and _cuda_bf16():
        # verl computes in bf16 over fp32 weights (FSDP mixed precision, a bf16 vLLM and reference): alignrl's
        # bfloat16 model with its fp32 master weights
        out.append("model.dtype=bfloat16")
    return out


def _dataset_class(given: dict[str, str]) -> list[str]:
    """verl's data.custom_cls.{path,name} as data.dataset_class=path:name (a null path: verl's own dataset)."""
    path, name = (_value(given.get(part, "null")) for part in ("path", "name"))
    if path in (None, ""):
        return []
    if name in (None, ""):
        raise ConfigError(f"data.custom_cls.path={path} needs data.custom_cls.name=<the dataset class in it>")
    return [f"data.dataset_class={path}:{name}"]


def _policy_loss(t: Translation, given: set[str]) -> str | None:
    """The run's actor.policy_loss as the overrides set it; alignrl's ppo_clip when nothing sets it; None when only
    the config file does (its value is not read here, so no dual-clip is added to a loss it may not fit)."""
    chosen = [o.split("=", 1)[1] for o in t.overrides if o.startswith("actor.policy_loss=")]
    if chosen:
        return str(_value(chosen[-1]))
    return None if "actor.policy_loss" in given else "ppo_clip"


def _cuda_bf16() -> bool:
    from alignrl.runtime.env import cuda_bf16  # torch: only verl-spelled runs pay for it here

    return cuda_bf16()


def list_not_used(t: Translation) -> None:
    """Print the keys without effect here, once per launch: a torchrun parent marks it done in the
    environment its ranks inherit, and under torchrun only rank 0 speaks."""
    flag = "ALIGNRL_VERL_KEYS_LISTED"
    if not (t.not_used or t.notes or t.missing) or os.environ.get(flag) or os.environ.get("RANK", "0") != "0":
        return
    os.environ[flag] = "1"
    # stderr: `alignrl config <verl keys> > run.yaml` must stay a clean YAML file
    if t.not_used:
        print(f"alignrl: verl settings not used on this device (GPU memory, vLLM, storage): {', '.join(t.not_used)}",
              file=sys.stderr, flush=True)
    for line in t.missing:  # features, not hardware: no device would honour them here
        print(f"alignrl: verl feature alignrl does not have, not applied: {line}", file=sys.stderr, flush=True)
    for note in t.notes:
        print(f"alignrl: {note}", file=sys.stderr, flush=True)
