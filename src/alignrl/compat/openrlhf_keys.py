"""OpenRLHF's `train_ppo_ray` flags (cluster.flags) as alignrl config keys, and the flags given that change
nothing here, each with its reason, listed once at start.

OpenRLHF's own defaults come with its flags: its scheduler (linear warm-up over --lr_warmup_ratio of the optimizer
steps, then cosine down to 0.1 × the learning rate, for the actor and the critic; --lr_scheduler constant_with_warmup
or constant keep the rate), Adam betas (0.9, 0.95), GAE
lambda 0.95, value clip 0.2 and the reward clamped into --reward_clip_range (-10, 10) before the KL penalty.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from alignrl.compat import openrlhf_loop as L
from alignrl.compat import openrlhf_recent as R
from alignrl.compat import openrlhf_sources as S
from alignrl.compat.openrlhf_flags import (ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS, SCHEDULERS, WHITENED, data_keys,
                                   parser, uses_critic, uses_reference, wandb_on)

# flags that change nothing without GPUs (vLLM, DeepSpeed and kernel options); --zero_stage 3 still shards the
# reference group's model there (FSDP over gloo), so it is unused on CPUs only without a reference or below 3
GPU_ONLY = ("bf16", "adam_offload", "enable_prefix_caching", "vllm_gpu_memory_utilization", "vllm_sync_backend")
# flags this placement does not apply on any device: named at start, never silently dropped
RESIDENT = ("flash_attn", "vllm_enable_sleep", "deepspeed_enable_sleep", "enforce_eager")
RESIDENT_WHY = "not applied here: attention runs through PyTorch's SDPA, engines and DeepSpeed stay resident"
NOT_APPLIED = {
    "not applied here: alignrl checkpoints are HF folders with their optimizer state, every --save_steps, and "
    "the critic's always": ("save_hf_ckpt", "disable_ds_ckpt", "max_ckpt_mem", "save_value_network"),
    "not applied here: --pretrain_data files are read as they are, with no dataset split": ("pretrain_split",),
    "not applied here: a reward model's head is found by transformers": ("value_head_prefix",),
    "not applied here: wandb takes the run folder's name (--save_path; --wandb_run_name names the TensorBoard "
    "folder) and the default entity":
        ("wandb_org", "wandb_group", "wandb_run_name"),
    "not applied here: every step is logged; reference and reward models stay on their GPUs; weights reach the "
    "engines by a collective broadcast": ("logging_steps", "ref_reward_offload", "vllm_sync_with_ray"),
    "not applied here: DeepSpeed and kernel options alignrl does not use": (
        "aux_loss_coef", "zpg", "grad_accum_dtype", "disable_trace_cache", "gradient_checkpointing_use_reentrant",
        "disable_fast_tokenizer", "actor_init_on_gpu", "local_rank"),
}
# the prompt-column flags, which apply to a --prompt_data file (synthetic data has its own layout)
DATA_KEYS = ("input_key", "label_key", "input_template", "apply_chat_template")


def estimator_keys(args) -> list[str]:
    estimator, baseline = ESTIMATORS[args.advantage_estimator]
    whiten = "none" if args.advantage_estimator not in WHITENED else "center" if args.no_advantage_std_norm else "std"
    gamma = 1.0 if args.advantage_estimator in GROUP_ESTIMATORS else args.gamma
    return [f"algorithm.adv_estimator={estimator}", f"algorithm.outcome_baseline={baseline}",
            f"algorithm.whiten_advantages={whiten}", f"algorithm.gamma={gamma}"]



def kl_estimator(args) -> str:
    return "k3" if args.use_kl_estimator_k3 else KL_ESTIMATORS[args.kl_estimator]


def optimiser_keys(args, total_steps: int) -> list[str]:
    """OpenRLHF's optimiser, scheduler and PPO settings. Its warm-up is a fraction of all optimizer steps (RL steps
    × mini-batches of a step × --max_epochs), rounded up, as its `math.ceil(max_steps * lr_warmup_ratio)`."""
    per_step = args.rollout_batch_size * args.n_samples_per_prompt // args.train_batch_size * args.max_epochs
    warmup = 0 if args.lr_scheduler == "constant" else math.ceil(total_steps * per_step * args.lr_warmup_ratio)
    schedule, floor = SCHEDULERS[args.lr_scheduler]
    betas = f"[{args.adam_betas[0]},{args.adam_betas[1]}]"
    out = [f"algorithm.lam={args.lambd}", f"actor.clip_ratio_low={args.eps_clip}",
           f"actor.clip_ratio_high={args.eps_clip}", f"critic.cliprange_value={args.value_clip}",
           f"critic.warmup_steps={max(args.freezing_actor_steps, 0)}",
           f"algorithm.reward_clip=[{args.reward_clip_range[0]},{args.reward_clip_range[1]}]"]
    for role in ("actor", "critic"):
        out += [f"{role}.lr_scheduler={schedule}", f"{role}.min_lr_ratio={floor}", f"{role}.lr_warmup_steps={warmup}",
                f"{role}.betas={betas}", f"{role}.weight_decay={args.l2}", f"{role}.grad_clip={args.max_norm}"]
    if args.dual_clip is not None:
        out.append(f"actor.clip_ratio_c={args.dual_clip}")
    if args.kl_target is not None:
        out += ["algorithm.kl_ctrl_type=adaptive", f"algorithm.kl_target={args.kl_target}",
                f"algorithm.kl_horizon={args.kl_horizon}"]
    if args.entropy_loss_coef:
        out.append(f"actor.entropy_coeff={args.entropy_loss_coef}")
    if args.overlong_buffer_len:
        out += [f"algorithm.overlong_buffer_len={args.overlong_buffer_len}",
                f"algorithm.overlong_penalty_factor={args.overlong_penalty_factor}"]
    return out


def unused_here(args, gpus: bool) -> list[str]:
    """Flags given that change nothing here, each group with its reason (listed once at start): those this
    placement does not apply, GPU-only ones without CUDA, the prompt-column flags on synthetic data, and
    --input_template beside --apply_chat_template (OpenRLHF ignores it there too)."""
    defaults = vars(parser().parse_args([]))
    shards_ref = args.zero_stage == 3 and uses_reference(args)
    groups = [(RESIDENT, RESIDENT_WHY), *((names, why) for why, names in NOT_APPLIED.items()),
              (() if gpus else GPU_ONLY + (() if shards_ref else ("zero_stage",)), "no CUDA"),
              (DATA_KEYS if args.prompt_data == "synthetic" else (), "the prompts are synthetic"),
              (S.unsplit_flags(args), "not applied here: .jsonl/.json/.parquet files are read whole (a split picks "
                                      "one of a dataset folder or Hub dataset)"),
              (() if args.eval_dataset else ("eval_split",), "not applied here: without --eval_dataset the "
                                                              "evaluation reads --prompt_data's --prompt_split"),
              (("prompt_split",) if args.prompt_data == "synthetic" else (), "the prompts are synthetic"),
              (("input_template",) if args.apply_chat_template and args.prompt_data != "synthetic" else (),
               "--apply_chat_template formats the prompts"),
              (() if args.reward_pretrain or uses_critic(args) else ("normalize_reward",),
               "not applied here: it normalizes a reward model's scores and a critic's values, and this run has "
               "neither (no --reward_pretrain; no critic without --advantage_estimator gae)"),
              (() if uses_reference(args) else ("ref_pretrain",), "--init_kl_coef 0 loads no reference"),
              (("gamma",) if args.advantage_estimator in GROUP_ESTIMATORS else (),
               f"OpenRLHF sets gamma to 1 for --advantage_estimator {args.advantage_estimator}"),
              (("max_len",) if args.max_len and args.max_len < args.prompt_max_len + args.generate_max_len
               and not args.pretrain_data else (),
               "not applied here: each prompt is cut at --prompt_max_len and each response at --generate_max_len, "
               "whatever their sum (OpenRLHF's engines also stop a sequence at --max_len tokens in all)"),
              *R.recent_unused(args), *L.loop_unused(args)]
    out = []
    for names, why in groups:
        given = [f"--{f}" for f in names if getattr(args, f) != defaults[f]]
        if given:
            out.append(f"{' '.join(given)} ({why})")
    return out


def trained_keys(args) -> list[str]:
    """--lora_* and --freeze_prefix as model.lora_* and actor.freeze_prefix (JSON lists: YAML reads them too)."""
    out = []
    if args.lora_rank:
        out += [f"model.lora_rank={args.lora_rank}", f"model.lora_alpha={args.lora_alpha}",
                f"model.lora_dropout={args.lora_dropout}",
                f"model.target_modules={json.dumps(list(args.target_modules or ['all-linear']))}"]
    # --freeze_visual_encoder is --freeze_prefix visual (alignrl's "visual" matches either naming of the encoder)
    frozen = list(args.freeze_prefix or []) + (["visual"] if args.freeze_visual_encoder and "visual" not in
                                               (args.freeze_prefix or []) else [])
    if frozen:
        out.append(f"actor.freeze_prefix={json.dumps(frozen)}")
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
    out = [f"model.path={args.pretrain}", f"data.train_files={S.files_value(args.prompt_data, S.prompt_split(args))}",
           *S.probs_keys(args), prompt_cap(args),
           f"data.val_size={args.val_size}",
           f"data.val_size_during_training={args.val_size}", f"data.train_batch_size={args.rollout_batch_size}",
           f"data.max_prompt_length={args.prompt_max_len}", f"rollout.n={n}",
           f"rollout.max_new_tokens={args.generate_max_len}", f"rollout.temperature={args.temperature}",
           f"rollout.top_p={args.top_p}", f"actor.ppo_mini_batch_size={args.train_batch_size // n}",
           f"actor.ppo_micro_batch_size={args.micro_train_batch_size}", f"actor.ppo_epochs={args.max_epochs}",
           f"actor.logprob_micro_batch_size={args.micro_rollout_batch_size}",
           f"actor.use_remove_padding={args.packing_samples}", f"critic.use_remove_padding={args.packing_samples}",
           f"actor.gradient_checkpointing={args.gradient_checkpointing}",
           f"actor.lr={args.actor_learning_rate}", *estimator_keys(args), *optimiser_keys(args, total_steps),
           f"critic.enable={uses_critic(args)}",
           f"critic.lr={args.critic_learning_rate}", f"actor.use_kl_loss={kl and args.use_kl_loss}",
           f"actor.kl_loss_coef={args.init_kl_coef}", f"actor.kl_loss_type={kl_estimator(args)}",
           f"algorithm.use_kl_in_reward={kl and not args.use_kl_loss}", f"algorithm.kl_coef={args.init_kl_coef}",
           f"algorithm.kl_penalty={kl_estimator(args)}", f"trainer.seed={args.seed}",
           f"trainer.output_dir={save.parent}", f"trainer.experiment_name={save.name}",
           f"trainer.total_training_steps={total_steps}", f"trainer.save_freq={max(args.save_steps, 0)}",
           f"trainer.max_checkpoints={max(args.max_ckpt_num, 1)}",
           f"trainer.test_freq={args.eval_steps if args.eval_steps > 0 else args.test_freq}",
           f"trainer.project_name={args.wandb_project}",
           f"trainer.resume_mode={'auto' if args.load_checkpoint else 'disable'}", f"trainer.threads={args.threads}",
           "trainer.progress_bar=false",
           f"trainer.logger=[console,jsonl{',tensorboard' if args.use_tensorboard else ''}"
           f"{',wandb' if wandb_on(args) else ''}]"]  # a key given as --use_wandb never enters the config
    if args.eval_dataset or args.prompt_data != "synthetic":
        out.append(f"data.val_files={S.val_value(args)}")
    for key, value in data_keys(args).items():  # JSON-quoted: a template's text is not a YAML value, JSON's is
        out.append(f"data.{key}={value}" if isinstance(value, bool) else
                   f"data.{key}=null" if value is None else f"data.{key}={json.dumps(value)}")
    if args.use_tensorboard:  # OpenRLHF: os.path.join(args.use_tensorboard, args.wandb_run_name)
        events = Path(args.use_tensorboard).absolute() / (args.wandb_run_name or save.name)
        out.append(f"trainer.tensorboard_dir={events}")
    if args.ckpt_path:
        out.append(f"trainer.checkpoint_dir={Path(args.ckpt_path).absolute()}")
    if args.reward_pretrain:
        out.append(f"algorithm.reward_model={args.reward_pretrain}")
    if kl and args.ref_pretrain and args.ref_pretrain != args.pretrain:  # OpenRLHF loads none without a KL term
        out.append(f"model.ref_path={args.ref_pretrain}")
    # OpenRLHF builds its critic with --normalize_reward whatever scores the rows (--remote_rm_url too): the critic's
    # values are normalized by its own config.json's mean and std, the reward model's scores by theirs
    if args.normalize_reward and (args.reward_pretrain or uses_critic(args)):
        out.append("algorithm.reward_model_normalize=true")
    out += [f"actor.ema_beta={args.ema_beta}"] if args.enable_ema else []
    out += S.reward_keys(args) + S.ptx_keys(args)
    if uses_critic(args):
        critic = args.critic_pretrain or args.reward_pretrain
        if critic:
            out.append(f"critic.model_path={critic}")
    out += trained_keys(args) + R.recent_keys(args) + L.loop_keys(args)
    if gpus:
        out += ["trainer.strategy=deepspeed", f"trainer.zero_stage={args.zero_stage}",
                f"trainer.offload={args.adam_offload}", R.dtype_key(args)]
    else:  # without CUDA, FSDP2 over the actor ranks stands in for DeepSpeed's ZeRO (one rank: unsharded)
        out += ["trainer.device=cpu", "trainer.strategy=fsdp"]
    return out
