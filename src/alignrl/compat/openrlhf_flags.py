"""OpenRLHF's `train_ppo_ray` flags (0.6-era underscore spelling) and their argument checks; their translation
into alignrl config keys is `cluster.flag_keys`.

The checks are OpenRLHF's: batch sizes divisible by world sizes, the colocation constraints, no
reference when `--init_kl_coef 0`, no critic unless `--advantage_estimator gae`, group estimators need
`--n_samples_per_prompt > 1`. Each failure is one line (`FlagError`). Flags that only matter on GPUs are
accepted everywhere and, on a cluster without GPUs, listed once as not used.
"""

from __future__ import annotations

import argparse

from alignrl.compat import openrlhf_loop as L
from alignrl.compat import openrlhf_recent as R
from alignrl.compat import openrlhf_sources as S
from alignrl.config import ConfigError
from alignrl.placements.ray.roles import uses_critic, uses_reference, uses_reward_model  # noqa: F401 (flag checks)
from alignrl.runtime.one_line import OneLineParser

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
# --lr_scheduler (transformers' names, as OpenRLHF passes them to get_scheduler) -> (actor.lr_scheduler, min_lr_ratio)
SCHEDULERS = {"cosine_with_min_lr": ("cosine", 0.1), "constant_with_warmup": ("constant", 0.0),
              "constant": ("constant", 0.0), "linear": ("linear", 0.0)}
# OpenRLHF flags accepted for its scripts' sake that change nothing here: (flag, type, default); a value other than
# the default is named at start with the reason (cluster.flag_keys.NOT_APPLIED)
ACCEPTED = [("max_len", int, None), ("ptx_coef", float, 0.05), ("normalize_reward", bool, False),
            ("save_value_network", bool, False), ("logging_steps", int, 1), ("save_hf_ckpt", bool, False),
            ("disable_ds_ckpt", bool, False), ("max_ckpt_mem", int, 100_000_000), ("prompt_split", str, "train"),
            ("eval_split", str, "train"),
            ("value_head_prefix", str, "score"), ("ref_reward_offload", bool, False),
            ("vllm_sync_with_ray", bool, False), ("wandb_org", str, None), ("wandb_group", str, None),
            ("wandb_run_name", str, None), ("aux_loss_coef", float, 0.0), ("zpg", int, 1),
            ("grad_accum_dtype", str, None), ("disable_trace_cache", bool, False),
            ("gradient_checkpointing_use_reentrant", bool, False), ("disable_fast_tokenizer", bool, False),
            ("actor_init_on_gpu", bool, False), ("enable_ema", bool, False), ("ema_beta", float, 0.992),
            ("local_rank", int, -1),
            ("load_in_4bit", bool, False)]
# --use_wandb values that are a switch; any other value is the API key (OpenRLHF: wandb.login(key=args.use_wandb))
WANDB_SWITCHES = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class FlagError(ConfigError):
    """A flag combination OpenRLHF's checks refuse; one line naming the flags and the fix."""


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="PPO/GRPO on a Ray cluster with OpenRLHF's flags: actor, reference, "
                      "critic, reward and rollout-engine groups placed by the flags; attaches to RAY_ADDRESS "
                      "(inside `ray job submit`) or starts a local Ray.",
                      epilog="OpenRLHF's current dotted spelling is taken too (--actor.num_nodes, --train.batch_size, "
                             "--algo.kl.init_coef, --ds.zero_stage, ...): see alignrl.compat.openrlhf_dotted.")
    # one helper per --help section; the sections print in the order they are made here
    _placement_flags(p.add_argument_group("placement"))
    _model_flags(p.add_argument_group("models and checkpoints"))
    _batch_flags(p.add_argument_group("batches"))
    _optimisation_flags(p.add_argument_group("optimisation"))
    _trained_flags(p.add_argument_group("what trains: LoRA adapters, frozen parameters, vision-language models"))
    R.add_recent_flags(p.add_argument_group("OpenRLHF 0.7 and later"))
    L.add_loop_flags(p.add_argument_group("dynamic filtering, ring attention, agent function"))
    _accepted_flags(p.add_argument_group("accepted, not applied here (listed at start when given)"))
    _data_flags(p.add_argument_group("data and logging"))
    _alignrl_flags(p.add_argument_group("alignrl"))
    return p


def _placement_flags(g) -> None:
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


def _model_flags(m) -> None:
    m.add_argument("--pretrain", default="demo", help="policy model folder ('demo': the embedded tiny model)")
    m.add_argument("--reward_pretrain", default=None, help="reward model folder (default: the rule reward)")
    m.add_argument("--ref_pretrain", default=None, help="reference model folder of the KL term (default: --pretrain)")
    m.add_argument("--remote_rm_url", default=None, help="reward service URLs separated by commas (`alignrl serve "
                   "reward`, or OpenRLHF-style /get_reward; several share each batch), or a .py file defining "
                   "reward_func(queries, prompts, labels)")
    m.add_argument("--critic_pretrain", default=None, help="critic model folder (default: --reward_pretrain, "
                                                             "else --pretrain)")
    m.add_argument("--save_path", default="./ckpt", help="run folder: config, logs, summary")
    m.add_argument("--ckpt_path", default=None, help="checkpoint folder (default: <save_path>/checkpoints)")
    m.add_argument("--load_checkpoint", action="store_true", help="resume from the newest checkpoint")
    m.add_argument("--max_ckpt_num", type=int, default=3)
    m.add_argument("--save_steps", type=int, default=-1, help="-1: only the final checkpoint")


def _batch_flags(b) -> None:
    b.add_argument("--micro_train_batch_size", type=int, default=4, help="sequences per forward/backward per rank")
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


def _optimisation_flags(o) -> None:
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
    # OpenRLHF's optimiser and PPO settings, with its defaults (its scheduler: cosine to 0.1 × lr after warm-up)
    o.add_argument("--lr_warmup_ratio", type=float, default=0.03, help="linear warm-up, fraction of optimizer steps")
    o.add_argument("--lr_scheduler", default="cosine_with_min_lr", choices=sorted(SCHEDULERS),
                   help="after warm-up: cosine down to 0.1 × the learning rate, constant, or linear down to 0")
    o.add_argument("--adam_betas", type=float, nargs=2, default=(0.9, 0.95))
    o.add_argument("--l2", type=float, default=0.0, help="weight decay")
    o.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping")
    o.add_argument("--eps_clip", type=float, default=0.2, help="PPO clip range")
    o.add_argument("--dual_clip", type=float, default=None, help="dual-clip constant c > 1")
    o.add_argument("--value_clip", type=float, default=0.2, help="value clip range around the old values")
    o.add_argument("--lambd", type=float, default=0.95, help="GAE lambda")
    o.add_argument("--kl_target", type=float, default=None, help="adaptive KL controller toward this KL")
    o.add_argument("--kl_horizon", type=int, default=10000)
    o.add_argument("--use_kl_estimator_k3", action="store_true", help="OpenRLHF's older spelling of --kl_estimator k3")
    o.add_argument("--entropy_loss_coef", type=float, default=None)
    o.add_argument("--reward_clip_range", type=float, nargs=2, default=(-10.0, 10.0))
    o.add_argument("--freezing_actor_steps", type=int, default=-1, help="RL steps that train only the critic")
    o.add_argument("--overlong_buffer_len", type=int, default=None)
    o.add_argument("--overlong_penalty_factor", type=float, default=1.0)


def _trained_flags(t) -> None:
    t.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters of this rank train in place of the "
                   "actor's and critic's weights (0: all weights train); the reference is the base, adapters off")
    t.add_argument("--lora_alpha", type=int, default=16, help="LoRA scale numerator (updates scaled by alpha / rank)")
    t.add_argument("--lora_dropout", type=float, default=0.0)
    t.add_argument("--target_modules", nargs="*", default=["all-linear"],
                   help="modules that get adapters: all-linear, or names such as q_proj v_proj")
    t.add_argument("--freeze_prefix", nargs="*", default=None,
                   help="parameters whose names start with one of these do not train (LMM-R1: visual)")
    t.add_argument("--train_vlm", action="store_true",
                   help="LMM-R1's older flag: the policy is a vision-language model (inferred without it from its "
                        "config.json's vision_config)")


def _accepted_flags(x) -> None:
    for flag, kind, default in ACCEPTED:
        if kind is bool:
            x.add_argument(f"--{flag}", action="store_true")
        else:
            x.add_argument(f"--{flag}", type=kind, default=default)


def _data_flags(d) -> None:
    d.add_argument("--prompt_data", default="synthetic", help="'synthetic', or .jsonl/.json/.parquet files separated "
                   "by commas (concatenated, or blended by --prompt_data_probs)")
    d.add_argument("--prompt_data_probs", default=None,
                   help="one weight per --prompt_data file, separated by commas (e.g. 0.7,0.3): rows are drawn by "
                        "weight, seeded by --seed, until every file was used once (OpenRLHF's interleave_datasets)")
    d.add_argument("--pretrain_data", default=None,
                   help="PPO-ptx: .jsonl/.json/.parquet files of text (the --input_key column), separated by commas, "
                        "whose language-model loss times --ptx_coef joins the actor's updates")
    d.add_argument("--pretrain_data_probs", default="1.0", help="one weight per --pretrain_data file (blended as "
                                                                  "--prompt_data_probs blends prompts)")
    d.add_argument("--pretrain_split", default="train", help="accepted: --pretrain_data files are read whole")
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
    d.add_argument("--use_tensorboard", default=None, help="TensorBoard folder: events go to PATH/<run name>")
    d.add_argument("--wandb_project", default="openrlhf_train_ppo")
    d.add_argument("--eval_dataset", default=None, help="held-out prompts (default: the last rows of --prompt_data "
                                                        "are not held out: the evaluation reads the training file)")
    d.add_argument("--eval_steps", type=int, default=-1, help="held-out accuracy every N steps (as --test_freq)")


def _alignrl_flags(a) -> None:
    a.add_argument("--placement_timeout", type=float, default=60.0,
                   help="seconds to wait for the placement groups before failing")
    a.add_argument("--peer_timeout", type=float, default=600.0,
                   help="seconds a collective or a worker's answer may take before the run stops (a step's "
                        "generation takes as long as it takes: a line every this many seconds says who is at it)")
    a.add_argument("--threads", type=int, default=1, help="torch CPU threads per Ray actor")
    a.add_argument("--total_steps", type=int, default=0, help="RL steps (0: from num_episodes and the data size)")
    a.add_argument("--test_freq", type=int, default=0, help="held-out greedy accuracy every N steps (0: only at end)")
    a.add_argument("--val_size", type=int, default=64, help="held-out problems of the final evaluation")


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
        raise FlagError(f"the actor's GPUs ({actors}, --actor_num_nodes × --actor_num_gpus_per_node) must be a "
                        f"multiple of the critic's ({world(args, 'critic')}, --critic_num_nodes × "
                        "--critic_num_gpus_per_node, 8 by default): actor rank r sends its rows to critic rank "
                        "r % critic GPUs")
    if args.max_samples < 1:
        raise FlagError(f"--max_samples {args.max_samples} leaves no prompts: give at least 1")
    check_wandb(args)
    check_trained(args)
    R.check_recent(args)
    L.check_loop(args)
    S.check_sources(args)
    if args.load_in_4bit:
        raise FlagError("--load_in_4bit: ppo-ray's rollout engines load the policy's merged weights after every "
                        "update, which a 4-bit base (packed NF4 codes) cannot give; QLoRA trains in one process "
                        "group: `alignrl train grpo model.load_in_4bit=true model.lora_rank=16 "
                        "model.lora_export=adapter` (docs/lora.md), or drop the flag")
    if args.remote_rm_url and args.reward_pretrain:
        raise FlagError("give either --reward_pretrain or --remote_rm_url, not both")
    if data_keys(args) and args.label_key is None and not (args.reward_pretrain or args.remote_rm_url):
        raise FlagError("without --label_key the prompts have no answer for the rule reward: give --label_key "
                        "<answer column>, or a reward model (--reward_pretrain or --remote_rm_url)")


def check_trained(args) -> None:
    """The LoRA flags' ranges, and --train_vlm only with a vision-language model (the folder decides; without the
    flag its vision_config makes the run a vision-language one, R.is_vlm)."""
    if args.lora_rank < 0 or (args.lora_rank and args.lora_alpha < 1) or not 0 <= args.lora_dropout <= 1:
        raise FlagError("--lora_rank must be >= 0 (0: no LoRA), --lora_alpha >= 1, --lora_dropout in [0, 1]")
    if args.train_vlm:
        from alignrl.models.folder import read_config

        config = read_config(args.pretrain)
        if args.pretrain == "demo" or (config and "vision_config" not in config):
            raise FlagError(f"--train_vlm: --pretrain {args.pretrain} is a text-only model (its config.json has no "
                            "vision_config): drop --train_vlm, or give a vision-language model such as Qwen2-VL")


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


def data_keys(args) -> dict[str, object]:
    """`load_samples` keywords for the prompt-column flags: empty (the layout is detected, prompts
    chat-templated) when --prompt_data is synthetic or none of --input_key/--label_key/--input_template
    is given, else OpenRLHF's reading of the file (--input_key defaulting to 'input')."""
    if args.prompt_data == "synthetic" or (args.input_key, args.label_key, args.input_template) == (None,) * 3:
        return {}
    # a vision-language model's chat messages always go through its processor's template (LMM-R1 renders them so
    # without --apply_chat_template, with --train_vlm or, in its current scripts, with neither flag)
    templated = args.apply_chat_template or R.is_vlm(args)
    return {"prompt_key": args.input_key or S.OPENRLHF_INPUT_KEY, "label_key": args.label_key,
            "input_template": None if templated else args.input_template, "apply_chat_template": templated}


# The config keys that ppo-ray's flags set, as its errors name them: a user of these flags never wrote the keys.
FLAG_OF_KEY = {"data.train_files": "--prompt_data", "data.prompt_key": "--input_key", "data.label_key": "--label_key",
               "critic.model_path": "--critic_pretrain", "algorithm.reward_model": "--reward_pretrain",
               "model.ref_path": "--ref_pretrain",
               "model.path": "--pretrain", "actor.lr": "--actor_learning_rate", "critic.lr": "--critic_learning_rate",
               "rollout.temperature": "--temperature", "rollout.top_p": "--top_p", "rollout.n": "--n_samples_per_prompt",
               "rollout.max_new_tokens": "--generate_max_len", "data.max_prompt_length": "--prompt_max_len",
               "data.train_batch_size": "--rollout_batch_size", "actor.ppo_micro_batch_size": "--micro_train_batch_size",
               "actor.ppo_epochs": "--max_epochs", "actor.clip_ratio_low": "--eps_clip",
               "actor.clip_ratio_high": "--eps_clip", "critic.cliprange_value": "--value_clip",
               "services.reward_url": "--remote_rm_url", "algorithm.reward_fn": "--remote_rm_url",
               "data.train_files_probs": "--prompt_data_probs", "trainer.seed": "--seed"}


def in_flag_terms(message: str, args=None) -> str:
    """An error naming config keys, said in this command's flags (`model.path='x'` -> `--pretrain 'x'`); with the
    parsed `args`, data.val_files as the flag that set it."""
    from alignrl.errors import in_flag_words

    val = {"data.val_files": "--eval_dataset" if args.eval_dataset else "--prompt_data"} if args is not None else {}
    return in_flag_words(message, {**FLAG_OF_KEY, **val})
