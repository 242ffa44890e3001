"""`alignrl train online-dpo` (also `online_dpo`): TRL's online DPO command line (examples/scripts/dpo_online.py: its
ScriptArguments, ModelConfig and OnlineDPOConfig flags) as alignrl config keys, run as `alignrl train grpo` runs.

    alignrl train online-dpo --model_name_or_path trl-lib/pythia-1b-deduped-tldr-sft \\
        --reward_model_path trl-lib/pythia-1b-deduped-tldr-rm --dataset_name trl-lib/tldr --learning_rate 5.0e-7 \\
        --output_dir pythia-1b-tldr-online-dpo --per_device_train_batch_size 8 --gradient_accumulation_steps 16 \\
        --warmup_ratio 0.1 --missing_eos_penalty 1.0

The recipe is algorithm.adv_estimator=online_dpo (docs/algorithms.md): each prompt's two answers are a DPO pair, the
higher reward chosen, with no KL loss beside the DPO loss's own pull (--beta) and one optimizer step per batch. TRL
counts prompts: an optimizer step takes per_device_train_batch_size x ranks x gradient_accumulation_steps of them,
two answers each; that is one alignrl RL step (data.train_batch_size, its whole batch one mini-batch). An epoch
trains whole batches only, where TRL's last one holds the prompts left: the start says how many are left out. The flags
shared with `trl grpo` (data, model and LoRA, optimizer, schedule, checkpoints, logging, `--config` YAML) are read
and translated by the same code (`trl_grpo_flags`, `trl_grpo_keys`). Every default here is OnlineDPOConfig's.

`alignrl train xpo` is TRL's XPO (examples/scripts/xpo.py): the same flags and --alpha (XPOConfig's 1e-5), run as
algorithm.adv_estimator=xpo: each pair the policy's answer and the reference model's, with XPO's exploration term.
`alignrl train nash-md` is TRL's Nash-MD (examples/scripts/nash_md.py): the same flags and --mixture_coef
(NashMDConfig's 0.5), run as algorithm.adv_estimator=nash_md: each pair the policy's answer and one of the geometric
mixture of policy and reference.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass

from alignrl.compat import trl_grpo_flags as F
from alignrl.compat import trl_grpo_keys as K
from alignrl.compat.trl_generation_kwargs import generation_keys
from alignrl.compat.trl_grpo_flags import Flag, TrlFlagError

PROG = "alignrl train online-dpo"
WHAT = "online DPO"
# ScriptArguments, ModelConfig, TrainingArguments and the generation flags OnlineDPOConfig shares with GRPOConfig,
# with the same defaults (TRL's base config: logging_steps 10, gradient_checkpointing True, bf16)
SHARED = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "model_name_or_path",
          "dtype", "torch_dtype", "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
          "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
          "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "gradient_checkpointing",
          "reward_weights", "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
          "gradient_accumulation_steps", "max_steps", "num_train_epochs", "lr_scheduler_type", "warmup_ratio",
          "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "optim", "seed",
          "save_strategy", "save_steps", "save_total_limit", "eval_strategy", "eval_steps", "report_to",
          "resume_from_checkpoint")
# OnlineDPOConfig's own (trl/experimental/online_dpo/online_dpo_config.py)
OWN = [Flag("learning_rate", float, 5e-7), Flag("reward_model_path", "opt_str", None),
       Flag("max_new_tokens", int, 64), Flag("max_length", int, 512), Flag("temperature", float, 0.9),
       Flag("missing_eos_penalty", "opt_float", None), Flag("beta", "floats", [0.1]),
       Flag("loss_type", str, "sigmoid")]
TAKEN = [f for f in F.TAKEN if f.name in SHARED] + OWN



@dataclass(frozen=True)
class Variant:
    """A trainer of TRL's that is OnlineDPOConfig and one flag of its own (a list: a per-epoch schedule in TRL)."""
    command: str
    name: str  # as the errors name it
    estimator: str  # algorithm.adv_estimator
    flag: Flag
    key: str  # the alignrl key the flag's one value sets
    what: str  # the parser's description


VARIANTS = {
    "xpo": Variant("alignrl train xpo", "XPO", "xpo", Flag("alpha", "floats", [1e-5]), "algorithm.xpo_alpha",
                   "XPO with TRL's xpo.py flags: each prompt's answer from the policy and one from the reference model "
                   "a DPO pair, the higher reward chosen, plus alpha times the policy's log-prob of the reference's "
                   "answer (alignrl's RL loop, algorithm.adv_estimator=xpo)"),
    "nash_md": Variant("alignrl train nash-md", "Nash-MD", "nash_md", Flag("mixture_coef", "floats", [0.5]),
                       "algorithm.mixture_coef", "Nash-MD with TRL's nash_md.py flags: each prompt's answer from the "
                       "policy against one from the geometric mixture of policy and reference, by the probability "
                       "its reward is the higher (alignrl's RL loop, algorithm.adv_estimator=nash_md)"),
}
# GRPOConfig's flags OnlineDPOConfig has not: unknown here
GRPO_ONLY = {"vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
             "log_completions", "num_completions_to_print", "log_unique_prompts", "num_generations_eval",
             "cast_lm_head_to_fp32", "disable_dropout"}
NOT_APPLIED = {why: tuple(f for f in group if f.name not in GRPO_ONLY) for why, group in F.NOT_APPLIED.items()}
NOT_APPLIED["generation runs on alignrl's own engines: rollout.* keys, services.generate_url for a served one"] += (
    Flag("vllm_structured_outputs_regex", "opt_str", None),)
NOT_APPLIED["the policy keeps its config's dropout (none in most causal language models), and the model and data "
            "load in this process"] = (Flag("disable_dropout", "bool", True), Flag("dataset_num_proc", "opt_int", None),
                                       Flag("model_init_kwargs", "opt_str", None))
REFUSED = {name: rule for name, rule in F.REFUSED.items() if name != "max_tool_calling_iterations"}
REFUSED["judge"] = ("opt_str", None, "alignrl scores each answer on its own; give a reward model with "
                                     "--reward_model_path, or a reward function as algorithm.reward_fn=... after "
                                     "the flags (docs/trl.md)")
# alignrl's own keys that give the loop its reward instead of --reward_model_path
REWARD_KEYS = ("algorithm.reward_fn=", "algorithm.reward_model=", "services.reward_url=")
RECIPE = ["rollout.n=2", "actor.use_kl_loss=false", "actor.ppo_epochs=1",
          "actor.recompute_old_logprobs=true", "algorithm.use_kl_in_reward=false", "actor.entropy_coeff=0.0"]
NOT_TAKEN_DEFAULTS = {**K.NOT_TAKEN_DEFAULTS,
                      "disable_dropout": "True (the policy keeps its config's dropout, none in most causal LMs)"}


def parser(variant: Variant | None = None):
    if variant is not None:
        return F.parser(TAKEN + [variant.flag], NOT_APPLIED, REFUSED, variant.command, variant.what)
    return F.parser(TAKEN, NOT_APPLIED, REFUSED, PROG, "online DPO with TRL's dpo_online.py flags: each prompt's two "
                    "answers a DPO pair, the higher reward chosen (alignrl's RL loop, algorithm.adv_estimator="
                    "online_dpo)")


class PairBatches:
    """TRL's batch numbers (prompts, two answers each) and alignrl's: one optimizer step is one RL step."""

    steps_per_round = 1

    def __init__(self, args, world: int):
        self.pd, self.ga, self.world = args.per_device_train_batch_size, args.gradient_accumulation_steps, world
        if self.pd < 1 or self.ga < 1:
            raise TrlFlagError("--per_device_train_batch_size and --gradient_accumulation_steps must be at least 1")
        self.prompts = self.pd * world * self.ga

    def keys(self) -> list[str]:
        # the whole batch one mini-batch: TRL's one optimizer step; a micro-batch holds a rank's pairs, both answers
        return [f"data.train_batch_size={self.prompts}", f"actor.ppo_mini_batch_size={self.prompts}",
                "actor.ppo_mini_batch_unit=prompts", f"actor.ppo_micro_batch_size={2 * self.pd}"]

    def rl_steps(self, optimizer_steps: float) -> int:
        return max(1, math.ceil(optimizer_steps))

    def line(self) -> str:
        return (f"TRL's batches: per_device_train_batch_size {self.pd} prompts x {self.world} rank(s) x "
                f"gradient_accumulation_steps {self.ga} = {self.prompts} prompts per optimizer step, two answers "
                f"each: one alignrl RL step of data.train_batch_size={self.prompts}, rollout.n=2, one optimizer step "
                f"(actor.ppo_mini_batch_size={self.prompts}), actor.ppo_micro_batch_size={2 * self.pd} sequences "
                "per rank")


def check(args, own: list[str]) -> None:
    """OnlineDPOConfig's values alignrl cannot take, or TRL itself refuses, one line each."""
    if len(args.beta) > 1:
        raise TrlFlagError(f"--beta {' '.join(map(str, args.beta))}: TRL's per-epoch schedule of beta is not "
                           "available here; give one value (--beta 0.1), or one run per beta")
    if args.loss_type not in ("sigmoid", "ipo"):
        raise TrlFlagError(f"--loss_type {args.loss_type}: TRL's online DPO takes sigmoid or ipo")
    if args.missing_eos_penalty is not None and args.missing_eos_penalty < 0:
        raise TrlFlagError(f"--missing_eos_penalty {args.missing_eos_penalty}: give a positive value (it is "
                           "subtracted from the reward of an answer cut before it ended, as TRL's)")
    if args.max_new_tokens >= args.max_length:
        raise TrlFlagError(f"--max_new_tokens {args.max_new_tokens} is not below --max_length {args.max_length}: "
                           "no prompt token would be left; raise --max_length (TRL advises max_new_tokens + 512)")
    if args.reward_weights and not args.reward_model_path:
        raise TrlFlagError("--reward_weights weighs --reward_model_path's score; give it, or weigh an alignrl reward "
                           "function in algorithm.reward_fn (trl:NAME@WEIGHT)")
    if not args.reward_model_path and not any(w.startswith(REWARD_KEYS) for w in own):
        raise TrlFlagError("give --reward_model_path (a reward-model folder or Hub id), or a reward function as "
                           "algorithm.reward_fn=... after the flags (trl:accuracy_reward for TRL's, docs/trl.md)")


def _as_grpo(args) -> None:
    """The names the shared translation reads, from online DPO's flags: its prompt cap is what --max_length leaves
    of the answer's tokens, its reward model --reward_model_path (no reward functions: those are trainer
    arguments in TRL, here algorithm.reward_fn)."""
    vars(args).update(max_prompt_length=args.max_length - args.max_new_tokens, shuffle_dataset=True,
                      chat_template_kwargs=None, reward_model_name_or_path=args.reward_model_path, reward_funcs=None,
                      multi_objective_aggregation="sum_then_normalize", max_completion_length=args.max_new_tokens)


def defaults_line(args, taken_flags: list[Flag] = TAKEN) -> str:
    """OnlineDPOConfig's defaults a line leaves out, those taken and those not."""
    quiet = {"dataset_train_split", "dataset_test_split", "per_device_eval_batch_size", "use_peft", "max_steps"}
    quiet |= {"num_train_epochs"} if args.max_steps > 0 else set()
    quiet |= {"save_steps"} if args.save_strategy != "steps" else set()
    quiet |= set() if args.use_peft else {"lora_r", "lora_alpha", "lora_dropout", *F.FOUR_BIT}
    shown = {"beta": "0.1", "missing_eos_penalty": "None (no penalty)"}
    taken = [f"{f.name} {shown.get(f.name, f.default)}" for f in taken_flags if f.name not in args.given
             and f.name not in quiet and (f.default is not None or f.name in shown)]
    not_taken = [f"{name} {why}" for name, why in NOT_TAKEN_DEFAULTS.items() if name not in args.given]
    return f"TRL's defaults taken: {', '.join(taken)}" + (f"; not taken: {', '.join(not_taken)}" if not_taken else "")


def translate(args, world: int, own: list[str] = (), estimator: str = "online_dpo", taken_flags: list[Flag] = TAKEN
              ) -> tuple[list[str], list[str]]:
    """(alignrl overrides, start lines) for online DPO's (checked) flags on `world` ranks; `own`: the line's alignrl
    key=value words (a reward function beside --reward_model_path is summed with it, as TRL sums its rewards);
    `estimator`: online_dpo, or another of TRL's trainers on OnlineDPOConfig (`VARIANTS`, its flags `taken_flags`)."""
    _as_grpo(args)
    batches = PairBatches(args, world)
    steps = K.rl_steps(args, batches)
    reward = K.reward_keys(args) if args.reward_model_path else []
    if reward and any(w.startswith("algorithm.reward_fn=") for w in own) and not any(
            w.startswith("algorithm.reward_model_mix=") for w in own):
        reward.append("algorithm.reward_model_mix=sum")  # TRL sums its rewards: the function's beside the model's
    data = [k for k in K.data_keys(args, batches) if not k.startswith("data.filter_overlong_prompts=")]
    overrides = (data + ["data.truncation=left", "data.filter_overlong_prompts=false"] + batches.keys()
                 + [f"algorithm.adv_estimator={estimator}", *RECIPE]
                 + [f"algorithm.dpo_beta={args.beta[0]}", f"algorithm.dpo_loss_type={args.loss_type}",
                    f"algorithm.missing_eos_penalty={args.missing_eos_penalty or 0.0}"]
                 + reward + K.optimiser_keys(args, batches, steps) + K.run_keys(args, batches)
                 + [f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
                    f"rollout.top_p={args.top_p}", f"rollout.top_k={args.top_k if args.top_k > 0 else -1}",
                    f"rollout.min_p={args.min_p or 0.0}", f"rollout.repetition_penalty={args.repetition_penalty}"]
                 + generation_keys(args.generation_kwargs))
    lines = [defaults_line(args, taken_flags), batches.line(),
             f"--max_length {args.max_length}{'' if 'max_length' in args.given else ' (default)'}: prompts keep their "
             f"last {args.max_prompt_length} tokens (max_length - max_new_tokens), for the answers and their "
             "log-probs alike (TRL cuts the prompt's leftmost tokens for the log-probs only)"] + K.split_lines(args) \
        + K.string_prompt_lines(args)
    if args.eval_strategy == "epoch":
        lines.append("--eval_strategy epoch: alignrl measures the held-out split before and after training "
                     "(trainer.test_freq=0), not after each epoch")
    return overrides, lines


def epoch_counts(args, overrides: list[str], own: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, lines) from the training rows, counted as the loop counts them once the config loads. An
    epoch-counted --warmup_ratio becomes whole warm-up steps rounded up as transformers rounds them (the config's
    ratio rounds down); and a line says how many prompts of each epoch are not trained: the loop draws whole batches
    only, where TRL's last batch of an epoch holds the prompts left (dataloader_drop_last false)."""
    from alignrl.config import load_config
    from alignrl.config.counts import train_rows  # the rows the loop reads

    cfg = load_config(None, [w for w in [*overrides, *own] if "=" in w])
    rows, batch, steps = train_rows(cfg), cfg.data.draw_size, cfg.trainer.total_training_steps
    if rows is None or rows < batch:  # a missing file, or too few rows for one batch: the preflight says which
        return overrides, []
    if (args.warmup_ratio and not args.warmup_steps and args.max_steps <= 0
            and not any(w.startswith("actor.lr_warmup_steps") for w in own)):  # alignrl's own warm-up key wins
        optimizer_steps = steps * cfg.actor.ppo_epochs * cfg.mini_batches_per_step
        overrides = [w for w in overrides if not w.startswith("actor.lr_warmup_steps_ratio=")]
        overrides.append(f"actor.lr_warmup_steps={math.ceil(args.warmup_ratio * optimizer_steps)}")
    left, per_epoch = rows % batch, rows // batch
    if not left or (args.max_steps > 0 and steps <= per_epoch):  # every epoch whole, or the run ends within the first
        return overrides, []
    which = "a different draw each epoch, the order shuffled" if cfg.data.shuffle else "the data's last rows"
    return overrides, [f"{left} of the {rows} training prompts are not trained each epoch ({which}): the loop draws "
                       f"whole batches of {batch} prompts, {per_epoch} an epoch, where TRL trains the {left} left as "
                       "a smaller last batch; per_device_train_batch_size x ranks x gradient_accumulation_steps "
                       f"dividing {rows} trains them all"]


def from_line(words: list[str], variant: str = "") -> tuple[list[str], list[str]]:
    """An online DPO line (the words after the command; `variant`: a line of one of `VARIANTS`, XPO or Nash-MD) as
    alignrl's words for `train grpo` (overrides, the line's own key=value overrides after them, --nproc), with the
    start lines saying how."""
    v = VARIANTS[variant] if variant else None
    flags, own, nproc = F.split_line(words)
    args = F.parse(flags, parser(v), REFUSED, v.name if v else WHAT)
    check(args, own)
    world = nproc or int(os.environ.get("WORLD_SIZE", "1"))
    if v is not None:
        values = getattr(args, v.flag.name)
        if len(values) > 1:
            raise TrlFlagError(f"--{v.flag.name} {' '.join(map(str, values))}: TRL's per-epoch schedule of "
                               f"{v.flag.name} is not available here; give one value (--{v.flag.name} "
                               f"{v.flag.default[0]}), or one run per value")
        if v.estimator == "nash_md" and args.loss_type != "sigmoid":
            raise TrlFlagError(f"--loss_type {args.loss_type}: Nash-MD's loss has no DPO loss type (TRL's reads none)")
        overrides, lines = translate(args, world, own, v.estimator, TAKEN + [v.flag])
        overrides.append(f"{v.key}={values[0]}")
    else:
        overrides, lines = translate(args, world, own)
    overrides, epoch_lines = epoch_counts(args, overrides, own)
    lines += epoch_lines
    lines += F.unused_lines(args, NOT_APPLIED)
    return overrides + own + (["--nproc", str(nproc)] if nproc else []), lines


def main(argv: list[str] | None = None) -> int:
    from alignrl.compat.trl_config_file import run_command

    return run_command(list(sys.argv[1:] if argv is None else argv), parser(), from_line, WHAT)


def variant_main(variant: str, argv: list[str] | None = None) -> int:
    """`alignrl train xpo` / `nash-md`: TRL's XPO or Nash-MD command line (examples/scripts/xpo.py, nash_md.py),
    online DPO's flags and the trainer's own."""
    from alignrl.compat.trl_config_file import run_command

    v = VARIANTS[variant]
    return run_command(list(sys.argv[1:] if argv is None else argv), parser(v),
                       functools.partial(from_line, variant=variant), v.name)


xpo_main = functools.partial(variant_main, "xpo")
nash_md_main = functools.partial(variant_main, "nash_md")


if __name__ == "__main__":
    sys.exit(main())
