"""verl 0.7's spellings (DAPO's recipe, the validation sampler, the reward model, the policy-loss mode, rollout
correction, the reward manager's overlong buffer, LoRA's excluded modules, remote code, the `file` logger), read for
`verl_keys.translate`: `recent` takes such a key while the overrides are read, `finish` turns what it gathered into
alignrl's overrides once every override is known."""

from __future__ import annotations

import json
from pathlib import Path

from alignrl.config.schema import CLIP_C_LOSSES, ConfigError
from alignrl.config.verl_pass import TranslationPass, UnknownKeyError
from alignrl.config.verl_tables import (A, DAPO, FILTER_METRICS, LOSS_MODE_TUNING, LOSS_MODES, MISSING, NOT_USED, R, RC,
                                        REWARD_MANAGERS, ROLLOUT_CORRECTION_OFF, VAL_KWARGS)

# verl's LoRA exclusion alignrl has (the regular expression verl's vision-language LoRA scripts give): the image
# tower's adapters are frozen at their zero start (actor.freeze_prefix=visual), which leaves it exactly as without them
VISION_TOWER = ".*visual.*"
_RECENT_PREFIXES = ("algorithm.filter_groups.", "reward_model.overlong_buffer.", R + "val_kwargs.",
                    "reward_model.reward_manager", "reward_model.enable", "reward_model.model.path",
                    "reward_model.model.input_tokenizer", A + "policy_loss.", RC)
_REF_SYNC = ("actor_rollout_ref.ref.sync_ref_model", "actor_rollout_ref.ref.ref_model_sync_steps",
             "actor_rollout_ref.ref.ref_model_mixup_alpha")
_OWN = ("reward_model.reward_kwargs.max_resp_len", "actor_rollout_ref.model.exclude_modules", *_REF_SYNC,
        "trainer.ref_update_freq")


def parsed(text: str) -> object:
    """An override's value as Hydra reads it; an interpolation (${...}) or unclosed brackets: the text as given,
    never a traceback (a value that goes on to alignrl's key is read, and its error named, by load_config)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.from_dotlist([f"v={text}"])["v"]
    except Exception:
        return text


def recent(st: TranslationPass, key: str, value: str) -> bool:
    """verl 0.7's keys, gathered or rewritten into `st`; False: not one of them."""
    v = parsed(value)
    whole = isinstance(v, int) and not isinstance(v, bool)
    if key == "trainer.save_freq" and whole and v < 0:  # verl's default: no periodic checkpoint
        st.out.append("trainer.save_freq=0")
        st.notes.append(f"{key}={value}: alignrl keeps the final checkpoint only (verl saves none)")
        return True
    if key == "trainer.test_freq" and whole and v < 0:  # verl's default: no validation during training
        st.out.append("trainer.test_freq=0")
        return True
    if key == "reward_model.max_length":  # read when the reward model re-templates only, as in verl
        if v is not None and not (whole and v > 0):
            raise ConfigError(f"{key}={value} must be a positive whole number (the reward model's longest input) "
                              "or null (the policy's prompt and response lengths)")
        st.verl = True
        st.out += [] if v is None else [f"algorithm.reward_model_max_length={v}"]
        return True
    if key.endswith(".trust_remote_code") and key.split(".")[0] in ("actor_rollout_ref", "critic", "data",
                                                                     "reward_model"):
        st.verl = True
        st.remote_code = [k for k in st.remote_code if k != key] + ([key] if v is True else [])
        return True
    if key in MISSING or key in NOT_USED or not (key.startswith(_RECENT_PREFIXES) or key in _OWN):
        return False  # e.g. rollout correction's switches alignrl lacks, overlong_buffer.log: verl_keys._accepted's
    st.verl = True
    if key.startswith(RC):
        if key not in ROLLOUT_CORRECTION_OFF:
            raise UnknownKeyError(f"unknown config key '{key}': not a key of verl's algorithm.rollout_correction "
                              f"({', '.join(k.removeprefix(RC) for k in ROLLOUT_CORRECTION_OFF)})")
        st.rollout_correction[key.removeprefix(RC)] = (value, v)
    elif key.startswith(A + "policy_loss."):
        _policy_loss(st, key, value, v)
    elif key in _OWN:
        st.later[key] = (value, v)
    else:
        _dapo_and_reward(st, key, value, v)
    return True


def _policy_loss(st: TranslationPass, key: str, value: str, v: object) -> None:
    if key == A + "policy_loss.loss_mode":
        if v not in LOSS_MODES:
            raise ConfigError(f"{key}={value} is not supported (alignrl's policy losses as verl names them: "
                              f"{', '.join(LOSS_MODES)})")
        st.loss_mode = str(v)
        st.out.append(f"actor.policy_loss={LOSS_MODES[st.loss_mode]}")
    elif key in LOSS_MODE_TUNING:  # Clip-Cov's and KL-Cov's settings, under alignrl's actor.* names
        st.out.append(f"actor.{key.rsplit('.', 1)[1]}={value}")
    else:
        raise UnknownKeyError(f"unknown config key '{key}': verl's policy_loss keys alignrl knows are loss_mode and "
                          f"{', '.join(k.rsplit('.', 1)[1] for k in LOSS_MODE_TUNING)}")


def _dapo_and_reward(st: TranslationPass, key: str, value: str, v: object) -> None:
    """DAPO's filter groups and overlong buffer, the validation sampler, the reward manager and the reward model."""
    if key in ("reward_model.enable", "reward_model.model.path", "reward_model.model.input_tokenizer"):
        st.reward_model[key] = value
    elif key in DAPO:
        st.out.append(f"{DAPO[key]}={value}")
        if key.startswith("reward_model.overlong_buffer."):
            st.overlong["len" if key.endswith(".len") else "factor"] = value
    elif key == "reward_model.overlong_buffer.enable":
        st.overlong["enable"] = value
    elif key == "algorithm.filter_groups.max_num_gen_batches":
        _gen_batches(st, key, v)
    elif key == "algorithm.filter_groups.metric":
        if v is not None and v not in FILTER_METRICS:
            raise ConfigError(f"{key}={value} is not supported (alignrl keeps the groups whose rewards differ: "
                              f"{', '.join(FILTER_METRICS)})")
    elif key in VAL_KWARGS:
        st.val_kwargs[key.rsplit(".", 1)[1]] = v
    elif key == "reward_model.reward_manager":
        if v not in REWARD_MANAGERS:
            raise ConfigError(f"{key}={value} is not supported (alignrl's reward stage is the rule reward, verl's "
                              "naive manager, with DAPO's overlong buffer: naive, dapo, prime, batch or gdpo)")
        st.out.append(f"algorithm.reward_fn_batch={str(v == 'batch').lower()}")  # batch: one call per batch
        if v == "prime":  # its process pool: each row at most 300 s, a row past it scoring 0
            st.out.append("algorithm.reward_timeout_s=300")
    else:
        raise UnknownKeyError(f"unknown config key '{key}': not a verl key alignrl knows (docs/verl-keys.md lists "
                              "them)")


def _gen_batches(st: TranslationPass, key: str, v: object) -> None:
    """verl's generation batches per step (the first one included; 0 or less: no limit) as alignrl's extra rounds."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key}={v} must be a whole number (generation batches per step; 0: no limit)")
    if v > 0:
        st.out.append(f"algorithm.max_gen_rounds={v - 1}")
    else:
        st.notes.append(f"{key}={v}: alignrl bounds the extra generation rounds of a step at "
                        "algorithm.max_gen_rounds (3), then trains on the groups kept")


def finish(st: TranslationPass) -> list[str]:
    """alignrl's overrides for what `recent` gathered (appended to st.out's), with its notes and missing features."""
    out = []
    if st.overlong and parsed(st.overlong.get("enable", "false")) is not True:  # verl applies it only when on
        out.append("algorithm.overlong_buffer_len=0")
    out += _reward_model(st.reward_model) + _validation(st.val_kwargs, st.search_r1)
    out += rollout_correction(st)
    if LOSS_MODES[st.loss_mode] not in CLIP_C_LOSSES:  # verl's other losses read no clip_ratio_c; alignrl's refuse one
        st.out[:] = [o for o in st.out if not o.startswith("actor.clip_ratio_c=")]
    _response_cap_note(st)
    out += _excluded_modules(st) + _verl_logger(st) + _generation_batch(st) + _reference_sync(st)
    _remote_code(st)
    return out


def _validation(given: dict, search_r1: bool) -> list[str]:
    """verl's validation sampler. verl 0.7's agent loop (its only rollout) samples with val_kwargs' temperature,
    top_p and top_k whatever do_sample says, and its trainer repeats each prompt val_kwargs.n times (its defaults:
    temperature 0, greedy, and n 1). Search-R1's verl samples with them only when do_sample is true (its default
    false: greedy)."""
    if search_r1 and given.get("do_sample") is not True:
        return []
    return [f"{VAL_KWARGS[R + 'val_kwargs.' + k]}={v}" for k, v in given.items() if k != "do_sample"]


def _reward_model(given: dict[str, str]) -> list[str]:
    """verl's reward model in the loop (reward_model.enable=True, reward_model.model.path): its score is the reward,
    as verl's reward manager returns the model's scores when it runs one."""
    if parsed(given.get("reward_model.enable", "false")) is not True:
        return []  # verl's config always holds a path; without enable it is not used
    path = given.get("reward_model.model.path")
    if parsed(path or "null") in (None, ""):
        raise ConfigError("reward_model.enable=True needs reward_model.model.path=<a sequence-classification folder, "
                          "e.g. from `alignrl train rm`>")
    # verl re-templates unless input_tokenizer is null (its default is the policy's path); it decodes with the
    # tokenizer at that path, alignrl with the policy's own, and keeps the ids for a reward model of the same one
    given_tokenizer = parsed(given.get("reward_model.model.input_tokenizer", "${actor_rollout_ref.model.path}"))
    return [f"algorithm.reward_model={path}",
            f"algorithm.reward_model_retemplate={str(given_tokenizer not in (None, '')).lower()}"]


def rollout_correction(st: TranslationPass) -> list[str]:
    """verl's algorithm.rollout_correction as alignrl's algorithm.rollout_* keys: truncated IS (rollout_is, its
    threshold, rollout_is_batch_normalize), rejection sampling (rollout_rs at a token, sequence or geometric level and
    its bounds) and the veto, all decided from the trainer's recomputed log-probs (verl's decoupled mode); or verl's
    bypass mode (`_bypass`)."""
    given = {k: v for k, (_, v) in st.rollout_correction.items()}
    level, rs = given.get("rollout_is"), given.get("rollout_rs")
    threshold = given.get("rollout_is_threshold", 2.0)
    if level not in (None, "token", "sequence"):
        raise ConfigError(f"{RC}rollout_is={level} is not supported (null, token or sequence)")
    threshold, icepop = _is_threshold(threshold)
    for key in ("rollout_rs_threshold_lower", "rollout_token_veto_threshold") + (
            () if rs not in (None, "token", "sequence", "geometric") else ("rollout_rs_threshold",)):
        v = given.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{RC}{key}={v} must be a number (a bound on the ratio pi_trainer / pi_rollout)")
    loss = given.get("loss_type", "ppo_clip")
    if loss not in ("ppo_clip", "reinforce"):
        raise ConfigError(f"{RC}loss_type={loss} is not supported (ppo_clip or reinforce, the losses of bypass mode)")
    reinforce = loss == "reinforce" or any(given.get(k) is True for k in ("use_policy_gradient",
                                                                            "use_pure_rollout_correction"))
    if any(given.get(k) is True for k in ("bypass_mode", "bypass_old_logprob_for_rollout")):
        if icepop is not None and level:  # verl zeroes the weights outside the band; the losses here bound them
            _missing(st, "IcePop's lower_upper rollout_is_threshold in bypass mode", ("rollout_is_threshold",))
        return _bypass(st, given, level, threshold, reinforce)
    if reinforce:
        _missing(st, "the policy-gradient loss of rollout correction without bypass mode", ("loss_type",
                 "use_policy_gradient", "use_pure_rollout_correction"))
    out = [f"algorithm.rollout_is={level}", f"algorithm.rollout_is_threshold={threshold}"] if level else []
    if level and icepop is not None:  # verl's lower_upper IS threshold: weights outside the band are zeroed (IcePop)
        out += ["algorithm.rollout_is_mode=zero", f"algorithm.rollout_is_threshold_lower={icepop}"]
    if level and given.get("rollout_is_batch_normalize") is True:  # verl normalises only weights it computes
        out.append("algorithm.rollout_is_batch_normalize=true")
    if rs is not None:
        if rs not in ("token", "sequence", "geometric"):  # current verl's divergence options, checked with the config
            spec = given.get("rollout_rs_threshold")
            out += [f"algorithm.rollout_rs={json.dumps(str(rs))}"]
            out += [f"algorithm.rollout_rs_threshold={json.dumps(spec) if isinstance(spec, str) else spec}"] \
                if spec is not None else []
        else:
            upper = given.get("rollout_rs_threshold")  # null: rollout_is_threshold's, given or not (verl's yaml)
            out += [f"algorithm.rollout_rs={rs}",
                    f"algorithm.rollout_rs_threshold={threshold if upper is None else upper}"]
            if given.get("rollout_rs_threshold_lower") is not None:
                out.append(f"algorithm.rollout_rs_threshold_lower={given['rollout_rs_threshold_lower']}")
    if given.get("rollout_token_veto_threshold") is not None:
        out.append(f"algorithm.rollout_token_veto_threshold={given['rollout_token_veto_threshold']}")
    return out


def _is_threshold(spec: object) -> tuple[float, float | None]:
    """verl's rollout_is_threshold: a number (the truncation's cap), or `lower_upper` (IcePop's band)."""
    if isinstance(spec, str):  # verl's spec string: "2.0", or lower_upper
        low, _, high = spec.rpartition("_")
        try:
            return float(high), (float(low) if low else None)
        except ValueError:
            pass
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ConfigError(f"{RC}rollout_is_threshold={spec} must be a number, or lower_upper (IcePop's band)")
    return spec, None


def _bypass(st: TranslationPass, given: dict, level: object, threshold: float, reinforce: bool) -> list[str]:
    """verl's bypass mode: the rollout's log-probs are the old policy's (actor.recompute_old_logprobs=false) and verl
    trains with its own loss whatever policy_loss.loss_mode says: ppo_clip, PPO's clipped ratio pi / pi_rollout with no
    IS weight (rollout_is is then logged only); or reinforce, -A * w * log pi with w = min(pi / pi_rollout, threshold)
    taken from the policy being trained (no IS: GPG's -A * log pi; token IS: CISPO's loss with the weight bounded to
    [0, threshold]). Rejection and normalisation that verl decides again in every micro-batch are named as missing."""
    out = ["actor.recompute_old_logprobs=false"]
    if not reinforce:
        st.loss_mode = "vanilla"
        if level:
            st.notes.append(f"{RC}rollout_is={level} in bypass mode with loss_type=ppo_clip: verl logs the IS "
                            "weights and trains with none (PPO's ratio is already pi / pi_rollout)")
    elif level == "token":
        if threshold < 1:
            raise ConfigError(f"{RC}rollout_is_threshold={threshold} must be >= 1 in bypass mode with loss_type="
                              "reinforce (alignrl's CISPO bounds the token weight to [0, threshold])")
        st.loss_mode = "cispo"
        out += ["actor.clip_ratio_low=1.0", f"actor.clip_ratio_high={threshold - 1}"]
    else:
        st.loss_mode = "gpg"
        if level == "sequence":
            _missing(st, "bypass mode's policy gradient with sequence-level IS weights", ("rollout_is",))
    out.append(f"actor.policy_loss={LOSS_MODES[st.loss_mode]}")
    asked = [k for k in ("rollout_rs", "rollout_token_veto_threshold") if given.get(k) is not None]
    asked += ["rollout_is_batch_normalize"] if given.get("rollout_is_batch_normalize") is True and reinforce else []
    if asked:
        _missing(st, "rollout correction's rejection, veto and IS normalisation in bypass mode (verl decides them "
                     "in each micro-batch from the policy being trained)", tuple(asked))
    return out


def _missing(st: TranslationPass, feature: str, keys: tuple[str, ...]) -> None:
    st.missing[feature] = [f"{RC}{k}={text}" for k, (text, _) in st.rollout_correction.items() if k in keys]


def _response_cap_note(st: TranslationPass) -> None:
    """DAPO's reward manager measures the overlong buffer from its own max_resp_len; alignrl from the response cap."""
    if "reward_model.reward_kwargs.max_resp_len" not in st.later:
        return
    text, value = st.later["reward_model.reward_kwargs.max_resp_len"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"reward_model.reward_kwargs.max_resp_len={text} must be a whole number (tokens)")
    caps = _given(st, "rollout.max_new_tokens")
    if caps:
        cap = parsed(caps[-1])
    else:
        from alignrl.config.schema import RolloutConfig

        cap = RolloutConfig().max_new_tokens
    if cap != value:
        st.notes.append(f"reward_model.reward_kwargs.max_resp_len={text} is not applied: alignrl measures the "
                        f"overlong buffer from the response cap, rollout.max_new_tokens={cap} "
                        "(data.max_response_length)")


def _given(st: TranslationPass, key: str) -> list[str]:
    """The values (as written) the overrides gathered so far give alignrl's `key`, in order: the last one wins."""
    return [o.split("=", 1)[1] for o in st.out if o.startswith(key + "=")]


def _generation_batch(st: TranslationPass) -> list[str]:
    """verl draws data.gen_batch_size prompts a generation batch and, without DAPO's filter, trains every one of
    them: a verl-spelled run's data.train_batch_size then (alignrl reads data.gen_batch_size with dynamic sampling
    only)."""
    sizes, filters = _given(st, "data.gen_batch_size"), _given(st, "algorithm.dynamic_sampling")
    if not sizes or (parsed(sizes[-1]) is not None and (not st.verl or (filters and parsed(filters[-1]) is True))):
        return []
    st.out[:] = [o for o in st.out if not o.startswith("data.gen_batch_size=")]  # null: the training batch
    return [] if parsed(sizes[-1]) is None else [f"data.train_batch_size={sizes[-1]}"]


def _reference_sync(st: TranslationPass) -> list[str]:
    """verl forks' reference sync (TR-DPO's): its pace and mix are read only when it is on, with TRL's defaults
    (512 steps, 0.6) where they are left out; verl's SPIN recipe's trainer.ref_update_freq copies the actor whole."""
    given = {key.rsplit(".", 1)[1]: value for key, (_, value) in st.later.items() if key in _REF_SYNC}
    every = st.later.get("trainer.ref_update_freq", (None, 0))[1]
    if isinstance(every, int) and every > 0:  # verl's SPIN recipe: the reference becomes the actor every N steps
        return [f"actor.ref_sync_steps={every}", "actor.ref_mixup_alpha=1.0"]
    if given.get("sync_ref_model") is not True:
        return []
    return [f"actor.ref_sync_steps={given.get('ref_model_sync_steps', 512)}",
            f"actor.ref_mixup_alpha={given.get('ref_model_mixup_alpha', 0.6)}"]


def _excluded_modules(st: TranslationPass) -> list[str]:
    """verl reads exclude_modules only with LoRA on; the image tower is the one exclusion alignrl has."""
    if "actor_rollout_ref.model.exclude_modules" not in st.later:
        return []
    text, value = st.later["actor_rollout_ref.model.exclude_modules"]
    ranks = [parsed(r) for r in _given(st, "model.lora_rank")]
    if value in (None, "", []) or not ranks or not isinstance(ranks[-1], int) or ranks[-1] <= 0:
        return []
    if value != VISION_TOWER:
        raise ConfigError(f"actor_rollout_ref.model.exclude_modules={text} is not supported (alignrl's LoRA leaves "
                          f"out only a vision-language model's image tower: exclude_modules='{VISION_TOWER}'; "
                          "choose the layers with actor_rollout_ref.model.target_modules instead)")
    folders = _given(st, "model.path")
    if folders and _local_config(folders[-1]) is not None and "vision_config" not in _local_config(folders[-1]):
        return []  # a text-only model has no tower: verl's pattern matches nothing there, and so nothing is frozen
    return ["actor.freeze_prefix=[visual]"]


def _local_config(folder: str) -> dict | None:
    """A local model folder's config.json; None when there is none to read (a hub name: the loader names it)."""
    try:
        info = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


# verl's trackers (verl/utils/tracking.py) with no sink here: the run logs to the others, said once
OTHER_TRACKERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")


def _verl_logger(st: TranslationPass) -> list[str]:
    """verl's `file` logger writes each step's metrics as a JSON line: alignrl's jsonl sink (metrics.jsonl); its
    trackers without a sink here (mlflow, swanlab, ...) are not applied, said once."""
    given = [o for o in st.out if o.startswith("trainer.logger=")]
    if not (st.verl and given):
        return []
    value = parsed(given[-1].split("=", 1)[1])
    sinks = [str(s) for s in (value if not isinstance(value, (str, type(None))) else [value] if value else [])]
    other = [s for s in sinks if s in OTHER_TRACKERS]
    if "file" not in sinks and not other:
        return []
    if other:
        st.not_applied["trainer.logger"] = (",".join(other), "no sink here for these trackers; metrics go to "
                                            "metrics.jsonl (and tensorboard, wandb when listed)")
    kept = ["jsonl" if s == "file" else s for s in sinks if s not in other]
    sinks = list(dict.fromkeys(kept + (["jsonl"] if other else [])))  # the metrics the tracker would have had
    return [f"trainer.logger=[{','.join(sinks)}]"]


def _remote_code(st: TranslationPass) -> None:
    """trust_remote_code changes nothing for an architecture transformers ships; a folder that brings its own
    modelling code (config.json's auto_map for a model_type transformers lacks) cannot load here: said now."""
    if not st.remote_code:
        return
    folders = [o.split("=", 1)[1] for o in st.out
               if o.startswith(("model.path=", "critic.model_path=", "algorithm.reward_model="))]
    for folder in folders:
        info = _local_config(folder)
        if info is None:
            continue
        kind = info.get("model_type")
        if info.get("auto_map") and not _shipped(kind):
            raise ConfigError(f"{st.remote_code[0]}=True: {folder} needs its own modelling code (config.json "
                              f"auto_map, model_type {kind!r}), which alignrl does not run; give a model of an "
                              "architecture transformers ships")


def _shipped(model_type: object) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING
