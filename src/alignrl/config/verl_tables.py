"""verl's and Search-R1's keys, by what alignrl does with each (`verl_keys` reads these tables): renamed to an
alignrl key, not used on this device, accepted at one value only, noted, accepted but not applied; and the verl
defaults a verl-spelled run gets where alignrl's differ."""

from __future__ import annotations

import fnmatch

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
# what a verl strategy alignrl lacks (megatron, by key, group or --config-name) is told
STRATEGIES = ("alignrl shards with FSDP2: strategy fsdp or fsdp2, verl's dp_actor / dp_critic; or with DeepSpeed ZeRO: "
              "strategy deepspeed, verl's ds_actor / ds_critic")

RENAMES: dict[str, tuple[str, ...]] = {
    "actor_rollout_ref.model.path": ("model.path",),
    A + "optim.lr": ("actor.lr",),
    A + "optim.lr_warmup_steps": ("actor.lr_warmup_steps",),
    A + "optim.lr_warmup_steps_ratio": ("actor.lr_warmup_steps_ratio",),
    A + "optim.warmup_style": ("actor.lr_scheduler",),
    A + "optim.min_lr_ratio": ("actor.min_lr_ratio",),
    A + "optim.weight_decay": ("actor.weight_decay",),
    A + "optim.betas": ("actor.betas",),
    A + "grad_clip": ("actor.grad_clip",),
    # the engine workers' spelling (verl 0.7's optim config): the same gradient-norm clip
    A + "optim.clip_grad": ("actor.grad_clip",), "critic.optim.clip_grad": ("critic.grad_clip",),
    A + "ppo_mini_batch_size": ("actor.ppo_mini_batch_size",),
    # the code reward's sandbox (docs/code.md); sandbox_fusion_url is the key's name before verl 0.4
    **{f"reward_model.sandbox_fusion.{k}": (f"sandbox.{k}",) for k in ("url", "max_concurrent", "memory_limit_mb")},
    "reward_model.sandbox_fusion_url": ("sandbox.url",),
    # the reference's and the old policy's no-grad passes: one alignrl key serves both (the last one given)
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("actor.logprob_micro_batch_size",),
    R + "log_prob_micro_batch_size_per_gpu": ("actor.logprob_micro_batch_size",),
    "actor_rollout_ref.model.use_remove_padding": ("actor.use_remove_padding",),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("actor.gradient_checkpointing",),
    # LoRA on the policy (verl's model.lora_rank > 0), the reference then being the base with adapters off
    "actor_rollout_ref.model.lora_rank": ("model.lora_rank",),
    "actor_rollout_ref.model.lora_alpha": ("model.lora_alpha",),
    "actor_rollout_ref.model.target_modules": ("model.target_modules",),
    # one LoRA setting serves the policy and the critic here (verl's recipes give both the same)
    "critic.model.lora_rank": ("model.lora_rank",),
    "critic.model.lora_alpha": ("model.lora_alpha",),
    "critic.model.target_modules": ("model.target_modules",),
    "critic.model.use_remove_padding": ("critic.use_remove_padding",),
    A + "ppo_epochs": ("actor.ppo_epochs",),
    A + "use_dynamic_bsz": ("actor.use_dynamic_bsz",),
    A + "ppo_max_token_len_per_gpu": ("actor.ppo_max_token_len",),
    A + "clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    A + "clip_ratio_low": ("actor.clip_ratio_low",),
    A + "clip_ratio_high": ("actor.clip_ratio_high",),
    A + "clip_ratio_c": ("actor.clip_ratio_c",),
    A + "tau_pos": ("actor.tau_pos",), A + "tau_neg": ("actor.tau_neg",),  # SAPO's temperatures
    A + "loss_agg_mode": ("actor.loss_agg_mode",),
    A + "entropy_coeff": ("actor.entropy_coeff",),
    A + "use_kl_loss": ("actor.use_kl_loss",),
    A + "kl_loss_coef": ("actor.kl_loss_coef",),
    A + "kl_loss_type": ("actor.kl_loss_type",),
    A + "state_masking": ("actor.state_masking",),
    R + "n": ("rollout.n",),
    R + "n_agent": ("rollout.n",),  # Search-R1 repeats each prompt n_agent times: the group size
    R + "temperature": ("rollout.temperature",),
    R + "top_p": ("rollout.top_p",),
    R + "top_k": ("rollout.top_k",),
    # a rollout key vLLM's SamplingParams also has is a sampling setting in verl's vLLM rollout (`+rollout.<key>`)
    R + "repetition_penalty": ("rollout.repetition_penalty",),
    R + "min_p": ("rollout.min_p",),
    "critic.optim.lr": ("critic.lr",),
    "critic.optim.lr_warmup_steps": ("critic.lr_warmup_steps",),
    "critic.optim.lr_warmup_steps_ratio": ("critic.lr_warmup_steps_ratio",),
    "critic.optim.weight_decay": ("critic.weight_decay",),
    "critic.optim.betas": ("critic.betas",),
    "critic.model.path": ("critic.model_path",),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_coef",),
    "algorithm.kl_ctrl.type": ("algorithm.kl_ctrl_type",),
    "algorithm.kl_ctrl.target_kl": ("algorithm.kl_target",),
    "algorithm.kl_ctrl.horizon": ("algorithm.kl_horizon",),
    "data.max_response_length": ("rollout.max_new_tokens",),
    "data.shuffle_train_dataloader": ("data.shuffle",),
    "data.val_data_num": ("data.val_size",), "data.val_max_samples": ("data.val_size",),
    "trainer.default_local_dir": ("trainer.checkpoint_dir",),
    "max_turns": ("agent.max_turns",),
    # verl's multi-turn rollout: the whole trajectory's response; data.max_response_length stays per turn (Search-R1)
    R + "response_length": ("agent.max_response_length",),
    "do_search": ("agent.search",),
}

# Settings of GPU memory, sharding, vLLM and remote storage: they change where and how fast, not what.
NOT_USED = (
    "*.fsdp_config.*", "critic.model.enable_gradient_checkpointing", "*.log_prob_micro_batch_size",
    # token budgets of the no-grad passes and the critic's (its update follows actor.ppo_max_token_len): memory only
    "*.log_prob_use_dynamic_bsz", "*.log_prob_max_token_len_per_gpu", "*.forward_max_token_len_per_gpu",
    "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "reward_model.use_dynamic_bsz",
    "*.forward_micro_batch_size*", "*.ppo_micro_batch_size_per_gpu", "*.external_lib", "*.override_config",
    "actor_rollout_ref.hybrid_engine", "actor_rollout_ref.ref.strategy", A + "optim.total_training_steps",
    "critic.optim.total_training_steps", "critic.optim.min_lr_ratio", "critic.ppo_micro_batch_size",
    "critic.model.tokenizer_path", R + "name", R + "gpu_memory_utilization", R + "tensor_model_parallel_size",
    R + "dtype", R + "enforce_eager", R + "free_cache_engine", R + "load_format", R + "max_num_batched_tokens",
    R + "max_num_seqs", R + "prompt_length", R + "enable_chunked_prefill",
    # verl's LoRA recipes: the model through shared memory, the merged weights summoned layer by layer
    "actor_rollout_ref.model.use_shm", R + "layered_summon",
    # the reward model's forward and its reward-loop server (engine, memory, parallelism, length caps); fp8 rollout
    # weights (vLLM speed); debug dumps; Hydra's own output folder
    "reward_model.model.use_remove_padding", "reward_model.rollout.*", R + "quantization.*", "trainer.dump_high_diff_*",
    "reward.reward_model.rollout.*", "reward.reward_model.enable_resource_pool", "reward.reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes",
    "hydra.*",
    # spellings verl itself never reads: a GLM script's data.enable_thinking (verl reads apply_chat_template_kwargs),
    # a misspelt activation offload
    "data.enable_thinking", "actor_rollout_ref.model.enable_activation_offloading",
    "data.filter_overlong_prompts_workers", "reward_model.overlong_buffer.log",
    "reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size", "reward_model.use_reward_loop",
    "reward_model.num_workers", "reward_model.strategy", "reward_model.launch_reward_fn_async",
    "trainer.default_hdfs_dir", "data.val_batch_size", "data.tokenizer", "data.return_raw_input_ids",
    "data.return_raw_chat", "trainer.val_generations_to_log_to_wandb",
    "trainer.log_freq",  # verl's SPIN recipe: console lines every N steps (alignrl logs each step)
    # verl 0.7: vLLM's memory, weight transfer and CUDA graphs; kernels, compilation and memory of the trainer's
    # forwards (the same numbers up to rounding); sharding (fsdp.*: current verl's spelling of fsdp_config), rank
    # balancing, Ray, timeouts, profiling and logging; which tensors a checkpoint holds (alignrl's hold what a
    # resume needs); `calculate_log_probs`: alignrl always keeps the rollout's log-probs
    R + "enable_sleep_mode", R + "checkpoint_engine.*", R + "update_weights_bucket_megabytes",
    R + "multi_stage_wake_up", R + "engine_kwargs.*", R + "trace.*", R + "cudagraph_capture_sizes",
    R + "max_model_len", R + "disable_log_stats", R + "calculate_log_probs", R + "agent.num_workers",
    "actor_rollout_ref.model.use_fused_kernels", "actor_rollout_ref.model.fused_kernel_options.*",
    "*.enable_activation_offload", "actor_rollout_ref.model.use_liger", "*.entropy_checkpointing",
    "*.entropy_from_logits_with_chunking", "*.use_torch_compile", "*.override_config.*", "*.fsdp.*",
    "actor_rollout_ref.nccl_timeout", "*.checkpoint.*", "*.profiler.*", "global_profiler.*", "ray_kwargs.*",
    "ray_init.*",  # verl's older spelling of ray_kwargs.ray_init
    "actor_rollout_ref.model.lora.merge", "trainer.balance_batch",
    # which of verl's worker classes hosts the roles (its legacy FSDP / DeepSpeed workers or its engine workers): the
    # same training either way, and alignrl has one trainer of its own
    "trainer.use_legacy_worker_impl",
    # verl's DeepSpeed engine besides its ZeRO stage and offload (read by verl_groups): precision, parameter offload
    # (verl's own is off unless an environment switch allows it at ZeRO-3), NVMe folder, token budgets, compilation
    "*.deepspeed.*", "*.deepspeed_config.*",
    "trainer.ray_wait_register_center_timeout", "trainer.esi_redundant_time",
    "data.dataloader_num_workers", "data.use_shm", "data.return_full_prompt", "data.validation_shuffle",
    "reward_model.inference.*", "reward_model.reward_kwargs.overlong_buffer_cfg.log",
    "reward.reward_kwargs.overlong_buffer_cfg.log",
)
# verl 0.7's trainer.device (cuda, npu) picks the accelerator's kind; alignrl's trainer.device (auto, cpu, cuda) is
# its own key, so verl's value passes through and only npu, which alignrl has no backend for, is refused there.

# Another spelling of a key mapped above: main_ppo's DAPO reward manager takes its overlong buffer through
# reward_kwargs; current verl names the reward model's folder model_path.
ALIASES = {f"{section}.reward_kwargs.overlong_buffer_cfg.{k}": "reward_model.overlong_buffer." + k
           for section in ("reward_model", "reward") for k in ("enable", "len", "penalty_factor")} | {
    "reward_model.model_path": "reward_model.model.path",
    "reward.reward_kwargs.max_resp_len": "reward_model.reward_kwargs.max_resp_len"} | {
    # the newest verl's reward section, which its main_ppo migrates the legacy keys into (migrate_legacy_reward_impl)
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_model.enable": "reward_model.enable", "reward.reward_model.model_path": "reward_model.model.path",
    "reward.num_workers": "reward_model.num_workers",
    **{f"reward.sandbox_fusion.{k}": f"reward_model.sandbox_fusion.{k}"
       for k in ("url", "max_concurrent", "memory_limit_mb")}}

# verl's policy_loss.loss_mode -> alignrl's actor.policy_loss; the other policy_loss.* keys tune Clip-Cov and KL-Cov
# (alignrl's actor.<the same name>)
LOSS_MODES = {"vanilla": "ppo_clip", "gspo": "gspo", "cispo": "cispo",  # cispo: clipped by clip_ratio_low/high
              "gpg": "gpg", "geo_mean": "gmpo", "clip_cov": "clip_cov", "kl_cov": "kl_cov", "sapo": "sapo",
              "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl"}
LOSS_MODE_TUNING = tuple(A + "policy_loss." + k for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                                                          "kl_cov_ratio", "ppo_kl_coef"))

# verl 0.7's algorithm.rollout_correction (algorithm/rollout_correction.yaml), key -> the value that leaves it off;
# every one is read by verl_recent.rollout_correction.
RC = "algorithm.rollout_correction."
ROLLOUT_CORRECTION_OFF: dict[str, object] = {
    RC + "rollout_is": None, RC + "rollout_is_threshold": 2.0, RC + "rollout_rs": None,
    RC + "rollout_rs_threshold": None, RC + "rollout_rs_threshold_lower": None,
    RC + "rollout_token_veto_threshold": None, RC + "bypass_old_logprob_for_rollout": False,
    RC + "use_pure_rollout_correction": False, RC + "rollout_is_batch_normalize": False,
    # current verl's names of the two above, and the loss its bypass mode trains with
    RC + "bypass_mode": False, RC + "use_policy_gradient": False, RC + "loss_type": "ppo_clip",
}

# verl features alignrl does not have: key pattern -> (the feature, the values that leave it off). A value that
# leaves it off is accepted quietly; any other is named at start as a feature not applied, never dropped silently.
MISSING: dict[str, tuple[str, tuple[object, ...]]] = {
    "*.ulysses_sequence_parallel_size": ("Ulysses sequence parallelism", (1,)),
}

# Sections that exist only in verl's config: a key under them that is not mapped above is unknown.
VERL_SECTIONS = ("actor_rollout_ref.", "critic.optim.", "critic.model.", "algorithm.kl_ctrl.", "reward_model.",
                 "custom_reward_function.", RC, "reward.")

# verl's data.prompt_key is alignrl's key of the same name, so it passes through unchanged: a verl file read
# by column keeps its data_source, reward_model.ground_truth and extra_info (alignrl.data.row_formats).

# Switches accepted at the value alignrl implements; (value, what to do instead of the other value).
ONLY_VALUE: dict[str, tuple[object, str]] = {
    "trainer.val_only": (False, "alignrl has no evaluation-only mode; run with trainer.total_training_steps=1 "
                                "and read base_accuracy"),
    "algorithm.no_think_rl": (False, "drop it: the no-think variant of Search-R1 is not implemented"),
    "actor_rollout_ref.model.custom_chat_template": (None, "save the template with the model's tokenizer "
                                                           "(tokenizer.chat_template, chat_template.jinja) instead"),
    "data.train_data_num": (None, "cut the training file to the rows you want (data.train_data_num=null uses all)"),
    R + "do_sample": (True, "training rollouts sample; evaluation is greedy"),
    R + "ignore_eos": (False, "generation always stops at eos"),
    "critic.optim.warmup_style": ("constant", "the critic's lr is constant after its warm-up"),
    R + "mode": ("async", "alignrl's engines batch every prompt of a step; verl 0.7 removed the sync mode too"),
}
# verl's validation sampler (rollout.val_kwargs): ours is rollout.val_*; do_sample=false (verl's default) is greedy
VAL_KWARGS = {R + "val_kwargs.temperature": "rollout.val_temperature", R + "val_kwargs.top_p": "rollout.val_top_p",
              R + "val_kwargs.top_k": "rollout.val_top_k", R + "val_kwargs.n": "rollout.val_n",
              R + "val_kwargs.do_sample": None}
# DAPO (recipe/dapo) as verl spells it -> alignrl's keys (algorithm.dynamic_sampling, the overlong penalty)
DAPO = {"algorithm.filter_groups.enable": "algorithm.dynamic_sampling",
        "reward_model.overlong_buffer.len": "algorithm.overlong_buffer_len",
        "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_penalty_factor"}
# filter_groups.metric: alignrl keeps the groups whose rewards differ, which is verl's seq_reward; acc and score are
# the same numbers for a rule reward (the score is the reward)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
# verl's reward managers alignrl's reward stage is: the rule reward (naive), with DAPO's overlong buffer (dapo)
REWARD_MANAGERS = ("naive", "dapo", "prime", "batch", "gdpo", "naive_gdpo")  # prime: naive's scores over worker
# processes, each row at most 300 s (algorithm.reward_timeout_s); batch: the custom function scores the whole batch in
# one call (algorithm.reward_fn_batch); gdpo: naive's, whose dicts' keys algorithm.adv_estimator=gdpo reads (every
# dict's numbers ride along with its score here, whatever the manager)

# Accepted, with alignrl's behaviour named when the value asks for something else (it evaluates before and
# after training to report base and final accuracy). trainer.final_validation is not Search-R1's (its verl
# always validates after the last step) but verl forks' scripts pass it.
NOTED = {"trainer.val_before_train": "alignrl always evaluates before training (base_accuracy)",
         "trainer.final_validation": "alignrl always evaluates after training (final_accuracy)"}

_FORMAT_REWARD = ("alignrl scores Search-R1's QA data sources with plain exact match, as Search-R1 validates; for "
                  "v0.3's format credits give algorithm.reward_fn=FILE.py:FUNCTION returning alignrl.rewards.qa_em."
                  "compute_score_format(solution_str, ground_truth, structure_format_score, final_format_score, "
                  "retrieval_score) (README.md, section 'From verl / Search-R1', has the file)")
_SHUFFLE = ("alignrl draws each epoch's mini-batches in a seeded random order (Search-R1's FSDP workers split the "
            "batch in order whatever this says)")
_MARKER = ("the loss mask comes from the rollout: the observation tokens the engine appends, inside <information> "
           "tags (Search-R1's generation manager builds its mask the same way and never reads these markers)")
# Keys of Search-R1's ppo_trainer.yaml alignrl has no setting for: (the value alignrl behaves as, why another
# value is not applied). A value alignrl follows anyway is accepted quietly; any other is listed once at start,
# since a run must not drop a setting without saying so.
NOT_APPLIED: dict[str, tuple[object, str]] = {
    A + "shuffle": (True, _SHUFFLE),
    "critic.shuffle": (True, _SHUFFLE),
    "algorithm.state_masking.start_state_marker": ("<information>", _MARKER),
    "algorithm.state_masking.end_state_marker": ("</information>", _MARKER),
    "reward_model.structure_format_score": (0, _FORMAT_REWARD),
    "reward_model.final_format_score": (0, _FORMAT_REWARD),
    "reward_model.retrieval_score": (0, _FORMAT_REWARD),
    # verl computes it for its optimal token baselines (so does alignrl, whenever one is the estimator: there the key
    # is applied, verl_keys._sum_pi_squared) and, beside any other estimator, for metrics alone
    A + "calculate_sum_pi_squared": (False, "alignrl computes the per-token sum of squared probabilities for the "
                                            "optimal token baselines alone: verl's variance-proxy metrics are not "
                                            "logged"),
}
# verl's critic settings whose default is the actor's (ppo_trainer.yaml: ${actor_rollout_ref.actor.<key>}):
# alignrl's critic always trains on the actor's mini-batches and epochs, so only another value is listed.
CRITIC_FOLLOWS_ACTOR = {"critic.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
                        "critic.ppo_epochs": "actor.ppo_epochs"}
# verl's checkpoint retention (null: keep every one): one alignrl checkpoint holds actor and critic together
CKPT_TO_KEEP = ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep")

# Keys only Search-R1's verl (0.1) reads: a run that gives one gets Search-R1's defaults, any other verl-spelled
# run verl 0.7's (`verl_keys.verl_defaults`).
def search_r1_spelled(overrides) -> bool:
    """Whether the overrides give a key only Search-R1's verl reads: they get that verl's behaviour, else 0.7's."""
    given = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    return any(fnmatch.fnmatchcase(k, pattern) for k in given for pattern in SEARCH_R1_ONLY)


SEARCH_R1_ONLY = (R + "n_agent", A + "state_masking", "max_turns", "do_search", "retriever.*", "algorithm.state_masking.*",
                  "reward_model.structure_format_score", "reward_model.final_format_score",
                  "reward_model.retrieval_score", "algorithm.no_think_rl", "data.max_start_length",
                  "data.max_obs_length")

# Search-R1's verl defaults where alignrl's differ (verl/trainer/config/ppo_trainer.yaml and
# ray_trainer.py): no KL loss, KL in the reward instead (verl applies it whenever use_kl_loss is off),
# an entropy bonus, AdamW weight decay, nucleus 0.95, a critic exactly when the estimator is GAE, and every
# checkpoint kept; a multi-turn episode is cut at data.max_prompt_length tokens (its generation manager's
# right side). The critic's AdamW decays at 0.01 in both verls (Search-R1's FSDP workers default it so).
SEARCH_R1_DEFAULTS: dict[str, object] = {
    "algorithm.adv_estimator": "gae",  # PPO with a critic (and one response a prompt: verl_defaults)
    "trainer.strategy": "fsdp",  # verl's actor and critic strategy: FSDP over the ranks (alignrl's fsdp2)
    "trainer.max_checkpoints": 0,  # Search-R1's verl never deletes a checkpoint; alignrl's default keeps 2
    "actor.use_kl_loss": False,
    "actor.entropy_coeff": 0.001,
    "actor.weight_decay": 0.01,
    "critic.weight_decay": 0.01,
    "rollout.top_p": 0.95,
}
# verl 0.7's (verl/trainer/config/_generated_ppo_trainer.yaml): no KL loss and no KL in the reward, no entropy
# bonus, full nucleus, token-mean losses, weight decay 0.01 for both optimizers, every checkpoint kept (max ckpt to
# keep null); its vanilla loss dual-clips at 3.0 (added by verl_defaults only where alignrl's loss is ppo_clip).
VERL07_DEFAULTS: dict[str, object] = {
    "algorithm.adv_estimator": "gae",
    "trainer.strategy": "fsdp",
    "trainer.max_checkpoints": 0,
    "actor.use_kl_loss": False,
    "algorithm.use_kl_in_reward": False,
    "actor.entropy_coeff": 0.0,
    "actor.weight_decay": 0.01,
    "critic.weight_decay": 0.01,
    "actor.loss_agg_mode": "token-mean",
    "rollout.top_p": 1.0,
}
VERL07_CLIP_RATIO_C = 3.0
