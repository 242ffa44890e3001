"""The command lines of reward-model and DPO training (`alignrl train rm|dpo`, training/*.py
`python -m src.training.train_rm` and `train_safe_mm_dpo`): their flat config, flags and exit codes.

The flat config keys are the ones the torchrun scripts' users edit (batch_size, max_length, learning_rate,
gradient_accumulation_steps, ...), layered defaults < `--config` YAML < `key=value` overrides anywhere
on the line < explicit flags. A YAML file in the Safe-MM-DPO project's keys (λ_init, β_ori, policy_model_path,
use_lora + lora: {r, ...}) is read through `preference.mmdpo_keys`, which maps each to the key here. Nothing here imports torch: a mistaken flag, key or value is named in a
fraction of a second, and only a valid config goes on to `alignrl.preference.rm` / `alignrl.preference.dpo`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from alignrl.config import ConfigError, check_folders, check_ranges
from alignrl.config.checks import did_you_mean
from alignrl.data.sources import is_library_dataset, without_split
from alignrl.errors import UserError
from alignrl.preference.configs import DPO_LOSS_NAMES, REFERENCE_FREE, SMOOTHED_LOSSES, DPOConfig, RMConfig
from alignrl.preference.flag_names import DPO_FLAGS, RM_FLAGS, CommandFlags, epilog, flags_as_keys, spelled_their_way
from alignrl.preference.notes import NOTES_SAID, say
from alignrl.preference.qlora_checks import with_4bit_checked

MAPPING_KEYS = ("chat_template_kwargs",)  # the keys whose values are mappings, checked before OmegaConf merges them
SINKS = ("jsonl", "tensorboard", "wandb")  # the metric sinks of report_to


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block: the same shape as every other user error
        if message.startswith("unrecognized arguments: "):  # argparse lists the overrides after an unknown flag too
            message = "unrecognized arguments: " + " ".join(_unknown_words(message.split(" ")[2:]))
        flag = message.removeprefix("unrecognized arguments: ").split(" ")[0]
        key = flag.removeprefix("--").partition("=")[0]
        if message.startswith("unrecognized") and flag.startswith("--") and key in _config_keys():
            # every key of this command is a flag: one that is not names another offline command's key
            raise ConfigError(f"{self.prog}: {flag} is a setting of another of the offline trainers (rm, dpo), not "
                              "of this one; drop it (see --help)")
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _unknown_words(words: list[str]) -> list[str]:
    """Of the words argparse could not place, the unknown flags with the values after them: a `key=value` override
    among them is one the parser takes (a wrong key is named when the config is built)."""
    out, in_flag = [], False
    for word in words:
        if word.startswith("--"):
            out.append(word)
            in_flag = "=" not in word
        elif in_flag and "=" not in word:
            out.append(word)
        else:
            in_flag = False
    return out or words


def _config_keys() -> set[str]:
    return {f.name for cls in (RMConfig, DPOConfig) for f in dataclasses.fields(cls)}


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=description)
    p.add_argument("--config", help="YAML file of flat keys (configs/rm_config.yaml, configs/dpo_config.yaml)")
    p.add_argument("--output_dir", help="trained model folder")
    p.add_argument("--logging_dir", help="metrics folder")
    # taken out of the command line before parsing (run_cli); listed here for --help
    p.add_argument("--nproc", type=int, help="train on N local processes (torchrun ranks)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learning_rate=1e-5 epochs=2")
    return p


def load_flat_config(cls: type, path: str | None, overrides: list[str], flags: dict[str, Any],
                     defaults: dict[str, Any] | None = None):
    """Defaults (the config class's, then `defaults`) < YAML file < key=value overrides < explicit flags; validated
    like the RL config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from alignrl.config.load import dotted_item

    from alignrl.preference.mmdpo_keys import read_yaml, translate, translate_override

    command = "rm" if issubclass(cls, RMConfig) else "dpo"
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), defaults or {})
        # the Safe-MM-DPO project's keys become ours; a key written twice is said, the last value kept
        tree = _mappings_checked(translate(read_yaml(path, say), command), path) if path else {}
        merged = OmegaConf.merge(merged, tree)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"unexpected argument {bad[0]!r} (overrides look like key=value, e.g. epochs=2)")
        items = [_mappings_checked(OmegaConf.to_container(dotted_item(cls, translate_override(o, command))), o)
                 for o in overrides]
        given = {k for t in (defaults or {}, tree, *items, {k: v for k, v in flags.items() if v is not None})
                 for k in t}  # the keys set anywhere: a default chosen by another key must not override them
        merged = OmegaConf.merge(merged, *items, {k: v for k, v in flags.items() if v is not None})
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(e).splitlines()[0]
        if "not in" in first or ("Key '" in first and "not" in first):
            names = [f.name for f in dataclasses.fields(cls)]
            raise ConfigError(f"unknown config key '{key}'{did_you_mean(key, names)}; allowed: {', '.join(names)}"
                              ) from None
        raise ConfigError(f"bad value for '{key}': {first}") from None
    # YAML reads `bf16: true` as a boolean, which the string field holds as "True"
    cfg = dataclasses.replace(cfg, bf16=str(cfg.bf16).lower())
    cfg = with_4bit_checked(_check_meaning(cfg), given)
    check_ranges(cfg)  # choices and ranges from the field metadata, the RL config's own check
    betas = cfg.adam_betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"adam_betas={list(betas)} must be two numbers in [0, 1), e.g. adam_betas=[0.9,0.95]")
    _check_sinks(cfg.report_to)
    # an existing output_dir (folder or file) is moved aside when the model is saved: only a file above it fails
    folders = {"--logging_dir": Path(cfg.logging_dir)} if cfg.logging_dir else {}
    if cfg.output_dir:
        output = Path(cfg.output_dir)
        folders["--output_dir"] = output.parent if output.is_file() else output
    check_folders(folders)
    return cfg


def _check_sinks(sinks: list) -> None:
    """The metric sinks: jsonl and tensorboard under logging_dir, and wandb (its run files there too, offline
    without an API key: `utils.tracking`), which needs its package."""
    unknown = set(sinks) - set(SINKS)
    if unknown:
        raise ConfigError(f"report_to has unknown sink(s) {sorted(map(str, unknown))}; allowed: {', '.join(SINKS)}")
    if "wandb" in sinks:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("report_to wandb needs the wandb package, which is not installed; `pip install "
                              "wandb`, or drop wandb from report_to")


def _mappings_checked(tree: dict[str, Any], source: str) -> dict[str, Any]:
    """`tree` (a YAML file's keys, or one override's) with its mapping-valued keys checked: OmegaConf refuses a list
    given to one without naming the key, and a null there means no variables, as verl's `{}` does."""
    for key in MAPPING_KEYS:
        value = tree.get(key)
        if value is None and key in tree:
            tree = {**tree, key: {}}
        elif value is not None and not isinstance(value, dict):
            raise ConfigError(f"bad value for '{key}' ({source}): {value!r} is not a mapping; give the template's "
                              f"variables as {key}={{enable_thinking: false}} or {key}.enable_thinking=false")
        elif value is not None and not all(isinstance(k, str) for k in value):
            raise ConfigError(f"bad value for '{key}' ({source}): the names of template variables are text, "
                              f"not {sorted(map(repr, value))}")
    return tree


def _check_meaning(cfg):
    """What the ranges cannot say: the λ that moves in log space, LoRA's peft, the older loss name."""
    if isinstance(cfg, DPOConfig) and cfg.lambda_init <= 0:
        raise ConfigError(f"λ_init (lambda_init) = {cfg.lambda_init} must be > 0: λ moves in log space "
                          "(ln λ ← ln λ + λ_lr·λ·J_C), so it starts positive (1.0 is the usual start)")
    if isinstance(cfg, DPOConfig) and cfg.loss_type == "safe":
        say("note: loss_type=safe is the older name of safe_odpo (a fixed-λ utility order with an ODPO offset); "
            "Safe-MM-DPO is loss_type=safe_mm_dpo")
        cfg = dataclasses.replace(cfg, loss_type="safe_odpo")
    if cfg.use_lora:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ConfigError("use_lora: LoRA needs the peft package, which is not installed; `pip install peft` "
                              "(or train all weights: use_lora=false)")
    return cfg


def parse_rm(argv: list[str]) -> RMConfig:
    p = make_parser("alignrl train rm", "Train a reward model (Bradley-Terry) or a Safe RLHF cost model.")
    p.epilog = epilog(RM_FLAGS) + " Keys, data and OpenRLHF's flags: docs/reward-models-and-dpo.md"
    p.add_argument("--task", choices=("helpful", "harmless"))
    p.add_argument("--model_type", choices=("auto", "reward", "cost"))
    args = p.parse_intermixed_args(flags_as_keys(argv, RMConfig, RM_FLAGS))  # key=value anywhere on the line
    cfg = load_flat_config(RMConfig, args.config, args.overrides, {
        "task": args.task, "model_type": args.model_type, "output_dir": args.output_dir,
        "logging_dir": args.logging_dir})
    if cfg.task == "harmless" and any(a.partition("=")[0] in ("--dataset", "--dataset_name", "--eval_dataset")
                                      for a in argv):
        raise ConfigError("--dataset names a reward model's pairs (task helpful); a cost model's: --task harmless "
                          "harmless_train_file=FILE harmless_eval_file=FILE")
    if cfg.model_type == "cost" and cfg.task == "helpful" and cfg.helpful_train_file.startswith("builtin:"):
        raise ConfigError("model_type=cost needs safety labels, which the helpful data has none of; use --task "
                          "harmless")
    return _their_way(cfg, argv, RM_FLAGS, "helpful_train_file", "helpful_eval_file")


def parse_dpo(argv: list[str]) -> DPOConfig:
    p = make_parser("alignrl train dpo", "DPO, IPO, conservative DPO, hinge, safety-aware DPO and TRL's other "
                    "pairwise losses.")
    p.epilog = epilog(DPO_FLAGS) + " Keys, data and OpenRLHF's flags: docs/reward-models-and-dpo.md"
    p.add_argument("--loss_type", choices=DPO_LOSS_NAMES)
    # a line in OpenRLHF's or TRL's spelling takes their defaults (flag_names): their DPO is the sigmoid loss, where
    # this command's own default (safe_mm_dpo) needs two scorers
    args = p.parse_intermixed_args(flags_as_keys(argv, DPOConfig, DPO_FLAGS))
    cfg = load_flat_config(DPOConfig, args.config, args.overrides, {
        "loss_type": args.loss_type, "output_dir": args.output_dir, "logging_dir": args.logging_dir})
    _check_ref_sync(cfg)
    _check_reference_free(cfg)
    if cfg.kl_coeff > 0 and cfg.precompute_ref_log_probs:
        raise ConfigError(f"kl_coeff={cfg.kl_coeff} needs the reference's logits at every step, which "
                          "precompute_ref_log_probs frees; set kl_coeff=0 or precompute_ref_log_probs=false")
    if cfg.loss_type == "robust" and cfg.label_smoothing >= 0.5:  # its loss divides by 1 - 2ε
        raise ConfigError("loss_type=robust needs label_smoothing below 0.5 (the loss is divided by 1 - 2ε)")
    if cfg.label_smoothing and cfg.loss_type not in SMOOTHED_LOSSES:  # the loss would ignore it
        raise ConfigError(f"label_smoothing={cfg.label_smoothing} is read only by loss_type "
                          f"{', '.join(SMOOTHED_LOSSES)}; not {cfg.loss_type}; set label_smoothing=0 or change "
                          "loss_type")
    return _their_way(cfg, argv, DPO_FLAGS, "train_files", "eval_files")


def _their_way(cfg, argv: list[str], table: CommandFlags, train_key: str, eval_key: str):
    """A run in OpenRLHF's or TRL's spelling names its own data: without a held-out set it holds out its training
    pairs (OpenRLHF's train_rm holds out some of them), not this command's shipped demo pairs."""
    if not spelled_their_way(argv, table):
        return cfg
    defaults = type(cfg).__dataclass_fields__
    train, held_out = getattr(cfg, train_key), getattr(cfg, eval_key)
    if train != _default(defaults[train_key]) and held_out == _default(defaults[eval_key]):
        # a dataset's held-out split is its test one (else validation, else train), whichever split trains
        held_out = [without_split(str(t)) for t in train] if isinstance(train, list) else without_split(str(train))
        named = train if isinstance(train, list) else [train]
        what = ("the training datasets' test (else validation, else train) split, the training pairs of a file"
                if any(is_library_dataset(str(t)) for t in named) else "the training pairs")
        say(f"note: no --eval_dataset: the held-out pairs are {what} ({eval_key}={held_out}; "
            "max_eval_pairs=N keeps the first N)")
        return dataclasses.replace(cfg, **{eval_key: held_out})
    return cfg


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def with_global_batch(cfg, ranks: int):
    """OpenRLHF's global batch (`train_batch_size`) as the micro-batches each rank accumulates per optimizer step,
    once the number of ranks is known."""
    if not cfg.train_batch_size:
        return cfg
    per_pass = cfg.batch_size * ranks
    steps, rest = divmod(cfg.train_batch_size, per_pass)
    if rest or not steps:
        raise ConfigError(f"train_batch_size={cfg.train_batch_size} is not a whole number of batch_size × ranks = "
                          f"{cfg.batch_size} × {ranks} = {per_pass}; give a multiple of {per_pass}")
    if cfg.gradient_accumulation_steps not in (1, steps):
        raise ConfigError(f"train_batch_size={cfg.train_batch_size} means gradient_accumulation_steps={steps} "
                          f"(batch_size {cfg.batch_size} × {ranks} ranks), not {cfg.gradient_accumulation_steps}; "
                          "give one of the two")
    if ranks == 1 and steps > 1:  # a script written for a cluster, run here on one process: say what it becomes
        say(f"note: train_batch_size={cfg.train_batch_size} on 1 rank is {steps} accumulated micro-batches of "
            f"{cfg.batch_size} per optimizer step (--nproc N trains on N ranks)")
    return dataclasses.replace(cfg, gradient_accumulation_steps=steps)


def same_model(ref_model_path: str | None, model_path: str) -> bool:
    """Whether the reference is the policy's own starting point (no ref_model_path, or the same folder)."""
    return (ref_model_path is None or ref_model_path == model_path
            or (Path(ref_model_path).exists() and Path(model_path).exists()
                and Path(ref_model_path).resolve() == Path(model_path).resolve()))


def _check_ref_sync(cfg: DPOConfig) -> None:
    """sync_ref_model moves a reference copy, so it needs one that lives through training; its two settings alone
    are kept (a config may carry them switched off) but said, since they change nothing then."""
    if not cfg.sync_ref_model:
        unused = [f"{k}={getattr(cfg, k)}" for k in ("ref_model_mixup_alpha", "ref_model_sync_steps")
                  if getattr(cfg, k) != DPOConfig.__dataclass_fields__[k].default]
        if unused:
            verb = "takes" if len(unused) == 1 else "take"
            say(f"note: {' and '.join(unused)} {verb} effect only with sync_ref_model=true; the reference stays fixed")
        return
    if cfg.precompute_ref_log_probs:
        raise ConfigError("sync_ref_model moves the reference during training, so log-probs precomputed up front "
                          "would go stale; set precompute_ref_log_probs=false or sync_ref_model=false")
    if cfg.use_lora and same_model(cfg.ref_model_path, cfg.model_path):
        raise ConfigError("sync_ref_model with use_lora: the reference is the policy with its adapters off, no copy "
                          "that could move; give ref_model_path (a folder other than model_path) or set use_lora=false")


def _check_reference_free(cfg: DPOConfig) -> None:
    """simpo, cpo and orpo read the policy alone: a setting of the reference would act on nothing."""
    if cfg.loss_type not in REFERENCE_FREE:
        return
    if cfg.loss_type == "orpo" and cfg.nll_loss_coef:  # ORPO's loss holds the chosen NLL already, at weight 1
        raise ConfigError(f"loss_type=orpo already trains the chosen responses' NLL; nll_loss_coef="
                          f"{cfg.nll_loss_coef} would add it twice: drop it (beta is ORPO's λ)")
    asked = [k for k in ("ref_model_path", "sync_ref_model", "precompute_ref_log_probs", "kl_coeff") if getattr(cfg, k)]
    if asked:
        raise ConfigError(f"loss_type={cfg.loss_type} uses no reference model, so {asked[0]}={getattr(cfg, asked[0])} "
                          "has nothing to act on; drop it, or pick a loss with a reference (sigmoid, ipo, ...)")


# command -> (its parser, the module and function that train; `train(cfg, dry_run_world)`)
COMMANDS = {"rm": (parse_rm, "alignrl.preference.rm", "train_rm"),
            "dpo": (parse_dpo, "alignrl.preference.dpo", "train_dpo")}


def rm_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "rm")


def dpo_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "dpo")


def run_cli(argv: list[str] | None, command: str) -> int:
    """`alignrl train <command>`: the config is parsed and checked first; `--nproc N` then re-launches the
    command under torchrun (after a dry run that checks the data against N ranks). User errors print one
    line and exit 2."""
    from alignrl.runtime.launch import pop_nproc, torchrun

    parse, module, function = COMMANDS[command]
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            nproc, argv = pop_nproc(argv)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        argv, recipe = _with_their_config_file(argv)
        try:
            parsed = parse(argv)
        except ConfigError as e:  # a flag of the file's: say where it came from
            raise (ConfigError(f"{e}; the settings of --config {recipe} are read as TRL's flags") if recipe else e)
        # the ranks are known now: `--nproc`, or torchrun's WORLD_SIZE in a rank it started
        cfg = with_global_batch(parsed, nproc or int(os.environ.get("WORLD_SIZE") or 1))
        train = getattr(_load_trainer(module), function)
        if nproc and "WORLD_SIZE" not in os.environ:
            train(cfg, nproc)  # bad data fails here, before any process starts
            os.environ[NOTES_SAID] = "1"  # the ranks inherit it: their notes were said here
            try:
                return torchrun(nproc, ["alignrl", "train", command, *argv], preload=(module,))
            finally:
                os.environ.pop(NOTES_SAID, None)
        train(cfg, None)
        return 0
    except UserError as e:
        return _one_line(e)
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches every rank: rank 0 speaks
        if os.environ.get("RANK", "0") == "0":
            print("alignrl: interrupted (these runs start again from the base model)", file=sys.stderr, flush=True)
        return 130


def _with_their_config_file(argv: list[str]) -> tuple[list[str], str | None]:
    """The line with a TRL YAML (`trl sft --config sft.yaml`: a mapping of TRL's flag names) read as its flags, the
    line's own after them, and the file's path; any other line (an alignrl `--config` of flat keys, a Safe-MM-DPO
    config) as it is."""
    from alignrl.runtime import flag_file

    markers = trl_only_names()
    expanded = flag_file.expand(argv, lambda settings: any(k in markers for k in settings), None, "TRL's",
                                bad_yaml_is_theirs=False)
    return (argv, None) if expanded is None else (expanded, flag_file.config_at(argv)[2])


def trl_only_names() -> set[str]:
    """TRL's names that no flat config file of ours takes (model_name_or_path, dataset_name, ...): one of them makes a
    file TRL's. Names both take (max_grad_norm is a Safe-MM-DPO key too, rpo_alpha ours) decide nothing. (The sft
    and kto keys, which import this module, hold none of TRL's names: tests/test_trl_config_file.py checks it.)"""
    from alignrl.preference.mmdpo_keys import LORA_KEYS, MMDPO_KEYS, RM_FILES, VERL_NAMES
    from alignrl.preference.mmdpo_keys import TRL_NAMES as RENAMED
    from alignrl.preference.their_defaults import TRL_NAMES

    ours = {f.name for cls in (RMConfig, DPOConfig) for f in dataclasses.fields(cls)}
    return set(TRL_NAMES) - ours - set(MMDPO_KEYS) - set(RM_FILES) - set(VERL_NAMES) - set(RENAMED) - set(LORA_KEYS)


def _load_trainer(module: str):
    import torch

    if not torch.cuda.is_available():  # else transformers' deepspeed probe warns "Setting accelerator to CPU"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load/save of a small model is noise in run logs
    return importlib.import_module(module)


def _one_line(e: Exception) -> int:
    if os.environ.get("RANK", "0") == "0":  # every rank fails the same way; one line is enough
        print(f"alignrl: error: {e}", file=sys.stderr, flush=True)
    else:  # torchrun stops the others when a rank exits: give rank 0 the moment it needs to print
        time.sleep(1.0)
    return 2
