"""TRL's GRPO flags (`trl_grpo_flags`) as alignrl config keys, with the start lines that say how.

Batches. TRL counts completions: an optimizer step takes per_device_train_batch_size x ranks x
gradient_accumulation_steps of them; a generation round makes per_device_train_batch_size x ranks x
steps_per_generation (steps_per_generation defaults to gradient_accumulation_steps; generation_batch_size sets the
round's size instead), num_generations per prompt, and trains on it num_iterations times. alignrl counts one
generation round as one RL step: data.train_batch_size = the round's completions / num_generations prompts,
rollout.n = num_generations, actor.ppo_epochs = num_iterations, the mini-batch = one TRL optimizer step (in prompts
when it holds whole groups its ranks can share, else in sequences) and actor.ppo_micro_batch_size =
per_device_train_batch_size. TRL's --max_steps (optimizer steps) becomes RL steps: max_steps / (the optimizer steps
of one round), rounded up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from alignrl.compat import trl_grpo_flags as F
from alignrl.compat.trl_grpo_flags import FOUR_BIT, TAKEN, TrlFlagError
from alignrl.compat.trl_generation_kwargs import generation_keys
from alignrl.compat.trl_grpo_loss import loss_keys, ref_sync_keys
from alignrl.config.model_schema import STORAGE_DTYPES
from alignrl.data.sources import is_library_dataset, with_config, with_split
from alignrl.rewards.trl_reward import BUILT_IN, spec_of

SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
OVERLONG = "get_soft_overlong_punishment"  # TRL's script builds it with these two numbers
OVERLONG_MAX, OVERLONG_CACHE = 1280, 256
# TRL's defaults a line may leave out, said when taken (name, how it reads in the line)
NOT_TAKEN_DEFAULTS = {"logging_steps": "10 (every step is logged)",
                      "bf16": "True (the model computes in model.dtype, float32 unless set)"}


class Batches:
    """TRL's batch numbers and alignrl's, from the flags and the ranks."""

    def __init__(self, args, world: int):
        pd, ga, ng = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations
        for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "steps_per_generation", "generation_batch_size"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise TrlFlagError(f"--{flag} {getattr(args, flag)}: give 1 or more")
        if args.steps_per_generation is not None and args.generation_batch_size is not None:
            raise TrlFlagError("--steps_per_generation and --generation_batch_size cannot both be given (TRL's rule)")
        if args.generation_batch_size is not None:
            if args.generation_batch_size % (pd * world):
                raise TrlFlagError(f"--generation_batch_size {args.generation_batch_size} must be a multiple of "
                                   f"per_device_train_batch_size {pd} x {world} rank(s) (TRL's rule)")
            spg = args.generation_batch_size // (pd * world)
        else:
            spg = args.steps_per_generation or ga
        if spg > ga and spg % ga:  # TRL's optimizer step would then straddle two rounds
            raise TrlFlagError(f"steps_per_generation {spg} above gradient_accumulation_steps {ga} must be a multiple "
                               "of it (alignrl's optimizer steps never straddle two generation rounds)")
        if spg < ga:  # rounds generated between two optimizer steps share the weights: together they are one round
            if args.num_iterations > 1:
                raise TrlFlagError(f"--num_iterations {args.num_iterations} with steps_per_generation {spg} below "
                                   f"gradient_accumulation_steps {ga}: alignrl cannot reuse part of an optimizer "
                                   "step's rounds; give --steps_per_generation at least gradient_accumulation_steps")
            if ga % spg:
                raise TrlFlagError(f"steps_per_generation {spg} below gradient_accumulation_steps {ga} must divide "
                                   "it (alignrl generates whole optimizer steps)")
            spg = ga
        self.pd, self.ga, self.ng, self.world, self.spg, self.mu = pd, ga, ng, world, spg, args.num_iterations
        self.per_round, self.per_step = pd * world * spg, pd * world * ga  # completions
        if ng < 2:
            raise TrlFlagError(f"--num_generations {ng}: GRPO needs at least 2 completions per prompt (TRL's rule)")
        if self.per_round % ng:
            raise TrlFlagError(f"the {self.per_round} completions of a generation round (per_device_train_batch_size "
                               f"{pd} x {world} rank(s) x steps_per_generation {spg}) must be a multiple of "
                               f"--num_generations {ng} (TRL's rule)")
        self.prompts = self.per_round // ng
        if self.prompts % world:
            raise TrlFlagError(f"{self.prompts} prompt(s) per generation round cannot be shared by {world} ranks: "
                               "alignrl gives each rank whole prompt groups; raise --per_device_train_batch_size or "
                               "--gradient_accumulation_steps, or lower --num_generations")
        # optimizer steps per generation round: its micro-batches of each pass, grouped by gradient accumulation
        self.steps_per_round = max(1, math.ceil(spg / ga)) * self.mu

    def keys(self) -> list[str]:
        # in prompts when a TRL optimizer step holds whole groups that its ranks can share, else in sequences
        whole = self.per_step % self.ng == 0 and (self.per_step // self.ng) % self.world == 0
        return [f"data.train_batch_size={self.prompts}", f"rollout.n={self.ng}",
                f"actor.ppo_mini_batch_size={self.per_step // self.ng if whole else self.per_step}",
                f"actor.ppo_mini_batch_unit={'prompts' if whole else 'sequences'}",
                f"actor.ppo_micro_batch_size={self.pd}", f"actor.ppo_epochs={self.mu}"]

    def rl_steps(self, optimizer_steps: float) -> int:
        return max(1, math.ceil(optimizer_steps / self.steps_per_round))

    def line(self) -> str:
        return (f"TRL's batches: per_device_train_batch_size {self.pd} x {self.world} rank(s) x "
                f"gradient_accumulation_steps {self.ga} = {self.per_step} completions per optimizer step; a generation "
                f"round of {self.per_round} completions (steps_per_generation {self.spg}) = {self.prompts} prompt(s) x "
                f"num_generations {self.ng}, trained num_iterations {self.mu} time(s): one alignrl RL step of "
                f"data.train_batch_size={self.prompts}, rollout.n={self.ng}, {self.steps_per_round} optimizer "
                f"step(s) of {self.per_step} sequences, actor.ppo_micro_batch_size={self.pd} per rank")


# transformers' names of the AdamW it runs (fused or not, its own older copy): the optimizer here
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")


def is_model(name: str) -> bool:
    """A --reward_funcs word naming a reward model (a folder, or a Hub id `owner/name`) rather than a function (a
    built-in, file.py:function or package.module.function)."""
    if name in BUILT_IN or ".py:" in name:
        return False
    return Path(name).is_dir() or ("/" in name and ":" not in name)


def reward_keys(args) -> list[str]:
    """--reward_model_name_or_path and --reward_funcs (weighted by --reward_weights, in TRL's order: the model
    first) as algorithm.reward_model, algorithm.reward_fn and DAPO's overlong keys."""
    names = ([args.reward_model_name_or_path] if args.reward_model_name_or_path else []) + list(args.reward_funcs or [])
    if not names:
        raise TrlFlagError("give --reward_funcs (accuracy_reward, think_format_reward, reasoning_accuracy_reward, "
                           "path/to/file.py:function, package.module.function) or --reward_model_name_or_path")
    weights = list(args.reward_weights) if args.reward_weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise TrlFlagError(f"--reward_weights gives {len(weights)} weight(s) for {len(names)} reward function(s) "
                           "(TRL's rule: one each, the reward model first)")
    out, fns, model = [], [], None
    for i, (name, weight) in enumerate(zip(names, weights)):
        if name == OVERLONG:
            out += overlong_keys(args.max_completion_length, weight)
        elif not (i == 0 and args.reward_model_name_or_path) and not is_model(name):
            fns.append((name, weight))
        else:  # a reward model: a folder or a Hub id, as TRL's GRPOTrainer loads one
            if model is not None:
                raise TrlFlagError(f"two reward models ({model}, {name}): alignrl scores with one")
            model = name
            if weight != 1.0:
                out.append(f"algorithm.reward_model_weight={weight}")
    if not model and not fns:  # alignrl's own rule would score the rows beside the punishment: not TRL's reward
        raise TrlFlagError(f"{OVERLONG} alone: alignrl adds it to a reward; give a reward function or model beside it")
    if model:  # beside functions, TRL sums the weighted scores of all of them on every completion
        out.append(f"algorithm.reward_model={model}")
        if fns and args.multi_objective_aggregation == "normalize_then_sum":
            raise TrlFlagError(f"reward model {model} beside reward functions with --multi_objective_aggregation "
                               "normalize_then_sum: alignrl normalizes the functions' rewards alone; give sum_then_"
                               "normalize, or the model or the functions alone")
        out += ["algorithm.reward_model_mix=sum"] if fns else []
    if fns:
        out.append(f"algorithm.reward_fn={json.dumps(spec_of(fns))}")
    return out


def overlong_keys(max_completion_length: int, weight: float) -> list[str]:
    """TRL's script's get_soft_overlong_punishment(1280, 256), weighted: 0 up to 1024 tokens, then -1/256 a token;
    as alignrl's DAPO penalty below --max_completion_length (at most 1280; beyond it TRL's -1 step has no
    counterpart), its buffer the tokens past 1024 and its factor scaled to keep TRL's slope; none when
    --max_completion_length is 1024 or less (no completion reaches the punishment)."""
    if max_completion_length > OVERLONG_MAX:
        raise TrlFlagError(f"{OVERLONG} with --max_completion_length {max_completion_length}: TRL's script sets it to "
                           f"-1 past {OVERLONG_MAX} tokens, which alignrl's penalty cannot; give at most "
                           f"{OVERLONG_MAX}, or algorithm.overlong_buffer_len=N instead")
    if weight < 0:
        raise TrlFlagError(f"{OVERLONG} weighted {weight}: alignrl's penalty takes a weight of 0 or more")
    buffer = max(0, max_completion_length - (OVERLONG_MAX - OVERLONG_CACHE))
    if not buffer:
        return []
    return [f"algorithm.overlong_buffer_len={buffer}",
            f"algorithm.overlong_penalty_factor={weight * buffer / OVERLONG_CACHE}"]


def _dataset(args, split: str) -> str:
    name = with_config(args.dataset_name, args.dataset_config) if args.dataset_config else args.dataset_name
    return with_split(name, split)


def data_keys(args, batches: Batches) -> list[str]:
    if not args.dataset_name:
        raise TrlFlagError("give --dataset_name: a .jsonl/.json/.parquet file, a dataset folder or a Hub dataset "
                           "whose rows have a `prompt` column")
    train = _dataset(args, args.dataset_train_split)
    evaluates = args.eval_strategy != "no"
    val = _dataset(args, args.dataset_test_split) if evaluates else train
    if args.eval_strategy not in ("no", "steps", "epoch"):
        raise TrlFlagError(f"--eval_strategy {args.eval_strategy}: give no, steps or epoch")
    out = [f"data.train_files={json.dumps(train)}", f"data.val_files={json.dumps(val)}", "data.prompt_key=prompt",
           f"data.max_prompt_length={args.max_prompt_length}", f"data.shuffle={str(args.shuffle_dataset).lower()}",
           "data.filter_overlong_prompts=true"]  # TRL never cuts a prompt: one over alignrl's cap is left out, counted
    if not evaluates:  # TRL evaluates nothing: alignrl's before/after accuracy reads a few training prompts
        out += [f"data.val_size={args.per_device_eval_batch_size}", "trainer.test_freq=0"]
    elif args.eval_strategy == "steps":  # transformers: eval_steps defaults to logging_steps
        every = args.eval_steps if args.eval_steps else args.logging_steps
        out.append(f"trainer.test_freq={batches.rl_steps(optimizer_steps(args, every, 'eval_steps'))}")
    else:  # epoch: before and after training only, said at start
        out.append("trainer.test_freq=0")
    if args.chat_template_kwargs:
        out.append(f"data.chat_template_kwargs={args.chat_template_kwargs}")
    args.string_prompts = string_prompts(args)  # read once: string_prompt_lines says it from here
    if args.string_prompts:  # TRL's maybe_apply_chat_template leaves a string prompt as it is
        out.append("data.apply_chat_template=false")
    return out


def string_prompts(args) -> bool:
    """Whether --dataset_name is a local file whose first row's prompt is a string, which TRL tokenizes as written
    (a dataset folder or a Hub name is not read here: its prompts go through the chat template)."""
    from alignrl.data.images import parse_message_list
    from alignrl.data.loaders import read_rows

    if not Path(args.dataset_name).is_file():
        return False
    rows = read_rows(args.dataset_name, "--dataset_name", limit=1)
    # a JSON string of chat messages (LMM-R1's rows) is read as the messages, as the loader reads it
    return bool(rows) and isinstance(parse_message_list(rows[0][1].get("prompt")), str)


def string_prompt_lines(args) -> list[str]:
    """The start line saying string prompts are read as written, when they are (`data_keys` read the file)."""
    if not args.string_prompts:
        return []
    return [f"{args.dataset_name}: its prompts are strings, read as written without the chat template, as TRL reads "
            "them (data.apply_chat_template=false; a row of chat messages is templated)"]


def optimizer_steps(args, value: float, flag: str) -> int:
    """--eval_steps/--save_steps/--logging_steps as optimizer steps: a value below 1 is that share of the run's
    optimizer steps, rounded up (transformers' rule), which only --max_steps gives before the data loads."""
    if value < 1:
        if args.max_steps <= 0:
            raise TrlFlagError(f"--{flag} {value}: a share of the run's steps needs --max_steps here; give --{flag} "
                               "as a whole number of optimizer steps")
        return max(1, math.ceil(value * args.max_steps))
    if not float(value).is_integer():
        raise TrlFlagError(f"--{flag} {value}: give a whole number of optimizer steps, or a share below 1")
    return int(value)


def optimiser_keys(args, batches: Batches, total_optimizer_steps: int | None) -> list[str]:
    if args.optim not in ADAMW_NAMES:
        raise TrlFlagError(f"--optim {args.optim}: the optimizer here is torch's AdamW; give --optim adamw_torch "
                           "(or leave the flag out)")
    schedule = SCHEDULES.get(args.lr_scheduler_type)
    if schedule is None:
        raise TrlFlagError(f"--lr_scheduler_type {args.lr_scheduler_type}: alignrl has {', '.join(SCHEDULES)}")
    out = [f"actor.lr={args.learning_rate}", f"actor.lr_scheduler={schedule}", "actor.min_lr_ratio=0.0",
           f"actor.weight_decay={args.weight_decay}", f"actor.betas=[{args.adam_beta1},{args.adam_beta2}]",
           f"actor.grad_clip={args.max_grad_norm}",
           f"actor.gradient_checkpointing={str(args.gradient_checkpointing).lower()}"]
    if args.warmup_steps:
        out.append(f"actor.lr_warmup_steps={args.warmup_steps}")
    elif args.warmup_ratio and total_optimizer_steps:  # transformers: ceil(ratio x the run's optimizer steps)
        out.append(f"actor.lr_warmup_steps={math.ceil(args.warmup_ratio * total_optimizer_steps)}")
    elif args.warmup_ratio:  # steps counted from the data's rows once loaded: the ratio of the RL steps
        out.append(f"actor.lr_warmup_steps_ratio={args.warmup_ratio}")
    return out


def rl_steps(args, batches: Batches) -> int | None:
    """The run's RL steps from --max_steps (optimizer steps); None: --num_train_epochs, which alignrl counts from the
    data's rows when the config loads (trainer.total_epochs; the last partial round dropped, as TRL's sampler does)."""
    if args.max_steps > 0:
        return batches.rl_steps(args.max_steps)
    if not float(args.num_train_epochs).is_integer() or args.num_train_epochs < 1:
        raise TrlFlagError(f"--num_train_epochs {args.num_train_epochs}: alignrl runs whole epochs; give a whole "
                           "number or --max_steps")
    return None


def run_keys(args, batches: Batches) -> list[str]:
    """Steps, checkpoints, output folder, seed, logging, model and LoRA."""
    out_dir = Path(args.output_dir).absolute()
    out = [f"trainer.output_dir={out_dir.parent}", f"trainer.experiment_name={out_dir.name}",
           f"trainer.seed={args.seed}", "trainer.progress_bar=false",
           f"trainer.resume_mode={'auto' if args.resume_from_checkpoint else 'disable'}"]
    steps = rl_steps(args, batches)
    out.append(f"trainer.total_training_steps={steps}" if steps else
               f"trainer.total_epochs={int(args.num_train_epochs)}")
    if args.save_strategy == "steps":
        out.append(f"trainer.save_freq={batches.rl_steps(optimizer_steps(args, args.save_steps, 'save_steps'))}")
    elif args.save_strategy == "no":
        out.append("trainer.save_freq=0")
    else:
        raise TrlFlagError(f"--save_strategy {args.save_strategy}: alignrl saves every N steps (steps) or at the "
                           "end only (no)")
    out.append(f"trainer.max_checkpoints={args.save_total_limit or 0}")
    sinks = ["console", "jsonl"] + [s for s in ("tensorboard", "wandb") if s in (args.report_to or [])]
    out.append(f"trainer.logger=[{','.join(sinks)}]")
    out.append(f"model.path={args.model_name_or_path or 'demo'}")
    dtype = args.dtype or args.torch_dtype
    if dtype and dtype != "auto":
        if dtype not in DTYPES:
            raise TrlFlagError(f"--dtype {dtype}: give bfloat16, float16, float32 or auto")
        out.append(f"model.dtype={DTYPES[dtype]}")
    if args.use_peft:
        # TRL's usage lines write `--lora_target_modules "q_proj", "v_proj"`: the comma is the list's, not the name's
        targets = [t.rstrip(",") for t in args.lora_target_modules or [] if t.rstrip(",")]
        # none named: TRL leaves LoraConfig's target_modules None, PEFT's choice for the architecture
        out += [f"model.lora_rank={args.lora_r}", f"model.lora_alpha={args.lora_alpha}",
                f"model.lora_dropout={args.lora_dropout}",
                f"model.target_modules={json.dumps(targets) if targets else 'peft-default'}"]
        out += four_bit_keys(args)
    return out


def four_bit_keys(args) -> list[str]:
    """The keys of TRL's 4-bit flags, read with --load_in_4bit (its keys come from the line's split): TRL's codes,
    its double quantization off unless --use_bnb_nested_quant, and its storage dtype."""
    if args.bnb_4bit_quant_type not in ("nf4", "fp4"):
        raise TrlFlagError(f"--bnb_4bit_quant_type {args.bnb_4bit_quant_type}: give nf4 or fp4")
    if args.bnb_4bit_quant_storage not in STORAGE_DTYPES:
        raise TrlFlagError(f"--bnb_4bit_quant_storage {args.bnb_4bit_quant_storage}: give one of "
                           f"{', '.join(STORAGE_DTYPES)}")
    return [f"model.bnb_4bit_quant_type={args.bnb_4bit_quant_type}",
            f"model.bnb_4bit_use_double_quant={str(args.use_bnb_nested_quant).lower()}",
            f"model.bnb_4bit_quant_storage={args.bnb_4bit_quant_storage}"]


def defaults_line(args) -> str:
    """TRL's defaults a line leaves out, those taken and those not."""
    quiet = {"dataset_train_split", "dataset_test_split", "per_device_eval_batch_size", "use_peft", "max_steps",
             "max_prompt_length"}  # alignrl's own cap, said on a line of its own
    quiet |= {"num_train_epochs"} if args.max_steps > 0 else set()  # --max_steps wins over epochs, as in TRL
    quiet |= {"save_steps"} if args.save_strategy != "steps" else set()
    quiet |= set() if args.use_peft else {"lora_r", "lora_alpha", "lora_dropout", *FOUR_BIT}
    quiet |= set() if args.loss_type == "sapo" else {"sapo_temperature_neg", "sapo_temperature_pos"}
    quiet |= set() if args.loss_type == "vespo" else {"vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                      "vespo_lambda_neg"}
    quiet |= set() if args.sync_ref_model else {"sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"}
    taken = [f"{f.name} {f.default}" for f in TAKEN if f.name not in args.given and f.default is not None
             and f.name not in quiet]
    not_taken = [f"{name} {why}" for name, why in NOT_TAKEN_DEFAULTS.items() if name not in args.given]
    return (f"TRL's defaults taken: {', '.join(taken)}" + (f"; not taken: {', '.join(not_taken)}" if not_taken
                                                            else ""))


def split_lines(args) -> list[str]:
    """The start line saying the split flags change nothing when --dataset_name is a file (read whole)."""
    splits = [f"--{f}" for f in ("dataset_train_split", "dataset_test_split") if f in args.given]
    if not splits or not args.dataset_name or is_library_dataset(args.dataset_name):
        return []
    return [f"{' '.join(splits)}: {args.dataset_name} is a file, read whole; the split flags change nothing here "
            "(they pick a dataset folder's or a Hub dataset's split)"]


def translate(args, world: int, losses=loss_keys, defaults=None, config: str = "GRPOConfig"
              ) -> tuple[list[str], list[str]]:
    """(alignrl overrides, start lines) for TRL's flags on `world` ranks; another trainer of GRPO's shape (RLOO)
    gives its own loss keys, defaults line and config's name."""
    batches = Batches(args, world)
    steps = rl_steps(args, batches)
    optimizer_steps = args.max_steps if args.max_steps > 0 else steps * batches.steps_per_round if steps else None
    sync, sync_lines = ref_sync_keys(args, batches.steps_per_round)
    overrides = (data_keys(args, batches) + batches.keys() + losses(args) + sync + reward_keys(args)
                 + optimiser_keys(args, batches, optimizer_steps) + run_keys(args, batches)
                 + [f"rollout.max_new_tokens={args.max_completion_length}", f"rollout.temperature={args.temperature}",
                    f"rollout.top_p={args.top_p}", f"rollout.top_k={args.top_k if args.top_k > 0 else -1}",
                    f"rollout.min_p={args.min_p or 0.0}", f"rollout.repetition_penalty={args.repetition_penalty}"]
                 + generation_keys(args.generation_kwargs))
    lines = [(defaults or defaults_line)(args), batches.line(),
             f"--max_prompt_length {args.max_prompt_length}{'' if 'max_prompt_length' in args.given else ' (default)'}"
             f": alignrl's own cap (TRL's {config} has none and cuts no prompt): longer prompts are left out as the "
             "data loads, counted; raise it to keep them"] + sync_lines + split_lines(args) + string_prompt_lines(args)
    if args.eval_strategy == "epoch":
        lines.append("--eval_strategy epoch: alignrl measures the held-out split before and after training "
                     "(trainer.test_freq=0), not after each epoch; --eval_strategy steps --eval_steps N evaluates "
                     "every N optimizer steps")
    if OVERLONG in (args.reward_funcs or []):
        start = OVERLONG_MAX - OVERLONG_CACHE
        lines.append(f"{OVERLONG}: TRL's script's (max_completion_len {OVERLONG_MAX}, soft_punish_cache "
                     f"{OVERLONG_CACHE}) punishes from {start} tokens; " +
                     (f"--max_completion_length {args.max_completion_length} never reaches it: no penalty"
                      if args.max_completion_length <= start else
                      f"as algorithm.overlong_buffer_len/overlong_penalty_factor up to --max_completion_length "
                      f"{args.max_completion_length}"))
    return overrides, lines


def from_line(words: list[str]) -> tuple[list[str], list[str]]:
    """A TRL-spelled `train grpo` line (the words after it) as alignrl's words (overrides, the line's own key=value
    overrides after them, --nproc), with the start lines saying how."""
    import os

    flags, own, nproc = F.split_line(words)
    args = F.parse(flags)
    world = nproc or int(os.environ.get("WORLD_SIZE", "1"))
    overrides, lines = translate(args, world)
    lines += F.unused_lines(args)
    return overrides + own + (["--nproc", str(nproc)] if nproc else []), lines
