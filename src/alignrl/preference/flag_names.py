"""OpenRLHF's and TRL's flag spellings of the offline trainers' config keys (`alignrl train sft|rm|dpo`), read as
`key=value` overrides before the command's parser sees the line.

    alignrl train dpo --pretrain Qwen/Qwen2.5-0.5B-Instruct --dataset data/pairs.jsonl --beta 0.1 --max_len 1024 \\
        --micro_train_batch_size 2 --train_batch_size 16 --save_path models/dpo

`COMMON_NAMES` holds the names every offline command shares (model, output, lengths, batches, optimizer, LoRA,
logging); each command adds its own table (`CommandFlags`): its data flags, switches that set a key to a value,
flags it leaves out (refused in one line saying why) and flags that change nothing here (accepted with a note).
Every config key is also a flag under its own name: `--key VALUE`, `--key=VALUE`, a switch bare or with true/false
(TRL's `--gradient_checkpointing True`). A line in OpenRLHF's or TRL's spelling also takes their script's defaults
where it is silent (`their_defaults`, said in one line). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import re
from dataclasses import dataclass, field, fields

from alignrl.config import ConfigError
from alignrl.preference.flag_current import is_current_openrlhf, read_flag, read_switch, with_resume
from alignrl.preference.flag_splits import LIST_KEYS, split_flags, with_splits
from alignrl.preference.mmdpo_keys import read_yaml, translate, translate_override
from alignrl.preference.notes import say
from alignrl.preference.their_defaults import OPENRLHF, TRL, TRL_DEFAULTS, adopted, say_adopted, spellings

# OpenRLHF's and TRL's names of keys every offline command has (a name already ours needs no entry)
COMMON_NAMES = {
    "pretrain": "model_path", "model_name_or_path": "model_path", "save_path": "output_dir",
    "max_len": "max_length", "max_epochs": "epochs", "num_train_epochs": "epochs",
    "micro_train_batch_size": "batch_size", "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size", "micro_eval_batch_size": "eval_batch_size",
    "max_samples": "max_train_pairs", "l2": "weight_decay", "max_norm": "grad_clip", "max_grad_norm": "grad_clip",
    "lr_warmup_ratio": "warmup_ratio", "lr_scheduler_type": "lr_scheduler", "logging_steps": "log_every",
    "target_modules": "lora_target_modules", "lora_r": "lora_rank", "use_peft": "use_lora",
    "ckpt_path": "checkpoint_dir", "max_ckpt_num": "save_total_limit", "resume_from_checkpoint": "resume_from",
    "dataset_probs": "train_files_probs", "use_bnb_nested_quant": "bnb_4bit_use_double_quant",
}
# switches of theirs that set one of our keys to a value (`bf16` is a three-way setting here: auto/true/false)
COMMON_SWITCHES = {"bf16": ("bf16", "true")}
COMMON_LEFT_OUT: dict[str, str] = {}
# switches with no effect on what trains (packing: rows train padded, to the same loss)
COMMON_IGNORED = ("flash_attn", "adam_offload", "disable_fast_tokenizer", "packing_samples", "packing")
# their scheduler names of ours: OpenRLHF's cosine_with_min_lr is this cosine (its floor is min_lr_ratio's 0.1);
# OpenRLHF's empty --input_template is no template, its prompt as it is: our '{}'
# TRL's report_to none and all: no sink, every sink here (wandb where it is installed, as transformers' "all" takes
# the integrations installed)
VALUE_NAMES = {("lr_scheduler", "cosine_with_min_lr"): "cosine", ("lr_scheduler", "constant_with_warmup"): "constant",
               ("input_template", ""): "{}", ("report_to", "none"): "[]",
               # TRL's --resume_from_checkpoint true: the newest checkpoint of the output folder, which must exist
               ("resume_from", "True"): "latest", ("resume_from", "true"): "latest", ("resume_from", "False"): "null",
               ("resume_from", "false"): "null",
               ("report_to", "all"): "[jsonl,tensorboard,wandb]" if importlib.util.find_spec("wandb") else
               "[jsonl,tensorboard]"}
# transformers' logging integrations with no sink here: dropped from --report_to with a note
OTHER_REPORTERS = ("trackio", "mlflow", "swanlab", "comet_ml", "clearml", "neptune", "dvclive", "aim", "azure_ml",
                   "codecarbon", "dagshub", "flyte")
TEXT_KEYS = ("input_template",)  # keys whose flag value is a text to keep as given
# keys OpenRLHF and TRL give as several words (argparse nargs): `--loss_type sigmoid bco_pair sft --loss_weights 1 1 1`
SPACED_LISTS = ("adam_betas", "lora_target_modules", "loss_type", "loss_weights")
OWN_FLAGS = ("config", "logging_dir", "nproc", "help")  # the parser's own flags, never config keys
TRUE_WORDS = ("true", "yes", "1")


@dataclass(frozen=True)
class CommandFlags:
    """One command's flag table on top of the common one."""

    names: dict[str, str]  # their flag name -> our key
    switches: dict[str, tuple[str, str]] = field(default_factory=dict)  # their switch -> (our key, value when on)
    left_out: dict[str, str] = field(default_factory=dict)  # flag -> why it is refused
    ignored: tuple[str, ...] = ()  # flags that change nothing here: accepted, said once
    always: dict[str, str] = field(default_factory=dict)  # switches naming what happens here anyway -> why
    parsed: tuple[str, ...] = ()  # flags the command's own parser reads (choices): passed on as given
    # flags of theirs that name what happens here anyway: flag -> (the values accepted, what happens here)
    accepted: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def all_names(self) -> dict[str, str]:
        return {**COMMON_NAMES, **self.names}

    def all_switches(self) -> dict[str, tuple[str, str]]:
        return {**COMMON_SWITCHES, **self.switches}

    def all_left_out(self) -> dict[str, str]:
        return {**COMMON_LEFT_OUT, **self.left_out}

    def all_ignored(self) -> tuple[str, ...]:
        return COMMON_IGNORED + self.ignored


def _switch_keys(config_class: type) -> set[str]:
    return {f.name for f in fields(config_class) if f.type in (bool, "bool", "bool | None")}


def _list_value(value: str) -> str:
    """OpenRLHF's comma-separated file list (`--dataset a.jsonl,b.jsonl`) as a list override; `[...]` as given."""
    if value.startswith("["):
        return value
    return json.dumps([v for v in value.split(",") if v])


def _switched(target: str, set_to: str, on: bool) -> list[str]:
    """The override of a switch: its value when on; off, the other boolean, or nothing for a switch that picks a
    value (`--ipo false` leaves loss_type as it is)."""
    if on:
        return [f"{target}={set_to}"]
    return [f"{target}={'false' if set_to == 'true' else 'true'}"] if set_to in ("true", "false") else []


def _valued(key: str, name: str, value: str, lora_given: bool) -> list[str]:
    """The overrides of `--name VALUE` for our key `key`."""
    if key == "eval_steps" and value.strip() == "-1":  # OpenRLHF's offline trainers: once per epoch
        return ["eval_strategy=epoch"]
    if key == "save_steps" and value.strip() == "-1":  # OpenRLHF's "never"; ours is 0
        value = "0"
    value = VALUE_NAMES.get((key, value.strip()), value)
    if key == "report_to":
        value = _reporters(value)
    if name == "lora_rank" and value.strip() == "0":  # OpenRLHF's "no LoRA"; our rank is at least 1
        return [] if lora_given else ["use_lora=false"]
    if key in TEXT_KEYS:  # quoted, so that YAML reads a template back as it is (`#`, `: `, `{}`)
        value = json.dumps(value)
    out = [f"{key}={_list_value(value) if key in LIST_KEYS else value}"]
    if name == "lora_rank" and not lora_given and value.strip().isdigit():  # OpenRLHF has no switch of its own
        out.append("use_lora=true")
    return out


def _left_out(name: str, why: str, given: str | None) -> int:
    """A flag left out is one line; OpenRLHF's `--dataset_probs 1.0` (its scripts' default, the one dataset's share)
    asks for nothing else than the one dataset: accepted, said. Returns the flag's words taken."""
    if name == "dataset_probs" and given is not None and given.strip() in ("1", "1.0"):
        say("note: --dataset_probs 1.0: the one dataset's share, all of its rows")
        return 1
    raise ConfigError(f"--{name}: {why}")


def _reporters(value: str) -> str:
    """TRL's --report_to without the integrations that have no sink here (trackio, mlflow, ...), said once; the
    metrics then go to metrics.jsonl at least."""
    words = [w for w in value.strip().strip("[]").replace(",", " ").split() if w]
    other = [w for w in words if w in OTHER_REPORTERS]
    if not other:
        return value
    kept = [w for w in words if w not in OTHER_REPORTERS] or ["jsonl"]
    say(f"note: --report_to {', '.join(other)}: no sink here for it; metrics go to {', '.join(kept)} under "
        "logging_dir")
    return "[" + ",".join(kept) + "]"


def their_names(argv: list[str], own_names: CommandFlags) -> list[str]:
    """The flags of the line named by OpenRLHF's or TRL's name that is not a key of ours (`--pretrain`,
    `--model_name_or_path`, `--dataset`, `--max_len`, ...; a switch of theirs: `--ipo`), each once."""
    theirs = {k for k, v in own_names.all_names().items() if k != v} | set(own_names.switches)
    named = (a[2:].partition("=")[0] for a in argv if a.startswith("--"))
    return [n for n in dict.fromkeys(named) if n in theirs]


def dataset_hint(argv: list[str], own_names: CommandFlags, key: str = "train_files") -> str:
    """How to give the training rows in the line's own spelling: TRL's --dataset_name, OpenRLHF's --dataset, or
    our key (a line of both, or of neither, gets ours with OpenRLHF's beside it)."""
    whose = spellings(their_names(argv, own_names))
    if whose == {TRL}:
        return "--dataset_name NAME_OR_FILE"
    if whose == {OPENRLHF}:
        return "--dataset FILE"
    return f"{key}=[data/train.jsonl] (OpenRLHF: --dataset FILE; TRL: --dataset_name NAME_OR_FILE)"


def spelled_their_way(argv: list[str], own_names: CommandFlags) -> bool:
    """Whether the line names a flag by OpenRLHF's or TRL's own name: a run written for their scripts (a name both
    have, `--logging_steps`, decides nothing)."""
    return bool(spellings(their_names(argv, own_names)))


def flags_as_keys(argv: list[str], config_class: type, own_names: CommandFlags) -> list[str]:
    """`--name VALUE`, `--name=VALUE` and bare switches of OpenRLHF's, TRL's or our own key names as `key=value`
    overrides, placed after the line's own `key=value` words so that a flag wins over an override, as the
    commands' layering says. `--lora_rank N` switches LoRA on (N > 0) or off (0) unless use_lora is given, as
    OpenRLHF has no switch of its own. Our own flags, overrides and unknown flags pass through for the parser."""
    argv, splits = split_flags(argv)
    keys, switches = {f.name for f in fields(config_class)}, _switch_keys(config_class)
    names, their_switches = own_names.all_names(), own_names.all_switches()
    left_out, ignored = own_names.all_left_out(), own_names.all_ignored()
    lora_given = any(a.startswith(("--use_lora", "use_lora=", "--use_peft")) for a in argv)
    passed, overrides, i = [], _engine_of(argv), 0
    while i < len(argv):
        word, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        key = names.get(name, name)
        if name in left_out:
            i += _left_out(name, left_out[name], value if eq else nxt) + (0 if eq else 1)
            continue
        words = _spaced_words(argv, i + 1) if key in SPACED_LISTS and key in keys and not eq else []
        if name in own_names.parsed and len(words) > 1:  # several words of a flag the parser takes as one
            overrides.append(f"{key}=[{','.join(words)}]")
            i += 1 + len(words)
        elif not name or name in OWN_FLAGS or name in own_names.parsed:
            passed.append(word)  # our own flags, overrides, and what the parser reads itself
            i += 1
        elif name not in keys and (read := read_flag(word, name, eq, value, nxt, own_names.accepted)) is not None:
            overrides += read[0]  # OpenRLHF's current flags, TRL's run-level ones (flag_current)
            i += read[1]
        elif name in ignored or name in own_names.always:
            on, taken = read_switch(word, name, value if eq else None, nxt)
            if name in ignored:
                say(f"note: --{name} changes nothing here and is ignored")
            elif not on:
                raise ConfigError(f"--{name} false: {own_names.always[name]}")
            i += taken
        elif name in their_switches or key in switches:
            on, taken = read_switch(word, name, value if eq else None, nxt)
            overrides += _switched(*their_switches.get(name, (key, "true")), on)
            i += taken
        elif key in keys:
            if not eq and (nxt is None or nxt.startswith("--")):
                raise ConfigError(f"--{name} needs a value (--{name} VALUE)")
            value, i = (value, i + 1) if eq else (nxt, i + 2)
            if len(words) > 1:  # OpenRLHF's nargs: `--adam_betas 0.9 0.95`, `--target_modules q v`
                value, i = f"[{','.join(words)}]", i + len(words) - 1  # as a list override
            if key == "output_dir":
                passed += ["--output_dir", value]
            else:
                overrides += _valued(key, name, value, lora_given)
        else:  # not a key of this command: the parser names it as unknown
            passed.append(word)
            i += 1
    overrides = with_splits(overrides, own_names, splits)
    words = _their_ipo(with_resume(passed + overrides), argv, own_names)
    words = _their_defaults(argv, config_class, own_names, words) + words
    _say_template_use(words, config_class)
    return words


def _their_ipo(words: list[str], argv: list[str], own_names: CommandFlags) -> list[str]:
    """TRL's ipo divides the log-probs by their length: a line in TRL's spelling asking for ipo trains
    ipo_token_mean, said once (alignrl's ipo, OpenRLHF's `--ipo`, is on sums)."""
    if spellings(their_names(argv, own_names)) != {TRL}:
        return words
    out = [("--loss_type=ipo_token_mean" if w == "--loss_type=ipo" else
            "ipo_token_mean" if w == "ipo" and i and words[i - 1] == "--loss_type" else
            re.sub(r"(?<=[\[,])(\s*)ipo(?=\s*[,\]])", r"\1ipo_token_mean", w) if w.startswith("loss_type=[") else w)
           for i, w in enumerate(words)]
    if out != words:
        say("note: TRL's ipo is on token means: loss_type ipo_token_mean (alignrl's ipo, OpenRLHF's, is on sums; "
            "TRL also puts a list's other losses on token means, alignrl only ipo)")
    return out


def _last_value(words: list[str], key: str) -> str | None:
    """The value the last `key=value` word of `words` gives `key`, if any."""
    given = [w.partition("=")[2] for w in words if w.partition("=")[0] == key]
    return given[-1] if given else None


def _say_template_use(words: list[str], config_class: type) -> None:
    """Notes on an input_template the line gives: beside the chat template it is ignored (as OpenRLHF ignores
    --input_template there), and the two characters \\n in it are no newline (OpenRLHF warns so too)."""
    template = _last_value(words, "input_template")
    with contextlib.suppress(ValueError):  # a quoted text (the flag's); a word as it is
        template = json.loads(template) if template and template.startswith('"') else template
    if template is None or template in ("null", "None", "~"):
        return
    chat = _last_value(words, "apply_chat_template")
    default = {f.name: f.default for f in fields(config_class)}.get("apply_chat_template")
    if (chat.lower() in TRUE_WORDS) if chat is not None else default:
        say("note: input_template is ignored: the chat template renders the prompts (apply_chat_template=true), as "
            "OpenRLHF ignores --input_template beside --apply_chat_template")
    elif "\\n" in template and "\n" not in template:
        say("note: input_template holds the two characters \\n, not a newline: in bash pass $'User: {}\\nAssistant: '")


def _spaced_words(argv: list[str], start: int) -> list[str]:
    """The value words from `start` on: up to the next flag or `key=value` word."""
    return list(itertools.takewhile(lambda w: not w.startswith("--") and "=" not in w, argv[start:]))


def _their_defaults(argv: list[str], config_class: type, own_names: CommandFlags, words: list[str]) -> list[str]:
    """The overrides of OpenRLHF's or TRL's defaults that a line in their spelling leaves unsaid (said in one line;
    `their_defaults`); none for a line in our own keys."""
    names = their_names(argv, own_names)
    whose = spellings(names)
    if not whose:  # our own keys, or only names both have
        return []
    lora = any(w.lower() == "use_lora=true" for w in words)
    chat = (_last_value(words, "apply_chat_template") or "false").lower() in TRUE_WORDS
    # sft's packing switches' words: either packs some rows, so TRL's packing_strategy (bfd) applies
    packed = any((_last_value(words, k) or "false").lower() in TRUE_WORDS for k in ("packing", "eval_packing"))
    taken, not_taken = adopted(config_class, whose, _line_keys(words, config_class, own_names), lora, chat, packed,
                               current=is_current_openrlhf(argv))
    say_adopted(config_class, whose, names, taken, not_taken)
    if whose == {TRL} and _last_value(words, "eval_strategy") == "steps" and _last_value(words, "eval_steps") is None:
        every = _last_value(words, "log_every") or TRL_DEFAULTS["sft"]["log_every"]  # transformers: logging_steps
        say(f"note: --eval_strategy steps without --eval_steps: every {every} steps (--logging_steps), as TRL's")
        taken.append(f"eval_steps={every}")
    return taken


def _line_keys(words: list[str], config_class: type, own_names: CommandFlags) -> set[str]:
    """The keys the line sets: its `key=value` words and flags (as `flags_as_keys` gives them), the flags the
    command's parser reads, and the keys of its `--config` file."""
    command = "rm" if config_class.__name__ == "RMConfig" else "dpo"  # the key spellings load_flat_config reads
    keys: set[str] = set()
    for i, word in enumerate(words):
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        if name == "config" and (eq or i + 1 < len(words)):
            keys |= set(translate(read_yaml(value if eq else words[i + 1], lambda _: None), command))
        elif name in (*own_names.parsed, "output_dir", "logging_dir"):
            keys.add(name)
        elif not name and "=" in word:
            keys.add(translate_override(word, command).partition("=")[0].lstrip("+").split(".")[0])
    return keys


def _engine_of(argv: list[str]) -> list[str]:
    """OpenRLHF's trainers run DeepSpeed unless `--backend` says otherwise, so its `--zero_stage N` asks for it:
    strategy=deepspeed, unless the line picks the engine itself (`--backend`, `--strategy`, `strategy=`); a model
    sized for ZeRO-3 would not fit as a whole copy on every rank."""
    named = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}
    if "zero_stage" not in named or {"strategy", "backend"} & named or any(a.startswith("strategy=") for a in argv):
        return []
    if _four_bit(argv):  # OpenRLHF's QLoRA scripts keep --zero_stage; a 4-bit base trains under ddp here
        say("note: --zero_stage with --load_in_4bit: the 4-bit base trains under strategy=ddp (bitsandbytes' packed "
            "weights are no DeepSpeed partitions; the adapters' optimizer state is small)")
        return []
    say("note: --zero_stage runs DeepSpeed (strategy=deepspeed), as OpenRLHF's scripts do")
    return ["strategy=deepspeed"]


def _four_bit(argv: list[str]) -> bool:
    """Whether the line's last word on 4-bit loading (`--load_in_4bit` bare or with a value, load_in_4bit=) is on."""
    on = False
    for i, word in enumerate(argv):
        name, eq, value = word[2:].partition("=") if word.startswith("--") else ("", "", "")
        if name == "load_in_4bit":
            on = read_switch(word, name, value if eq else None, argv[i + 1] if i + 1 < len(argv) else None)[0]
        elif word.partition("=")[0] == "load_in_4bit":
            on = word.partition("=")[2].lower() in TRUE_WORDS
    return on


# OpenRLHF's pair-data flags the offline pair trainers (rm, dpo) leave out
PAIR_LEFT_OUT = {
    "tokenizer_chat_template": "the tokenizer's own chat template renders the prompts (save another in the model "
                               "folder's tokenizer_config.json)",
    "max_prompt_length": "the prompt keeps at most half of max_length (its end)",
}

RM_FLAGS = CommandFlags(
    names={"dataset": "helpful_train_file", "dataset_name": "helpful_train_file",
           "eval_dataset": "helpful_eval_file"},
    left_out={**PAIR_LEFT_OUT, "dataset_probs": "the reward model reads one file per task (helpful_train_file, "
                                                 "harmless_train_file); blend them into one file"},
    ignored=("compute_fp32_loss",), parsed=("task", "model_type"),
    accepted={"value_head_prefix": (("value_head", "score"), "alignrl saves the head as score (transformers' name) "
                                                             "and reads value_head (OpenRLHF's) or score"),
              "loss": (("sigmoid",), "the reward model trains with the Bradley-Terry loss -log σ(r_chosen - "
                                     "r_rejected), OpenRLHF's sigmoid")})
DPO_FLAGS = CommandFlags(
    names={"dataset": "train_files", "dataset_name": "train_files", "eval_dataset": "eval_files",
           "ref_pretrain": "ref_model_path", "rpo_alpha": "nll_loss_coef", "cpo_alpha": "nll_loss_coef"},
    switches={"ipo": ("loss_type", "ipo")}, left_out=PAIR_LEFT_OUT, ignored=("ref_offload",), parsed=("loss_type",))


def epilog(own_names: CommandFlags) -> str:
    """The --help lines of a command's flag names."""
    renamed = ", ".join(f"--{k} -> {v}" for k, v in own_names.all_names().items() if k != v)
    switched = ", ".join(f"--{k} -> {v[0]}={v[1]}" for k, v in own_names.switches.items())
    return (f"Every key is also a flag (--key VALUE, a switch bare or with true/false). OpenRLHF's and TRL's names: "
            f"{renamed}{'; ' + switched if switched else ''}; --train_batch_size N sets gradient_accumulation_steps "
            "= N / (batch_size × ranks); --lora_rank N switches LoRA on (N > 0) or off (0). A line in OpenRLHF's "
            "or TRL's spelling takes their script's defaults where it is silent (said at start; dpo: "
            "loss_type=sigmoid). --param_dtype bf16 -> bf16=true, --backend -> strategy, --load_checkpoint -> "
            "resume_from=<output_dir>.checkpoints/step_N (the latest, when there is one).")
