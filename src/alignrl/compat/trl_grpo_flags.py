"""TRL's `trl grpo` flags (its ScriptArguments, ModelConfig and GRPOConfig, with the transformers TrainingArguments
that matter) on `alignrl train grpo`, read into a namespace; `trl_grpo_keys` turns it into alignrl config keys.

    alignrl train grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --output_dir out --num_generations 8 --per_device_train_batch_size 8

A line is in TRL's spelling when it names one of `MARKERS` (flags alignrl's own `train grpo` never takes); such a line
may still end with alignrl `key=value` overrides, applied after the translation. Booleans take TRL's spellings
(`--bf16`, `--bf16 true`, `--bf16=False`); lists take several words (`--reward_funcs a b --reward_weights 1 0.5`).
Every default here is TRL's (GRPOConfig's where it overrides TrainingArguments'). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from alignrl.config import ConfigError
from alignrl.runtime.one_line import OneLineParser

PROG = "alignrl train grpo"
# flags alignrl's own `train grpo` line never takes: one of them makes the line TRL's
MARKERS = ("model_name_or_path", "dataset_name", "reward_funcs", "num_generations", "per_device_train_batch_size",
           "gradient_accumulation_steps", "max_completion_length", "reward_model_name_or_path", "learning_rate",
           "num_train_epochs", "max_steps", "output_dir", "use_peft")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")
LISTS = ("reward_funcs", "lora_target_modules", "report_to")  # several words each
# ModelConfig's, read only with --load_in_4bit
FOUR_BIT = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")


class TrlFlagError(ConfigError):
    """A TRL flag alignrl cannot honour, or one TRL itself refuses: one line saying what to do."""


@dataclass(frozen=True)
class Flag:
    name: str
    kind: type | str  # int, float, str, "bool", "list", "floats", "opt_int", "opt_float", "opt_str"
    default: object


# (name, kind, TRL's default): what the translation reads
TAKEN = [
    # ScriptArguments (trl/scripts/utils.py) and the grpo script's own
    Flag("dataset_name", "opt_str", None), Flag("dataset_config", "opt_str", None),
    Flag("dataset_train_split", str, "train"), Flag("dataset_test_split", str, "test"),
    Flag("reward_funcs", "list", None), Flag("reward_model_name_or_path", "opt_str", None),
    # ModelConfig
    Flag("model_name_or_path", "opt_str", None), Flag("dtype", "opt_str", None), Flag("torch_dtype", "opt_str", None),
    Flag("use_peft", "bool", False), Flag("lora_r", int, 16), Flag("lora_alpha", int, 32),
    Flag("lora_dropout", float, 0.05), Flag("lora_target_modules", "list", None),
    Flag("bnb_4bit_quant_type", str, "nf4"), Flag("use_bnb_nested_quant", "bool", False),
    Flag("bnb_4bit_quant_storage", str, "uint8"),
    # GRPOConfig
    Flag("learning_rate", float, 1e-6), Flag("num_generations", int, 8), Flag("max_prompt_length", int, 512),
    Flag("max_completion_length", int, 256), Flag("temperature", float, 1.0), Flag("top_p", float, 1.0),
    Flag("top_k", int, 0), Flag("min_p", "opt_float", None), Flag("repetition_penalty", float, 1.0),
    Flag("generation_kwargs", "opt_str", None),
    Flag("beta", float, 0.0), Flag("epsilon", float, 0.2),
    Flag("epsilon_high", "opt_float", None), Flag("num_iterations", int, 1),
    Flag("steps_per_generation", "opt_int", None), Flag("generation_batch_size", "opt_int", None),
    Flag("loss_type", str, "dapo"), Flag("scale_rewards", str, "group"),
    Flag("importance_sampling_level", str, "token"), Flag("mask_truncated_completions", "bool", False),
    Flag("reward_weights", "floats", None), Flag("sapo_temperature_neg", float, 1.05),
    Flag("sapo_temperature_pos", float, 1.0), Flag("sync_ref_model", "bool", False),
    Flag("ref_model_mixup_alpha", float, 0.6), Flag("ref_model_sync_steps", int, 512),
    Flag("shuffle_dataset", "bool", True), Flag("chat_template_kwargs", "opt_str", None),
    Flag("gradient_checkpointing", "bool", True), Flag("delta", "opt_float", None),
    Flag("use_bias_correction_kl", "bool", False), Flag("top_entropy_quantile", float, 1.0),
    Flag("multi_objective_aggregation", str, "sum_then_normalize"),
    Flag("off_policy_mask_threshold", "opt_float", None),
    Flag("vespo_k_pos", float, 2.0), Flag("vespo_lambda_pos", float, 3.0), Flag("vespo_k_neg", float, 3.0),
    Flag("vespo_lambda_neg", float, 2.0),
    # TrainingArguments
    Flag("output_dir", str, "trainer_output"), Flag("per_device_train_batch_size", int, 8),
    Flag("per_device_eval_batch_size", int, 8), Flag("gradient_accumulation_steps", int, 1),
    Flag("max_steps", int, -1), Flag("num_train_epochs", float, 3.0), Flag("lr_scheduler_type", str, "linear"),
    Flag("warmup_ratio", float, 0.0), Flag("warmup_steps", int, 0), Flag("weight_decay", float, 0.0),
    Flag("adam_beta1", float, 0.9), Flag("adam_beta2", float, 0.999), Flag("max_grad_norm", float, 1.0),
    Flag("optim", str, "adamw_torch"),
    Flag("seed", int, 42), Flag("save_strategy", str, "steps"), Flag("save_steps", float, 500),
    Flag("save_total_limit", "opt_int", None), Flag("eval_strategy", str, "no"), Flag("eval_steps", "opt_float", None),
    Flag("report_to", "list", None), Flag("resume_from_checkpoint", "opt_str", None),
]
# flags given that change nothing here, by reason (named once at start when given with a value other than TRL's)
NOT_APPLIED = {
    "generation runs on alignrl's own engines: rollout.* keys, services.generate_url for a served one": (
        Flag("use_vllm", "bool", False), Flag("vllm_mode", str, "server"), Flag("vllm_server_host", str, "0.0.0.0"),
        Flag("vllm_server_port", int, 8000), Flag("vllm_server_base_url", "opt_str", None),
        Flag("vllm_server_timeout", float, 240.0), Flag("vllm_group_port", int, 51216),
        Flag("vllm_gpu_memory_utilization", float, 0.3), Flag("vllm_tensor_parallel_size", int, 1),
        Flag("vllm_enable_sleep_mode", "bool", False), Flag("vllm_model_impl", str, "vllm"),
        Flag("vllm_max_model_length", "opt_int", None), Flag("vllm_importance_sampling_correction", "bool", True),
        Flag("vllm_importance_sampling_mode", str, "sequence_mask"),
        Flag("vllm_importance_sampling_cap", float, 3.0), Flag("use_transformers_paged", "bool", False),
        Flag("cache_implementation", "opt_str", None), Flag("ds3_gather_for_generation", "bool", True)),
    "every step is logged to trainer.logger's sinks: console and jsonl, wandb and tensorboard by --report_to": (
        Flag("logging_steps", float, 10), Flag("logging_strategy", str, "steps"), Flag("logging_dir", "opt_str", None),
        Flag("logging_first_step", "bool", False), Flag("run_name", "opt_str", None),
        Flag("log_completions", "bool", False), Flag("num_completions_to_print", "opt_int", None),
        Flag("log_unique_prompts", "bool", False), Flag("disable_tqdm", "bool", False)),
    "mixed precision and kernels: alignrl computes in model.dtype with PyTorch's SDPA attention": (
        Flag("bf16", "bool", True), Flag("fp16", "bool", False), Flag("tf32", "bool", False),
        Flag("attn_implementation", "opt_str", None), Flag("use_liger_kernel", "bool", False),
        Flag("cast_lm_head_to_fp32", "bool", False), Flag("torch_compile", "bool", False),
        Flag("gradient_checkpointing_use_reentrant", "bool", False),
        Flag("adam_epsilon", float, 1e-8), Flag("model_revision", str, "main"),
        Flag("trust_remote_code", "bool", False), Flag("disable_dropout", "bool", False)),
    "every column reaches the reward functions, and the data loads in this process": (
        Flag("remove_unused_columns", "bool", False), Flag("dataloader_num_workers", int, 0),
        Flag("dataloader_drop_last", "bool", False), Flag("ddp_timeout", int, 1800),
        Flag("ignore_bias_buffers", "bool", False), Flag("num_generations_eval", "opt_int", None),
        Flag("do_eval", "bool", False), Flag("do_train", "bool", False), Flag("overwrite_output_dir", "bool", False)),
}
# flags alignrl cannot honour when given other than TRL's default: (flag, default, what to do instead)
REFUSED = {
    "max_tool_calling_iterations": ("opt_int", None, "tools run under rollout.multi_turn settings "
                                                     "(docs/algorithms.md)"),
    "load_in_8bit": ("bool", False, "alignrl quantizes to 4-bit only: --load_in_4bit with --use_peft (QLoRA), or "
                                    "drop the flag to load the model unquantized"),
    "dataset_streaming": ("bool", False, "the dataset is read whole; drop the flag"),
    "push_to_hub": ("bool", False, "upload the run's final model folder with `huggingface-cli upload`"),
    # a TRL YAML has been read into flags before (`trl_config_file`): what is left is a file of other settings
    "config": ("opt_str", None, "the file holds none of TRL's settings (a TRL YAML is a mapping of its flag names); "
                                "an alignrl YAML goes on alignrl's own line, without TRL's flags"),
    "datasets": ("opt_str", None, "give one dataset with --dataset_name (data.train_files takes a list: "
                                  "data.train_files=[a.jsonl,b.jsonl])"),
}


def _bool(text: str) -> bool:
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _add(p: argparse.ArgumentParser, flag: Flag) -> None:
    kind, name = flag.kind, f"--{flag.name}"
    if kind == "bool":
        p.add_argument(name, type=_bool, nargs="?", const=True, default=flag.default)
    elif kind == "list":
        p.add_argument(name, nargs="+", default=flag.default)
    elif kind == "floats":
        p.add_argument(name, type=float, nargs="+", default=flag.default)
    else:
        p.add_argument(name, type={"opt_int": int, "opt_float": float, "opt_str": str}.get(kind, kind),
                       default=flag.default)


def parser(taken: list[Flag] | None = None, not_applied: dict | None = None, refused: dict | None = None,
           prog: str = PROG, description: str = "GRPO with TRL's `trl grpo` flags") -> argparse.ArgumentParser:
    """The parser of GRPO's flags, or (another TRL trainer's command) of the flags given."""
    p = OneLineParser(prog=prog, description=description)
    not_applied = NOT_APPLIED if not_applied is None else not_applied
    for flag in (TAKEN if taken is None else taken) + [f for group in not_applied.values() for f in group]:
        _add(p, flag)
    for name, (kind, default, _) in (REFUSED if refused is None else refused).items():
        _add(p, Flag(name, kind, default))
    return p


def is_trl_line(argv: list[str]) -> bool:
    """Whether a `train grpo` line (the words after it) is in TRL's spelling."""
    return any(w.startswith("--") and w[2:].split("=", 1)[0] in MARKERS for w in argv)


def _switch(argv: list[str], i: int) -> tuple[bool, int]:
    """(the value of the boolean flag at argv[i]: `--f`, `--f true`, `--f=false`, the index after it)."""
    word = argv[i]
    if "=" in word:
        name, value = word.split("=", 1)
        if value.lower() not in TRUE_WORDS + FALSE_WORDS:
            raise TrlFlagError(f"{name}={value}: give true or false")
        return _bool(value), i + 1
    if i + 1 < len(argv) and argv[i + 1].lower() in TRUE_WORDS + FALSE_WORDS:
        return _bool(argv[i + 1]), i + 2
    return True, i + 1


def _quantized(on: bool, peft: bool) -> list[str]:
    """The keys of TRL's --load_in_4bit: QLoRA, a 4-bit base under the --use_peft adapters; the saved model is the
    adapter folder, as TRL's save_model of a PEFT model writes it (a merge into 4-bit codes would not be a model)."""
    if not on:
        return []
    if not peft:
        raise TrlFlagError("--load_in_4bit quantizes the frozen base under LoRA adapters (QLoRA), and trains nothing "
                           "without them: add --use_peft (with --lora_r, --lora_alpha), or drop --load_in_4bit")
    return ["model.load_in_4bit=true", "model.lora_export=adapter"]


def split_line(argv: list[str]) -> tuple[list[str], list[str], int | None]:
    """(TRL's flags, alignrl's key=value overrides, --nproc) of a TRL-spelled line; a word that is neither a flag nor
    an override is one line. Overrides follow the flag values they cannot be: `key.sub=value`. --load_in_4bit
    becomes its keys here (`_quantized`), ahead of the line's own overrides, which may still change them."""
    flags, overrides, nproc, i = [], [], None, 0
    four_bit = peft = False
    while i < len(argv):
        word = argv[i]
        if word.split("=", 1)[0] in ("--load_in_4bit", "--use_peft"):
            value, i = _switch(argv, i)
            four_bit = value if word.startswith("--load_in_4bit") else four_bit
            peft = value if word.startswith("--use_peft") else peft
            if word.startswith("--use_peft"):
                flags.append(f"--use_peft={'true' if value else 'false'}")
            continue
        if word in ("--nproc",) or word.startswith("--nproc="):
            value, i = (word.split("=", 1)[1], i + 1) if "=" in word else (argv[i + 1] if i + 1 < len(argv) else "",
                                                                             i + 2)
            if not value.isdigit() or int(value) < 1:
                raise TrlFlagError(f"--nproc {value!r}: give the number of processes, e.g. --nproc 2")
            nproc = int(value)
            continue
        if not word.startswith("-") and "=" in word and "." in word.split("=", 1)[0]:
            overrides.append(word)
        else:
            flags.append(word)
        i += 1
    return flags, _quantized(four_bit, peft) + overrides, nproc


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def parse(argv: list[str], p: argparse.ArgumentParser | None = None, refused: dict | None = None,
          what: str = "GRPO"):
    """TRL's flags as a namespace, with `given`: the names the line set (by `p` and its `refused`, GRPO's unless
    given; `what` names the trainer in the unknown flags' line)."""
    p, refused = p or parser(), REFUSED if refused is None else refused
    args, rest = p.parse_known_args(argv)
    if rest:
        # a negative number is an unknown flag's value, not a flag of its own
        words = [w.split("=", 1)[0] for w in rest if w.startswith("-") and not _is_number(w)] or rest[:1]
        raise TrlFlagError(f"{', '.join(map(repr, words))} {'is' if len(words) == 1 else 'are'} not one of TRL's "
                           f"{what} flags alignrl reads (docs/trl.md lists them; alignrl's own settings go after "
                           "them as key.sub=value)")
    names = {a.dest for a in p._actions}
    args.given = {w[2:].split("=", 1)[0] for w in argv if w.startswith("--") and w[2:].split("=", 1)[0] in names}
    for name, (_, default, fix) in refused.items():
        if getattr(args, name) != default:
            raise TrlFlagError(f"--{name} is not supported here: {fix}")
    return args


def unused(args, not_applied: dict | None = None) -> list[str]:
    """The flags given that change nothing here, each group with its reason."""
    out = []
    for why, group in (NOT_APPLIED if not_applied is None else not_applied).items():
        given = [f"--{f.name}" for f in group if f.name in args.given]
        if given:
            out.append(f"{' '.join(given)} ({why})")
    return out


def unused_lines(args, not_applied: dict | None = None) -> list[str]:
    """The start line naming the flags given that change nothing here (`unused`, and transformers' other
    --report_to integrations), or none. With --eval_strategy steps and no --eval_steps, --logging_steps sets the
    evaluations' cadence, so it is not among them."""
    if args.eval_strategy == "steps" and not args.eval_steps:
        args.given = args.given - {"logging_steps"}
    out = unused(args, not_applied)
    others = [s for s in args.report_to or [] if s not in ("wandb", "tensorboard", "none", "all")]
    if others:
        out.append(f"--report_to {' '.join(others)} (alignrl logs to console, jsonl, wandb and tensorboard)")
    return ["given, changing nothing here: " + "; ".join(out)] if out else []

