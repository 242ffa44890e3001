"""The command line of process reward models (`alignrl train prm`): its flat config, and OpenRLHF's `train_prm` and
TRL's `PRMConfig` flag spellings read as its keys.

    alignrl train prm train_files=[data/steps.jsonl] eval_files=[data/steps_test.jsonl] --output_dir models/prm
    alignrl train prm --pretrain models/sft --dataset data/math_shepherd.jsonl --input_key input --label_key value \\
        --placeholder_token ки --reward_tokens + - --max_len 2048 --save_path models/prm

The keys shared with `alignrl train rm|dpo|sft|kto` are `preference.configs.CommonConfig`'s, layered the same way:
defaults < `--config` YAML < `key=value` < flags. The defaults of learning_rate (1e-5), max_length (1024) and
step_separator are TRL's PRMConfig's. Nothing here imports torch.

`reward_tokens=[]` trains OpenRLHF's whole-vocabulary loss (its `--reward_tokens` unset, None): each label is the text
of one token, and the cross-entropy at each placeholder is over the whole vocabulary. That is what a line in
OpenRLHF's spelling that names no reward tokens trains, as train_prm would (`their_defaults`: said at start with the
other defaults of theirs it takes); our own keys and TRL's spelling keep the default `[+, -]`, the loss over those two
alone.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from alignrl.config import ConfigError, opt
from alignrl.preference.cli import COMMANDS, load_flat_config, make_parser, run_cli
from alignrl.preference.configs import CommonConfig
from alignrl.preference.flag_names import CommandFlags, dataset_hint, epilog, flags_as_keys


@dataclass(frozen=True)
class PRMConfig(CommonConfig):
    train_files: list = opt([], "training rows (.jsonl/.json/.parquet), concatenated (OpenRLHF: --dataset)")
    eval_files: list = opt([], "held-out rows: their step loss and step accuracy before and after training; []: "
                               "none (OpenRLHF: --eval_dataset)")
    input_key: str = opt("input", "column of a row's text with a placeholder after each step (OpenRLHF's layout)")
    prompt_key: str = opt("prompt", "column of a stepwise row's prompt (TRL's layout)")
    completions_key: str = opt("completions", "column of a stepwise row's list of steps (TRL's layout)")
    label_key: str = opt("labels", "column of a row's labels, one per step: reward tokens, booleans or numbers in "
                                   "[0, 1] (OpenRLHF's default: label)")
    placeholder_token: str = opt("ки", "the token after each step, where the model's next-token logits are read; "
                                       "must be one token of the tokenizer")
    reward_tokens: list = opt(["+", "-"], "the label tokens, each one token; the first is the positive label (what a "
                                          "true or a soft label p is the probability of); []: the loss over the "
                                          "whole vocabulary, each label the text of one token (OpenRLHF's "
                                          "--reward_tokens unset, what a line in its spelling without it trains)")
    step_separator: str = opt("\n", "what follows each step's placeholder when a stepwise row becomes text (TRL's "
                                    "step_separator)")
    train_on_last_step_only: bool = opt(False, "train on each row's last (kept) step only; held-out rows are "
                                               "measured on every step (TRL's)")
    max_length: int = opt(1024, "tokens of a row; a longer row keeps its whole steps that fit (OpenRLHF: --max_len)",
                          ge=8)
    max_train_pairs: int = opt(0, "use only the first N training rows of all train_files together, in their order "
                                  "(OpenRLHF's --max_samples); 0: all", ge=0)
    max_eval_pairs: int = opt(0, "use only the first N held-out rows of all eval_files together; 0: all", ge=0)
    batch_size: int = opt(8, "rows per device per micro-batch (OpenRLHF: --micro_train_batch_size)", ge=1)
    eval_batch_size: int = opt(16, "rows per device per evaluation forward", ge=1)
    learning_rate: float = opt(1e-5, "peak AdamW learning rate (TRL's PRMConfig default)", gt=0.0)


PRM_FLAGS = CommandFlags(
    names={"dataset": "train_files", "dataset_name": "train_files", "eval_dataset": "eval_files"},
    left_out={"max_prompt_length": "max_length cuts a row after its last whole step that fits, prompt included",
              "max_completion_length": "max_length cuts a row after its last whole step that fits",
              "aux_loss_coef": "no MoE balancing loss is added"})
SPACED = ("reward_tokens",)  # OpenRLHF's nargs flag: `--reward_tokens + -`
QUOTED = ("placeholder_token", "step_separator")  # texts kept as given (`-`, `:`, `#` would be YAML)


def _texts_as_keys(argv: list[str]) -> list[str]:
    """`--reward_tokens + -` (OpenRLHF's several words, or `--reward_tokens=+,-`) and the text flags as quoted
    `key=value` words, which YAML reads back as the texts given."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i][2:].partition("=") if argv[i].startswith("--") else ("", "", "")
        if name not in (*SPACED, *QUOTED):
            out.append(argv[i])
            i += 1
            continue
        if eq:
            words, i = (value.split(",") if name in SPACED and not value.startswith("[") else [value]), i + 1
        else:
            rest = argv[i + 1:]
            n = len(list(itertools.takewhile(lambda w: not w.startswith("--") and "=" not in w, rest))) \
                if name in SPACED else min(1, len(rest))
            words, i = rest[:n], i + 1 + n
        if not words:
            raise ConfigError(f"--{name} needs a value (--{name} VALUE)")
        listed = name in SPACED and len(words) == 1 and words[0].startswith("[")
        out.append(f"{name}={words[0] if listed else json.dumps(words if name in SPACED else words[0])}")
    return out


def parse_prm(argv: list[str]) -> PRMConfig:
    p = make_parser("alignrl train prm", "A process reward model: a causal LM trained to put a label token after "
                                         "each step of a solution.")
    p.epilog = epilog(PRM_FLAGS) + " Keys and data layouts: docs/prm.md"
    args = p.parse_intermixed_args(flags_as_keys(_texts_as_keys(argv), PRMConfig, PRM_FLAGS))
    cfg = load_flat_config(PRMConfig, args.config, args.overrides, {"output_dir": args.output_dir,
                                                                      "logging_dir": args.logging_dir})
    if not cfg.train_files:
        raise ConfigError(f"train_files is empty: give the training rows, {dataset_hint(argv, PRM_FLAGS)}")
    odd = [t for t in cfg.reward_tokens if not isinstance(t, str)]
    if odd:  # str() would train on "True" where the line meant "yes", on "1" where it meant "01"
        raise ConfigError(f"reward_tokens={list(cfg.reward_tokens)}: YAML read {odd[0]!r} as {type(odd[0]).__name__}, "
                          "not a text (it reads yes/no/on/off as booleans, digits as numbers); quote each token, e.g. "
                          "reward_tokens='[\"yes\", \"no\"]', or give --reward_tokens yes no")
    tokens = list(cfg.reward_tokens)
    if len(tokens) == 1 or len(set(tokens)) != len(tokens) or not all(tokens):
        raise ConfigError(f"reward_tokens={tokens} must be two or more different tokens, the positive label first "
                          "(e.g. --reward_tokens + -), or [] for the loss over the whole vocabulary")
    if not cfg.placeholder_token:
        raise ConfigError("placeholder_token is empty: give the token that ends each step (e.g. --placeholder_token "
                          "ки)")
    if cfg.placeholder_token in tokens:
        raise ConfigError(f"placeholder_token {cfg.placeholder_token!r} is also a reward token; pick another")
    return cfg


COMMANDS["prm"] = (parse_prm, "alignrl.preference.prm", "train_prm")


def prm_main(argv: list[str] | None = None) -> int:
    return run_cli(argv, "prm")
