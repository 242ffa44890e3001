"""OpenRLHF's current, dotted spelling of the `train_ppo_ray` flags (`--actor.num_nodes`, `--train.batch_size`,
`--algo.kl.init_coef`, ...; its DeepSpeed form's `--ds.*` and its FSDP form's `--fsdp.*`) beside the 0.6-era
underscore one that `openrlhf_flags` parses: one table, read both ways. A command line in the dotted spelling is
rewritten to the underscore one before parsing, and errors speak of the flags as the user typed them.

Flags whose meaning moved are rewritten with it: `--ds.param_dtype` / `--fsdp.param_dtype` are `--param_dtype`
(fp32: no flag), `--data.max_len` (prompt and response in all) sets the prompt cap beside
`--rollout.max_new_tokens`, else the response cap. The dotted parser's own defaults come with a dotted command line
(DOTTED_DEFAULTS). Left out: flags with no underscore counterpart here (Muon); they are refused as unknown, in one
line."""

from __future__ import annotations

import re

from alignrl.errors import in_flag_words

_ROLES = ("ref", "actor", "critic", "reward")

# dotted flag -> underscore flag (the value, if any, carries over unchanged)
DOTTED: dict[str, str] = {
    **{f"--{r}.num_nodes": f"--{r}_num_nodes" for r in _ROLES},
    **{f"--{r}.num_gpus_per_node": f"--{r}_num_gpus_per_node" for r in _ROLES},
    "--vllm.num_engines": "--vllm_num_engines", "--vllm.tensor_parallel_size": "--vllm_tensor_parallel_size",
    "--vllm.gpu_memory_utilization": "--vllm_gpu_memory_utilization", "--vllm.sync_backend": "--vllm_sync_backend",
    "--vllm.enable_prefix_caching": "--enable_prefix_caching", "--vllm.enable_sleep": "--vllm_enable_sleep",
    "--vllm.enforce_eager": "--enforce_eager", "--vllm.sync_with_ray": "--vllm_sync_with_ray",
    "--train.colocate_actor_ref": "--colocate_actor_ref", "--train.colocate_critic_reward": "--colocate_critic_reward",
    "--train.colocate_all": "--colocate_all_models",
    "--ds.enable_sleep": "--deepspeed_enable_sleep", "--fsdp.enable_sleep": "--deepspeed_enable_sleep",
    "--actor.model_name_or_path": "--pretrain", "--reward.model_name_or_path": "--reward_pretrain",
    "--reward.remote_url": "--remote_rm_url", "--critic.model_name_or_path": "--critic_pretrain",
    "--ckpt.output_dir": "--save_path", "--ckpt.path": "--ckpt_path", "--ckpt.load_enable": "--load_checkpoint",
    "--ckpt.max_num": "--max_ckpt_num", "--ckpt.save_steps": "--save_steps", "--ckpt.save_hf": "--save_hf_ckpt",
    "--ckpt.disable_ds": "--disable_ds_ckpt", "--ckpt.max_mem": "--max_ckpt_mem",
    "--train.micro_batch_size": "--micro_train_batch_size", "--train.batch_size": "--train_batch_size",
    "--rollout.micro_batch_size": "--micro_rollout_batch_size", "--rollout.batch_size": "--rollout_batch_size",
    "--rollout.n_samples_per_prompt": "--n_samples_per_prompt", "--train.num_episodes": "--num_episodes",
    "--train.max_epochs": "--max_epochs", "--data.max_samples": "--max_samples",
    "--rollout.max_new_tokens": "--generate_max_len",
    "--rollout.temperature": "--temperature", "--rollout.top_p": "--top_p", "--train.seed": "--seed",
    "--ds.zero_stage": "--zero_stage", "--ds.adam_offload": "--adam_offload",
    "--actor.gradient_checkpointing_enable": "--gradient_checkpointing",
    "--ds.packing_samples": "--packing_samples", "--fsdp.packing_samples": "--packing_samples",
    "--actor.adam.lr": "--actor_learning_rate", "--critic.adam.lr": "--critic_learning_rate",
    "--actor.lr_warmup_ratio": "--lr_warmup_ratio", "--actor.lr_scheduler": "--lr_scheduler",
    "--actor.adam.betas": "--adam_betas", "--actor.adam.weight_decay": "--l2", "--actor.max_norm": "--max_norm",
    "--algo.kl.init_coef": "--init_kl_coef", "--algo.kl.use_loss": "--use_kl_loss",
    "--algo.kl.estimator": "--kl_estimator", "--algo.kl.target": "--kl_target", "--algo.kl.horizon": "--kl_horizon",
    "--algo.advantage.estimator": "--advantage_estimator", "--algo.advantage.gamma": "--gamma",
    "--algo.advantage.lambd": "--lambd", "--algo.advantage.no_std_norm": "--no_advantage_std_norm",
    "--actor.eps_clip": "--eps_clip", "--actor.dual_clip": "--dual_clip", "--critic.value_clip": "--value_clip",
    "--actor.entropy_coef": "--entropy_loss_coef", "--reward.clip_range": "--reward_clip_range",
    "--critic.freezing_steps": "--freezing_actor_steps",
    "--reward.overlong_buffer_len": "--overlong_buffer_len",
    "--reward.overlong_penalty_factor": "--overlong_penalty_factor",
    "--reward.normalize_enable": "--normalize_reward", "--critic.save_value_network": "--save_value_network",
    "--logger.logging_steps": "--logging_steps", "--data.prompt_split": "--prompt_split",
    "--data.prompt_probs": "--prompt_data_probs", "--ds.value_head_prefix": "--value_head_prefix",
    "--fsdp.value_head_prefix": "--value_head_prefix", "--logger.wandb.org": "--wandb_org",
    "--logger.wandb.group": "--wandb_group", "--logger.wandb.run_name": "--wandb_run_name",
    "--actor.aux_loss_coef": "--aux_loss_coef", "--ds.zpg": "--zpg", "--ds.grad_accum_dtype": "--grad_accum_dtype",
    "--actor.gradient_checkpointing_reentrant": "--gradient_checkpointing_use_reentrant",
    "--data.disable_fast_tokenizer": "--disable_fast_tokenizer", "--train.enable_ema": "--enable_ema",
    "--ds.load_in_4bit": "--load_in_4bit",
    "--data.prompt_dataset": "--prompt_data", "--data.input_key": "--input_key", "--data.label_key": "--label_key",
    "--data.input_template": "--input_template", "--data.apply_chat_template": "--apply_chat_template",
    "--logger.wandb.key": "--use_wandb", "--logger.tensorboard_dir": "--use_tensorboard",
    "--logger.wandb.project": "--wandb_project", "--eval.dataset": "--eval_dataset", "--eval.steps": "--eval_steps",
    **{f"--{b}.attn_implementation": "--attn_implementation" for b in ("ds", "fsdp")},
    "--actor.eps_clip_low_high": "--eps_clip_low_high", "--train.dynamic_batch_enable": "--use_dynamic_batch",
    "--train.max_tokens_per_gpu": "--train_max_tokens_per_gpu",
    "--rollout.max_tokens_per_gpu": "--rollout_max_tokens_per_gpu",
    "--algo.advantage.is_correction_enable": "--enable_vllm_is_correction",
    "--algo.advantage.is_correction_type": "--vllm_is_correction_type",
    "--algo.advantage.is_correction_threshold": "--vllm_is_truncated_threshold",
    "--reward.stop_properly_penalty_coef": "--stop_properly_penalty_coef",
    "--actor.freeze_visual_encoder": "--freeze_visual_encoder", "--data.image_key": "--image_key",
    "--data.max_images_per_prompt": "--max_images_per_prompt",
    **{f"--{b}.lora.{k}": f"--lora_{k}" for b in ("ds", "fsdp") for k in ("rank", "alpha", "dropout")},
    **{f"--{b}.lora.target_modules": "--target_modules" for b in ("ds", "fsdp")},
    "--algo.dynamic_filtering_enable": "--dynamic_filtering",
    "--algo.dynamic_filtering_range": "--dynamic_filtering_reward_range",
    "--ds.ring_attn_size": "--ring_attn_size", "--ds.ring_attn_head_stride": "--ring_head_stride",
    "--train.agent_func_path": "--agent_func_path",
}
# dotted flags whose values map to underscore tokens: (flag, value) -> the tokens ([] for what alignrl does without
# a flag: fp32 where no precision is asked)
VALUED_SWITCHES: dict[str, dict[str, list[str]]] = {
    f"--{b}.param_dtype": {"bf16": ["--param_dtype", "bf16"], "fp16": ["--param_dtype", "fp16"], "fp32": []}
    for b in ("ds", "fsdp")}
# The dotted parser (current OpenRLHF only) defaults that differ from the 0.6-era underscore ones: a dotted command
# line gets them unless it gives the flag (dotted flag, its underscore tokens)
DOTTED_DEFAULTS = [("--algo.advantage.lambd", ["--lambd", "1.0"]), ("--critic.value_clip", ["--value_clip", "0.5"]),
                   ("--train.micro_batch_size", ["--micro_train_batch_size", "1"]),
                   ("--rollout.micro_batch_size", ["--micro_rollout_batch_size", "1"])]
PARAM_DTYPE_FLAGS = ("--ds.param_dtype", "--fsdp.param_dtype")  # current OpenRLHF's default: bf16
PROMPT_CAP = 1024  # the underscore --prompt_max_len default, the prompt cap of a dotted line without one


class DottedFlagError(ValueError):
    """A dotted flag with a value alignrl cannot follow; one line naming it and the values it takes."""


def is_dotted(argv: list[str]) -> bool:
    return any(re.match(r"--[a-z_]+\.", a) for a in argv)


def to_underscore(argv: list[str]) -> list[str]:
    """`argv` with every dotted flag in its underscore spelling (`--flag=value` and `--flag value` alike), after the
    dotted parser's own defaults when any flag is dotted (later tokens win, so a given flag overrides them)."""
    out, i, max_len = [], 0, None
    while i < len(argv):
        flag, eq, inline = argv[i].partition("=")
        if flag in VALUED_SWITCHES or flag == "--data.max_len":
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if eq else 2
            if flag == "--data.max_len":
                max_len = value
            elif value not in VALUED_SWITCHES[flag]:
                raise DottedFlagError(f"{flag} {value}: alignrl takes {' or '.join(VALUED_SWITCHES[flag])}")
            else:
                out += VALUED_SWITCHES[flag][value]
            continue
        out.append(DOTTED.get(flag, flag) + (eq + inline if eq else ""))
        i += 1
    if not is_dotted(argv):
        return out
    typed = {a.partition("=")[0] for a in argv}
    defaults = [t for flag, tokens in DOTTED_DEFAULTS if flag not in typed for t in tokens]
    if not typed & set(PARAM_DTYPE_FLAGS):
        defaults += ["--param_dtype", "bf16"]
    return defaults + out + (length_caps(max_len, argv) if max_len is not None else [])


def length_caps(max_len: str, argv: list[str]) -> list[str]:
    """--data.max_len (current OpenRLHF: prompt and response tokens in all) as the underscore caps: beside
    --rollout.max_new_tokens N, prompts get the rest (--prompt_max_len max_len - N); without it, OpenRLHF lets each
    response fill what its prompt leaves, which alignrl's one response cap bounds by the longest prompt
    (--generate_max_len max_len - the prompt cap)."""
    given = [a.partition("=")[2] or (argv[k + 1] if k + 1 < len(argv) else "") for k, a in enumerate(argv)
             if a.partition("=")[0] == "--rollout.max_new_tokens"]
    try:
        total, new = int(max_len), [int(n) for n in given]
    except ValueError:
        raise DottedFlagError(f"--data.max_len {max_len} and --rollout.max_new_tokens take numbers of tokens") from None
    if new:
        rest, what = total - new[-1], f"--rollout.max_new_tokens {new[-1]}"
        tokens = ["--prompt_max_len", str(rest)]
    else:
        rest, what = total - PROMPT_CAP, f"a prompt cap of {PROMPT_CAP} tokens"
        tokens = ["--generate_max_len", str(rest)]
    if rest < 8:  # alignrl's smallest prompt cap (data.max_prompt_length)
        raise DottedFlagError(f"--data.max_len {total} leaves {rest} tokens beside {what}: raise it")
    return tokens


def in_typed_words(message: str, argv: list[str]) -> str:
    """`message` (about underscore flags) in the spelling the user typed: when any flag was dotted, every flag is
    said dotted (as typed where it was given, else its first dotted name)."""
    if not is_dotted(argv):
        return message
    names: dict[str, str] = {}
    for dotted, underscore in DOTTED.items():
        names.setdefault(underscore, dotted)
    names.update({DOTTED[a.partition("=")[0]]: a.partition("=")[0] for a in argv if a.partition("=")[0] in DOTTED})
    return in_flag_words(message, names)  # the same renaming that says config keys as flags
