"""OpenRLHF's `train_ppo_ray` flags (0.6-era underscore spelling), their argument checks, and their
translation into alignrl config keys.

The checks are OpenRLHF's: batch sizes divisible by world sizes, the colocation constraints, no
reference when `--init_kl_coef 0`, no critic unless `--advantage_estimator gae`, group estimators need
`--n_samples_per_prompt > 1`. Each failure is one line (`FlagError`). Flags that only matter on GPUs are
accepted everywhere and, on a cluster without GPUs, listed once as not used.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from alignrl.config import ConfigError
from alignrl.dist.launch import OneLineParser

PROG = "alignrl train ppo-ray"

# OpenRLHF estimator name -> alignrl's (algorithm.adv_estimator, algorithm.outcome_baseline). OpenRLHF's
# experience maker shapes the outcome reward with the group (rloo, reinforce_baseline, group_norm, dr_grpo; gamma
# forced to 1 for these), then subtracts the per-token KL penalty and takes returns-to-go, as REINFORCE++ does, and
# whitens them over the batch for gae, reinforce and reinforce_baseline only: that is reinforce_plus_plus with an
# outcome baseline, not verl's rloo / grpo.
ESTIMATORS = {"gae": ("gae", "none"), "reinforce": ("reinforce_plus_plus", "none"),
              "rloo": ("reinforce_plus_plus", "loo"), "reinforce_baseline": ("reinforce_plus_plus", "mean"),
              "group_norm": ("reinforce_plus_plus", "mean_std"), "dr_grpo": ("reinforce_plus_plus", "mean")}
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
WHITENED = ("gae", "reinforce", "reinforce_baseline")
KL_ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "k3"}
# flags that change nothing without GPUs (vLLM, DeepSpeed and kernel options); --zero_stage 3 still shards the
# reference group's model there (FSDP over gloo), so it is unused on CPUs only without a reference or below 3
GPU_ONLY = ("bf16", "adam_offload", "enable_prefix_caching", "vllm_gpu_memory_utilization", "vllm_sync_backend")
# flags this placement does not apply on any device: named at start, never silently dropped
NOT_APPLIED = ("flash_attn", "vllm_enable_sleep", "deepspeed_enable_sleep", "enforce_eager")
NOT_APPLIED_WHY = "not applied here: attention runs through PyTorch's SDPA, engines and DeepSpeed stay resident"
# the prompt-column flags, which apply to a --prompt_data file (synthetic data has its own layout)
DATA_KEYS = ("input_key", "label_key", "input_template", "apply_chat_template")
OPENRLHF_INPUT_KEY = "input"  # OpenRLHF's --input_key default
# --use_wandb values that are a switch; any other value is the API key (OpenRLHF: wandb.login(key=args.use_wandb))
WANDB_SWITCHES = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class FlagError(ConfigError):
    """A flag combination OpenRLHF's checks refuse; one line naming the flags and the fix."""


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="PPO/GRPO on a Ray cluster with OpenRLHF's flags: actor, reference, "
                      "critic, reward and rollout-engine groups placed by the flags; attaches to RAY_ADDRESS "
                      "(inside `ray job submit`) or starts a local Ray.")
    g = p.add_argument_group("placement")
    for role in ("ref", "actor", "critic", "reward"):
        g.add_argument(f"--{role}_num_nodes", type=int, default=1, help=f"nodes of the {role} group")
        g.add_argument(f"--{role}_num_gpus_per_node", type=int, default=8,
                       help=f"GPUs (CPU processes on a cluster without GPUs) per node of the {role} group")
    g.add_argument("--vllm_num_engines", type=int, default=1, help="rollout engines")
    g.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="GPUs per rollout engine")
    g.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.9)
    g.add_argument("--vllm_sync_backend", default="nccl", choices=("nccl", "gloo"),
                   help="weight broadcast to the engines (gloo on a cluster without GPUs)")
    for flag in ("colocate_actor_ref", "colocate_critic_reward", "colocate_all_models", "enable_prefix_caching",
                 "vllm_enable_sleep", "deepspeed_enable_sleep", "enforce_eager"):
        g.add_argument(f"--{flag}", action="store_true")
    m = p.add_argument_group("models and checkpoints")
    m.add_argument("--pretrain", default="demo", help="policy model folder ('demo': the embedded tiny model)")
    m.add_argument("--reward_pretrain", default=None, help="reward model folder (default: the rule reward)")
    m.add_argument("--remote_rm_url", default=None, help="`alignrl serve reward` URL")
    m.add_argument("--critic_pretrain", default=None, help="critic model folder (default: --reward_pretrain, "
                                                             "else --pretrain)")
    m.add_argument("--save_path", default="./ckpt", help="run folder: config, logs, summary")
    m.add_argument("--ckpt_path", default=None, help="checkpoint folder (default: <save_path>/checkpoints)")
    m.add_argument("--load_checkpoint", action="store_true", help="resume from the newest checkpoint")
    m.add_argument("--max_ckpt_num", type=int, default=3)
    m.add_argument("--save_steps", type=int, default=-1, help="-1: only the final checkpoint")
    b = p.add_argument_group("batches")
    b.add_argument("--micro_train_batch_size", type=int, default=8, help="sequences per forward/backward per rank")
    b.add_argument("--train_batch_size", type=int, default=128, help="sequences per optimizer step (global)")
    b.add_argument("--micro_rollout_batch_size", type=int, default=8,
                   help="sequences per no-grad forward: reference, old policy, critic values")
    b.add_argument("--rollout_batch_size", type=int, default=1024, help="prompts per RL step (global)")
    b.add_argument("--n_samples_per_prompt", type=int, default=1)
    b.add_argument("--num_episodes", type=int, default=1, help="passes over the prompts")
    b.add_argument("--max_epochs", type=int, default=1, help="passes over each rollout batch")
    b.add_argument("--max_samples", type=int, default=1_000_000,
                   help="prompts used at most: the first N rows of a --prompt_data file, or N synthetic problems")
    b.add_argument("--prompt_max_len", type=int, default=1024)
    b.add_argument("--generate_max_len", type=int, default=1024)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--top_p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=42)
    o = p.add_argument_group("optimisation")
    o.add_argument("--zero_stage", type=int, default=2, choices=(0, 1, 2, 3))
    for flag in ("bf16", "adam_offload", "gradient_checkpointing", "flash_attn", "packing_samples"):
        o.add_argument(f"--{flag}", action="store_true")
    o.add_argument("--actor_learning_rate", type=float, default=1e-6)
    o.add_argument("--critic_learning_rate", type=float, default=9e-6)
    o.add_argument("--init_kl_coef", type=float, default=0.01, help="0: no KL term and no reference group")
    o.add_argument("--use_kl_loss", action="store_true", help="KL as a loss term (GRPO) instead of in the reward")
    o.add_argument("--kl_estimator", default="k1", choices=sorted(KL_ESTIMATORS))
    o.add_argument("--advantage_estimator", default="gae", choices=sorted(ESTIMATORS))
    o.add_argument("--gamma", type=float, default=1.0)
    o.add_argument("--no_advantage_std_norm", action="store_true",
                   help="centre the whitened advantages without dividing by their std")
    d = p.add_argument_group("data and logging")
    d.add_argument("--prompt_data", default="synthetic", help="'synthetic' or a .jsonl/.json/.parquet file")
    d.add_argument("--input_key", default=None,
                   help="prompt column: a string or chat messages (default 'input' when --label_key or "
                        "--input_template is given; with none of the three, GSM8K/verl layouts are detected)")
    d.add_argument("--label_key", default=None, help="answer column the rule reward compares with (default: none, "
                                                     "the reward comes from --reward_pretrain/--remote_rm_url)")
    d.add_argument("--input_template", default=None, help="without --apply_chat_template: the prompt is this text "
                                                          "with {} replaced by the prompt column")
    d.add_argument("--apply_chat_template", action="store_true",
                   help="prompts go through the tokenizer's chat template (without it, the prompt column's string "
                        "is tokenized as it is; detected GSM8K/verl layouts are always chat-templated)")
    d.add_argument("--use_wandb", default=None,
                   help="log to wandb: a wandb API key (the run's WANDB_API_KEY, in place of the environment's), "
                        "or true/1/yes to log with the environment's login (false/0/no: no wandb)")
    d.add_argument("--use_tensorboard", default=None, help="tensorboard folder (written under the run's logs/)")
    a = p.add_argument_group("alignrl")
    a.add_argument("--placement_timeout", type=float, default=60.0,
                   help="seconds to wait for the placement groups before failing")
    a.add_argument("--peer_timeout", type=float, default=600.0,
                   help="seconds a collective or a worker's answer may take before the run stops (a step's "
                        "generation takes as long as it takes: a line every this many seconds says who is at it)")
    a.add_argument("--threads", type=int, default=1, help="torch CPU threads per Ray actor")
    a.add_argument("--total_steps", type=int, default=0, help="RL steps (0: from num_episodes and the data size)")
    a.add_argument("--test_freq", type=int, default=0, help="held-out greedy accuracy every N steps (0: only at end)")
    a.add_argument("--val_size", type=int, default=64, help="held-out problems of the final evaluation")
    return p


def world(args, role: str) -> int:
    return getattr(args, f"{role}_num_nodes") * getattr(args, f"{role}_num_gpus_per_node")


def check(args) -> None:
    """OpenRLHF's checks of `train_ppo_ray`, one line each."""
    for role in ("ref", "actor", "critic", "reward"):
        if getattr(args, f"{role}_num_nodes") < 1 or getattr(args, f"{role}_num_gpus_per_node") < 1:
            raise FlagError(f"--{role}_num_nodes and --{role}_num_gpus_per_node must be at least 1")
    if args.vllm_num_engines < 1 or args.vllm_tensor_parallel_size < 1:
        raise FlagError("--vllm_num_engines and --vllm_tensor_parallel_size must be at least 1")
    used = {"actor": True, "ref": uses_reference(args), "critic": uses_critic(args),
            "reward": uses_reward_model(args)}
    pairs = [("actor", "ref")] if args.colocate_actor_ref or args.colocate_all_models else []
    if args.colocate_critic_reward or args.colocate_all_models:
        pairs.append(("critic", "reward"))
    if args.colocate_all_models:
        pairs += [("actor", "critic"), ("actor", "reward")]
    for a, b in pairs:
        if not (used[a] and used[b]):
            continue  # a role that does not run has nothing to share
        if (getattr(args, f"{a}_num_nodes"), getattr(args, f"{a}_num_gpus_per_node")) != \
                (getattr(args, f"{b}_num_nodes"), getattr(args, f"{b}_num_gpus_per_node")):
            raise FlagError(f"colocating {a} and {b}: --{a}_num_nodes/--{a}_num_gpus_per_node must equal "
                            f"--{b}_num_nodes/--{b}_num_gpus_per_node")
    engines = args.vllm_num_engines * args.vllm_tensor_parallel_size
    if args.colocate_all_models and engines != world(args, "actor"):
        raise FlagError(f"--colocate_all_models: --vllm_num_engines × --vllm_tensor_parallel_size = {engines} must "
                        f"equal the actor's GPUs ({world(args, 'actor')})")
    if args.colocate_all_models and args.actor_num_gpus_per_node % args.vllm_tensor_parallel_size:
        raise FlagError(f"--colocate_all_models: --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} must "
                        f"divide --actor_num_gpus_per_node {args.actor_num_gpus_per_node} (an engine stays on one node)")
    n, actors = args.n_samples_per_prompt, world(args, "actor")
    if n < 1:
        raise FlagError("--n_samples_per_prompt must be at least 1")
    if args.advantage_estimator in GROUP_ESTIMATORS and n <= 1:
        raise FlagError(f"--advantage_estimator {args.advantage_estimator} compares samples of one prompt: "
                        "set --n_samples_per_prompt > 1")
    if args.train_batch_size % (args.micro_train_batch_size * actors):
        raise FlagError(f"--train_batch_size {args.train_batch_size} must be a multiple of --micro_train_batch_size "
                        f"× actor GPUs = {args.micro_train_batch_size} × {actors}")
    if args.train_batch_size % n:
        raise FlagError(f"--train_batch_size {args.train_batch_size} must be a multiple of --n_samples_per_prompt {n} "
                        "(an optimizer step takes whole prompt groups)")
    if (args.rollout_batch_size * n) % args.train_batch_size:
        raise FlagError(f"--rollout_batch_size × --n_samples_per_prompt = {args.rollout_batch_size * n} must be a "
                        f"multiple of --train_batch_size {args.train_batch_size}")
    for what, count in (("actor GPUs", actors), ("--vllm_num_engines", args.vllm_num_engines)):
        if args.rollout_batch_size % count or (args.train_batch_size // n) % count:
            raise FlagError(f"--rollout_batch_size {args.rollout_batch_size} and --train_batch_size / "
                            f"--n_samples_per_prompt = {args.train_batch_size // n} prompts must be multiples of "
                            f"{what} ({count}): each takes an equal share")
    if uses_critic(args) and actors % world(args, "critic"):
        raise FlagError(f"the actor's GPUs ({actors}) must be a multiple of the critic's ({world(args, 'critic')}): "
                        "actor rank r sends its rows to critic rank r % critic GPUs")
    if args.max_samples < 1:
        raise FlagError(f"--max_samples {args.max_samples} leaves no prompts: give at least 1")
    check_wandb(args)
    if args.remote_rm_url and args.reward_pretrain:
        raise FlagError("give either --reward_pretrain or --remote_rm_url, not both")
    if data_keys(args) and args.label_key is None and not (args.reward_pretrain or args.remote_rm_url):
        raise FlagError("without --label_key the prompts have no answer for the rule reward: give --label_key "
                        "<answer column>, or a reward model (--reward_pretrain or --remote_rm_url)")


def wandb_on(args) -> bool:
    """--use_wandb given with a key or a true switch (OpenRLHF logs whenever the value is non-empty; a written-out
    false here means no wandb)."""
    return bool(args.use_wandb) and WANDB_SWITCHES.get(args.use_wandb.lower(), True)


def wandb_key(args) -> str | None:
    """The wandb API key --use_wandb carries, or None when its value is a switch (or it is not given)."""
    if not args.use_wandb or args.use_wandb.lower() in WANDB_SWITCHES:
        return None
    return args.use_wandb


def check_wandb(args) -> None:
    """A key goes into a process environment and an HTTP header: printable, without spaces. The message
    never repeats the value, which may be a real key with a typo."""
    key = wandb_key(args)
    if key is not None and (not key.isprintable() or any(c.isspace() for c in key)):
        raise FlagError("--use_wandb takes a wandb API key or true/false; the value given has spaces or unprintable "
                        "characters")


def uses_reference(args) -> bool:
    return args.init_kl_coef > 0


def estimator_keys(args) -> list[str]:
    estimator, baseline = ESTIMATORS[args.advantage_estimator]
    whiten = "none" if args.advantage_estimator not in WHITENED else "center" if args.no_advantage_std_norm else "std"
    gamma = 1.0 if args.advantage_estimator in GROUP_ESTIMATORS else args.gamma
    return [f"algorithm.adv_estimator={estimator}", f"algorithm.outcome_baseline={baseline}",
            f"algorithm.whiten_advantages={whiten}", f"algorithm.gamma={gamma}"]


def uses_critic(args) -> bool:
    return args.advantage_estimator == "gae"


def uses_reward_model(args) -> bool:
    return bool(args.reward_pretrain) and not args.remote_rm_url


def data_keys(args) -> dict[str, object]:
    """`load_samples` keywords for the prompt-column flags: empty (the layout is detected, prompts
    chat-templated) when --prompt_data is synthetic or none of --input_key/--label_key/--input_template
    is given, else OpenRLHF's reading of the file (--input_key defaulting to 'input')."""
    if args.prompt_data == "synthetic" or (args.input_key, args.label_key, args.input_template) == (None,) * 3:
        return {}
    return {"prompt_key": args.input_key or OPENRLHF_INPUT_KEY, "label_key": args.label_key,
            "input_template": None if args.apply_chat_template else args.input_template,
            "apply_chat_template": args.apply_chat_template}


# The config keys that ppo-ray's flags set, as its errors name them: a user of these flags never wrote the keys.
FLAG_OF_KEY = {"data.train_files": "--prompt_data", "data.prompt_key": "--input_key", "data.label_key": "--label_key",
               "critic.model_path": "--critic_pretrain", "algorithm.reward_model": "--reward_pretrain",
               "model.path": "--pretrain"}


def in_flag_terms(message: str) -> str:
    """An error naming config keys, said in this command's flags (`model.path='x'` -> `--pretrain 'x'`); a path
    that merely contains a key's text (`/d/model.path`) stays as it is."""
    for key, flag in FLAG_OF_KEY.items():
        message = re.sub(rf"(?<![\w./-]){re.escape(key)}(?![\w.])(=?)", lambda m: flag + (" " if m[1] else ""),
                         message)
    return message


def unused_here(args, gpus: bool) -> list[str]:
    """Flags given that change nothing here, each group with its reason (listed once at start): those this
    placement does not apply, GPU-only ones without CUDA, the prompt-column flags on synthetic data, and
    --input_template beside --apply_chat_template (OpenRLHF ignores it there too)."""
    defaults = vars(parser().parse_args([]))
    shards_ref = args.zero_stage == 3 and uses_reference(args)
    groups = [(NOT_APPLIED, NOT_APPLIED_WHY),
              (() if gpus else GPU_ONLY + (() if shards_ref else ("zero_stage",)), "no CUDA"),
              (DATA_KEYS if args.prompt_data == "synthetic" else (), "the prompts are synthetic"),
              (("input_template",) if args.apply_chat_template and args.prompt_data != "synthetic" else (),
               "--apply_chat_template formats the prompts"),
              (("gamma",) if args.advantage_estimator in GROUP_ESTIMATORS else (),
               f"OpenRLHF sets gamma to 1 for --advantage_estimator {args.advantage_estimator}")]
    out = []
    for names, why in groups:
        given = [f"--{f}" for f in names if getattr(args, f) != defaults[f]]
        if given:
            out.append(f"{' '.join(given)} ({why})")
    return out


def prompt_cap(args) -> str:
    """--max_samples as the config key that caps the prompts: the first rows of a file (OpenRLHF takes
    `range(min(max_samples, len(dataset)))`), or the number of synthetic problems generated."""
    if args.prompt_data == "synthetic":
        return f"data.train_size={args.max_samples}"
    return f"data.train_max_samples={args.max_samples}"


def overrides(args, gpus: bool, total_steps: int) -> list[str]:
    """alignrl config keys (dotted overrides) for these flags."""
    n, save = args.n_samples_per_prompt, Path(args.save_path).absolute()
    kl = uses_reference(args)
    out = [f"model.path={args.pretrain}", f"data.train_files={args.prompt_data}", prompt_cap(args),
           f"data.val_size={args.val_size}",
           f"data.val_size_during_training={args.val_size}", f"data.train_batch_size={args.rollout_batch_size}",
           f"data.max_prompt_length={args.prompt_max_len}", f"rollout.n={n}",
           f"rollout.max_new_tokens={args.generate_max_len}", f"rollout.temperature={args.temperature}",
           f"rollout.top_p={args.top_p}", f"actor.ppo_mini_batch_size={args.train_batch_size // n}",
           f"actor.ppo_micro_batch_size={args.micro_train_batch_size}", f"actor.ppo_epochs={args.max_epochs}",
           f"actor.logprob_micro_batch_size={args.micro_rollout_batch_size}",
           f"actor.use_remove_padding={args.packing_samples}", f"critic.use_remove_padding={args.packing_samples}",
           f"actor.gradient_checkpointing={args.gradient_checkpointing}",
           f"actor.lr={args.actor_learning_rate}", *estimator_keys(args), f"critic.enable={uses_critic(args)}",
           f"critic.lr={args.critic_learning_rate}", f"actor.use_kl_loss={kl and args.use_kl_loss}",
           f"actor.kl_loss_coef={args.init_kl_coef}", f"actor.kl_loss_type={KL_ESTIMATORS[args.kl_estimator]}",
           f"algorithm.use_kl_in_reward={kl and not args.use_kl_loss}", f"algorithm.kl_coef={args.init_kl_coef}",
           f"algorithm.kl_penalty={KL_ESTIMATORS[args.kl_estimator]}", f"trainer.seed={args.seed}",
           f"trainer.output_dir={save.parent}", f"trainer.experiment_name={save.name}",
           f"trainer.total_training_steps={total_steps}", f"trainer.save_freq={max(args.save_steps, 0)}",
           f"trainer.max_checkpoints={max(args.max_ckpt_num, 1)}", f"trainer.test_freq={args.test_freq}",
           f"trainer.resume_mode={'auto' if args.load_checkpoint else 'disable'}", f"trainer.threads={args.threads}",
           "trainer.progress_bar=false",
           f"trainer.logger=[console,jsonl{',tensorboard' if args.use_tensorboard else ''}"
           f"{',wandb' if wandb_on(args) else ''}]"]  # a key given as --use_wandb never enters the config
    if args.prompt_data != "synthetic":
        out.append(f"data.val_files={args.prompt_data}")
    for key, value in data_keys(args).items():  # JSON-quoted: a template's text is not a YAML value, JSON's is
        out.append(f"data.{key}={value}" if isinstance(value, bool) else
                   f"data.{key}=null" if value is None else f"data.{key}={json.dumps(value)}")
    if args.ckpt_path:
        out.append(f"trainer.checkpoint_dir={Path(args.ckpt_path).absolute()}")
    if args.reward_pretrain:
        out.append(f"algorithm.reward_model={args.reward_pretrain}")
    if args.remote_rm_url:
        out.append(f"services.reward_url={args.remote_rm_url}")
    if uses_critic(args):
        critic = args.critic_pretrain or args.reward_pretrain
        if critic:
            out.append(f"critic.model_path={critic}")
    if gpus:
        out += ["trainer.strategy=deepspeed", f"trainer.zero_stage={args.zero_stage}",
                f"trainer.offload={args.adam_offload}", f"model.dtype={'bfloat16' if args.bf16 else 'float32'}"]
    else:
        out += ["trainer.device=cpu"]
    return out
