"""Typed run configuration: frozen dataclasses, one per section, with help text and ranges in `metadata`.

The metadata drives validation (`alignrl.config.checks`) and the README's config reference
(`alignrl config --reference`). This module imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignrl.config.option import opt
from alignrl.config.model_schema import ModelConfig  # noqa: F401 (re-exported)
# re-exported: the config package's names
from alignrl.config.placement_schema import AgentConfig, PipelineConfig, RetrieverConfig, ServicesConfig  # noqa: F401
from alignrl.config.data_schema import DataConfig  # noqa: F401 (re-exported)
from alignrl.config.critic_schema import CriticConfig, SafetyConfig
from alignrl.config.ptx_schema import PtxConfig
from alignrl.config.sandbox_schema import SandboxConfig
from alignrl.config.trainer_schema import TrainerConfig  # noqa: F401 (re-exported)
from alignrl.errors import ConfigError  # noqa: F401 (the config package's error, defined below it for runtime/)


@dataclass(frozen=True)
class RolloutConfig:
    n: int = opt(8, "samples per prompt (the GRPO group size)", ge=1)
    temperature: float = opt(1.0, "sampling temperature", gt=0.0)
    top_p: float = opt(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    top_k: int = opt(-1, "keep the k most likely tokens; -1 disables (vLLM convention)", ge=-1)
    min_p: float = opt(0.0, "tokens less likely than min_p x the likeliest one are not drawn; 0 disables (vLLM's, "
                            "TRL's --min_p)", ge=0.0, le=1.0)
    repetition_penalty: float = opt(1.0, "> 1: tokens already in the prompt or the response are drawn less often "
                                         "(vLLM's and HF's; TRL's --repetition_penalty); 1 disables", gt=0.0)
    max_new_tokens: int = opt(64, "response length limit (verl's data.max_response_length)", ge=1)
    stop: list = opt([], "extra stop strings; generation also stops at the tokenizer's eos")
    val_temperature: float = opt(0.0, "held-out evaluation: 0 decodes greedily; > 0 samples val_n answers a problem "
                                       "at this temperature (accuracy: their mean; pass@val_n beside it), as verl's "
                                       "rollout.val_kwargs", ge=0.0)
    val_top_p: float = opt(1.0, "held-out sampling: nucleus mass", gt=0.0, le=1.0)
    val_top_k: int = opt(-1, "held-out sampling: top-k; -1 disables", ge=-1)
    val_n: int = opt(1, "held-out sampling: answers per problem (needs val_temperature > 0)", ge=1)


# the policy losses that read actor.clip_ratio_c: PPO's dual clip, DPPO's truncation of the ratio
CLIP_C_LOSSES = ("ppo_clip", "dppo_tv", "dppo_kl")
# each prompt's two answers a pair, trained by its loss's gradient (core.online_dpo, core.nash_md); under xpo the
# second answer is the reference model's, under nash_md the mixture's of policy and reference; under spin the first is
# the row's target response (its ground truth) and the second the reference's
PAIR_ESTIMATORS = ("online_dpo", "xpo", "nash_md", "spin")
REFERENCE_ANSWERS = ("xpo", "nash_md", "spin")  # the pairs whose second answer the reference model samples


@dataclass(frozen=True)
class ActorConfig:
    lr: float = opt(1e-6, "AdamW learning rate", gt=0.0)
    lr_warmup_steps: int = opt(0, "linear warm-up steps (optimizer steps)", ge=0)
    lr_warmup_steps_ratio: float = opt(0.0, "warm-up as a fraction of trainer.total_training_steps (verl's "
                                            "optim.lr_warmup_steps_ratio); used when lr_warmup_steps is 0",
                                       ge=0.0, le=1.0)
    lr_scheduler: str = opt("constant", "schedule after warm-up", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = opt(0.0, "floor of the cosine or linear decay as a fraction of lr", ge=0.0, le=1.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    betas: list = opt([0.9, 0.999], "AdamW betas")
    grad_clip: float = opt(1.0, "max global grad norm; 0 disables", ge=0.0)
    ppo_mini_batch_size: int = opt(32, "prompts per optimizer step (× rollout.n sequences), as in verl; sequences "
                                       "with ppo_mini_batch_unit=sequences", ge=1)
    ppo_mini_batch_unit: str = opt("prompts", "what ppo_mini_batch_size counts: prompts (each with its rollout.n "
                                              "samples, verl's meaning) or sequences (Search-R1's with "
                                              "rollout.n_agent > 1; a mini-batch may then cut a prompt's group)",
                                   choices=("prompts", "sequences"))
    ppo_micro_batch_size: int = opt(64, "sequences per forward/backward (gradient accumulation unit)", ge=1)
    use_dynamic_bsz: bool = opt(False, "update micro-batches by a token budget (ppo_max_token_len) instead of "
                                       "ppo_micro_batch_size: the same gradients, less padding on long-tailed lengths")
    ppo_max_token_len: int = opt(16384, "dynamic batch size: tokens per micro-batch and rank, padding included "
                                        "(rows x longest row); the critic's too", ge=1)
    logprob_micro_batch_size: int = opt(0, "sequences per no-grad forward (reference and old-policy log-probs, "
                                           "critic values); 0: ppo_micro_batch_size. OpenRLHF's "
                                           "--micro_rollout_batch_size, verl's *.log_prob_micro_batch_size_per_gpu",
                                        ge=0)
    ppo_epochs: int = opt(1, "passes over each rollout batch", ge=1)
    clip_ratio_low: float = opt(0.2, "PPO clip: ratio >= 1 - clip_ratio_low (GSPO's paper: 3e-4 on its "
                                                "sequence ratio; CISPO: 1.0 or more, no lower bound on the IS weight, "
                                                "as verl's CISPO scripts' 10)", ge=0.0)
    clip_ratio_high: float = opt(0.2, "PPO clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher and CISPO use "
                                                  "0.28; GSPO's paper 4e-4)", ge=0.0)
    policy_loss: str = opt("ppo_clip", "ppo_clip (PPO / DAPO clip-higher / dual-clip), gspo (sequence-level "
                                       "ratio), cispo (clipped IS weight, stop-gradient), gpg (-A log pi, no ratio), "
                                       "gmpo (geometric mean of the token ratios, clipped in log space), "
                                       "clip_cov / kl_cov (PPO with the gradient of the few tokens of highest "
                                       "advantage-log-prob covariance removed / the unclipped ratio with a KL "
                                       "penalty on them), sapo (a smooth gate of the ratio instead of the clip), "
                                       "dppo_tv / dppo_kl (the gradient kept while the token's probability stays "
                                       "within a total variation / binary KL of clip_ratio_low/high of the old one), "
                                       "luspo (gspo's term times each sequence's length, sequences averaged), vespo "
                                       "(-sg[phi(w)] A log pi, phi a gamma weight of the sequence ratio w), "
                                       "seq_ppo_clip (PPO's clip on each sequence's full likelihood ratio, "
                                       "sequences averaged: TRL's RLOO loss)",
                           choices=("ppo_clip", "gspo", "cispo", "gpg", "gmpo", "clip_cov", "kl_cov", "sapo", "dppo_tv",
                                    "dppo_kl", "luspo", "vespo", "seq_ppo_clip"))
    clip_ratio_c: float = opt(0.0, "dual-clip constant c > 1 bounding the loss of negative advantages; 0 disables "
                                   "(dppo_tv / dppo_kl: the truncation of their importance ratio, 0: 20)",
                              ge=0.0)
    clip_ratio_delta: float | None = opt(None, "ppo_clip, gspo, luspo: two-sided clipping (TRL's --delta): the "
                                               "unclipped ratio term is capped at delta (> 1 + clip_ratio_high), so "
                                               "a token of negative advantage whose ratio passed it has no gradient; "
                                               "null: off", gt=1.0)
    top_entropy_quantile: float = opt(1.0, "the policy term trains only the tokens whose entropy is in this top "
                                           "share of each micro-batch's (over every rank), the others counting 0 in "
                                           "its mean; the KL and entropy terms keep every token (TRL's "
                                           "--top_entropy_quantile; \"Beyond the 80/20 Rule\": 0.2); 1.0: every "
                                           "token", ge=0.0, le=1.0)
    off_policy_mask_threshold: float | None = opt(None, "a sequence of negative advantage whose mean of log "
                                                        "pi_rollout - log pi over its trained tokens (those the "
                                                        "rollout correction keeps) exceeds this leaves the policy "
                                                        "term (DeepSeek-V3.2's off-policy sequence masking; TRL's "
                                                        "--off_policy_mask_threshold); null: off")
    vespo_k_pos: float = opt(2.0, "vespo: shape k of phi(w) = e^lambda w^k e^(-lambda w) where A >= 0", ge=0.0)
    vespo_lambda_pos: float = opt(3.0, "vespo: rate lambda of phi where A >= 0 (below 1e-4: 1e-4, as TRL's)", ge=0.0)
    vespo_k_neg: float = opt(3.0, "vespo: shape k of phi where A < 0", ge=0.0)
    vespo_lambda_neg: float = opt(2.0, "vespo: rate lambda of phi where A < 0 (below 1e-4: 1e-4)", ge=0.0)
    # Clip-Cov / KL-Cov (Cui et al. 2025): restrain the tokens whose log-prob moves most with their advantage
    clip_cov_ratio: float = opt(2e-4, "clip_cov: share of a micro-batch's tokens whose gradient is removed, drawn "
                                      "among those whose covariance lies in (clip_cov_lb, clip_cov_ub)", gt=0.0, le=1.0)
    clip_cov_lb: float = opt(1.0, "clip_cov: lower bound of the covariance of the tokens drawn")
    clip_cov_ub: float = opt(5.0, "clip_cov: upper bound of the covariance of the tokens drawn")
    kl_cov_ratio: float = opt(2e-4, "kl_cov: share of a micro-batch's tokens, those of largest covariance, that get "
                                    "the ppo_kl_coef * |log ratio| penalty", gt=0.0, le=1.0)
    ppo_kl_coef: float = opt(0.1, "kl_cov: weight of the |log ratio| penalty (verl's default)", ge=0.0)
    tau_pos: float = opt(1.0, "sapo: temperature of the gate of tokens with a positive advantage", gt=0.0)
    tau_neg: float = opt(1.05, "sapo: temperature of the gate of the other tokens", gt=0.0)
    loss_agg_mode: str = opt("auto", "how token losses (policy, KL and entropy terms) become one number; the "
                                     "policy term of gspo, sapo and seq_ppo_clip averages sequences whatever this "
                                     "says (as verl's), luspo's sums each sequence's tokens; auto: seq-mean-token-sum for luspo, "
                                     "seq-mean-token-mean for gspo and sapo (sequence-level objectives), "
                                     "token-mean otherwise (seq-mean-token-sum-norm divides by the "
                                     "response cap, rollout.max_new_tokens or a multi-turn "
                                     "agent.max_response_length: Dr.GRPO)",
                             choices=("auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"))
    entropy_coeff: float = opt(0.0, "entropy bonus coefficient", ge=0.0)
    use_kl_loss: bool = opt(True, "add a KL(policy || reference) term to the loss (GRPO)")
    kl_loss_coef: float = opt(0.001, "weight of the KL term", ge=0.0)
    kl_loss_type: str = opt("k3", "KL estimator (verl aliases: kl=k1, mse=k2, low_var_kl=k3)",
                            choices=("k1", "k2", "k3", "kl", "mse", "low_var_kl"))
    kl_loss_ratio_weighted: bool = opt(False, "the KL term's per-token estimate times the ratio pi / pi_old, "
                                              "gradient through both: an unbiased KL of the current policy from "
                                              "tokens the old one sampled (TRL's --use_bias_correction_kl, from "
                                              "DeepSeek-V3.2)")
    ema_beta: float = opt(0.0, "an exponential moving average of the policy's weights, moved by 1 - ema_beta after "
                               "every optimizer step and saved in each checkpoint's ema/ folder (OpenRLHF's "
                               "--enable_ema --ema_beta: 0.992); 0: none", ge=0.0, le=0.9999)
    ref_sync_steps: int = opt(0, "every N updates the reference moves toward the policy: ref = ref_mixup_alpha x "
                                 "policy + (1 - alpha) x ref (TR-DPO; TRL's sync_ref_model with ref_model_sync_steps)"
                                 "; 0: the reference stays the base model", ge=0)
    ref_mixup_alpha: float = opt(0.6, "with actor.ref_sync_steps: the policy's share of each reference weight at a "
                                      "sync (TRL's ref_model_mixup_alpha; 1 copies the policy)", gt=0.0, le=1.0)
    state_masking: bool = opt(True, "multi-turn: tool-observation tokens are attended but never trained on "
                                    "(policy loss, entropy, KL, critic); verl/Search-R1's actor.state_masking")
    recompute_old_logprobs: bool = opt(True, "recompute old log-probs with the trainer; false reuses the "
                                             "rollout engine's (exact when both are the same fp32 model)")
    share_prompt: bool = opt(False, "run each distinct prompt of a micro-batch through the model once and share "
                                    "its keys/values among its samples (rollout.n), in the update and in the "
                                    "reference and old-policy forwards (the same log-probs and gradients up to "
                                    "float rounding, less compute when prompts are long); mini-batches then take "
                                    "whole prompts' samples instead of rows drawn one by one")
    use_remove_padding: bool = opt(False, "pack a micro-batch's real tokens into one row for the update and the "
                                          "reference and old-policy forwards, so no matmul runs on padding "
                                          "(verl's model.use_remove_padding, OpenRLHF's --packing_samples); the same "
                                          "log-probs and gradients up to float rounding; needs a transformers model "
                                          "whose attention dispatches through AttentionInterface (Llama, Qwen2/3); "
                                          "micro-batches holding images take the plain forward")
    freeze_prefix: list = opt([], "parameters whose names start with one of these are not trained: no gradient, "
                                  "no optimizer state, not re-sent to rollout engines (OpenRLHF's --freeze_prefix: "
                                  "visual freezes a vision model's image encoder)")
    gradient_checkpointing: bool = opt(False, "recompute each transformer layer's activations in the backward "
                                              "instead of keeping them (OpenRLHF's --gradient_checkpointing, verl's "
                                              "model.enable_gradient_checkpointing): less memory, about a third "
                                              "more compute, the same gradients")

    @property
    def forward_micro_batch(self) -> int:
        """Sequences per no-grad forward: logprob_micro_batch_size, or ppo_micro_batch_size when it is 0."""
        return self.logprob_micro_batch_size or self.ppo_micro_batch_size


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = opt("grpo", "advantage estimator: grpo (GRPO/Dr.GRPO), rloo (leave-one-out), "
                                     "reinforce_plus_plus (whitened returns), reinforce_plus_plus_baseline, remax "
                                     "(greedy baseline), gpg (GPG's scaled group baseline), gdpo (each of "
                                     "gdpo_reward_keys normalized in its group, summed, whitened: verl's GDPO), opo "
                                     "(group baseline weighted by response length: verl's OPO), grpo_passk (only "
                                     "each group's best response learns, best minus second best, divided by the "
                                     "group std under norm_adv_by_std_in_grpo: verl's pass@k GRPO), "
                                     "rloo_vectorized (verl's name of rloo), grpo_vectorized (grpo, always divided "
                                     "by the std, as verl's), optimal_token_baseline (per-token reward-to-go minus "
                                     "a per-step group baseline weighted by each path's summed score variance "
                                     "1 - 2 pi(a) + sum pi^2 from the trainer's old-log-prob forward, run even "
                                     "with actor.recompute_old_logprobs=false: verl's OTB), "
                                     "tir_optimal_token_baseline (the same over each response's trained tokens "
                                     "aligned: verl's multi-turn OTB), gae (PPO with critic.enable=true), online_dpo "
                                     "(each prompt's two answers a DPO pair, the higher reward chosen: TRL's online "
                                     "DPO, with dpo_beta and dpo_loss_type), xpo (online DPO between the policy's "
                                     "answer and the reference model's, with an exploration term xpo_alpha: TRL's "
                                     "XPO), nash_md (the policy's answer against one of the geometric mixture of "
                                     "policy and reference, mixture_coef: TRL's Nash-MD), spin (each row's target "
                                     "response, its ground truth, chosen over the reference model's answer: SPIN, "
                                     "with actor.ref_sync_steps and ref_mixup_alpha=1 for its iterations)",
                             choices=("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                                      "gpg", "gdpo", "opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized",
                                      "optimal_token_baseline", "tir_optimal_token_baseline", "gae", "online_dpo",
                                      "xpo", "nash_md", "spin"))
    dpo_beta: float = opt(0.1, "adv_estimator=online_dpo, xpo, nash_md or spin: the loss's beta, the strength of its pull "
                               "toward the reference (TRL's --beta)", gt=0.0)
    dpo_loss_type: str = opt("sigmoid", "adv_estimator=online_dpo or xpo: sigmoid (DPO's -log sigmoid(beta h)) or ipo "
                                        "((h - 1/(2 beta))^2), h the pair's policy-minus-reference log-ratio gap "
                                        "(TRL's --loss_type)", choices=("sigmoid", "ipo"))
    xpo_alpha: float = opt(1e-5, "adv_estimator=xpo: the weight of XPO's exploration term, alpha times the policy's "
                                 "summed log-prob of the reference model's answer added to each pair's loss, which "
                                 "pushes the policy away from what the reference already says (TRL's --alpha)",
                           ge=0.0)
    mixture_coef: float = opt(0.5, "adv_estimator=nash_md: c of the geometric mixture pi^(1-c) pi_ref^c the second "
                                   "answer of each prompt is sampled from (TRL's --mixture_coef)", ge=0.0, le=1.0)
    gamma: float = opt(1.0, "discount of GAE and REINFORCE++ returns", ge=0.0, le=1.0)
    lam: float = opt(1.0, "GAE lambda", ge=0.0, le=1.0)
    norm_adv_by_std_in_grpo: bool = opt(True, "divide by the group std; false, with actor.loss_agg_mode="
                                                      "seq-mean-token-sum-norm, gives Dr.GRPO")
    grpo_std_scope: str = opt("group", "grpo with norm_adv_by_std_in_grpo: the std the group-centred rewards are "
                                       "divided by: group (each prompt's own) or batch (the whole batch's, over "
                                       "every rank, + 1e-4: TRL's --scale_rewards batch); rloo: batch normalizes "
                                       "the advantages by the whole batch's mean and std + 1e-4 (TRL's RLOO "
                                       "--normalize_advantages), group leaves them",
                              choices=("group", "batch"))
    multi_objective_aggregation: str = opt("sum_then_normalize", "a reward of several TRL functions (reward_fn="
                                           "trl:...): sum_then_normalize sums them, then GRPO normalizes; "
                                           "normalize_then_sum normalizes each in its prompt group first (GDPO), "
                                           "with grpo_std_scope=batch", choices=("sum_then_normalize",
                                                                                  "normalize_then_sum"))
    gdpo_reward_keys: list = opt([], "adv_estimator=gdpo: the keys of the dict the reward function returns (verl's "
                                     "compute_score: {'score': s, 'format_reward': f, ...}) each normalized apart")
    gdpo_reward_weights: list = opt([], "adv_estimator=gdpo: each key's weight in the sum (empty: 1 each)")
    outcome_baseline: str = opt("none", "reinforce_plus_plus: shape each outcome reward with its prompt's group "
                                        "before the per-token KL penalty and the returns-to-go, as OpenRLHF's "
                                        "estimators do: loo (its rloo), mean (reinforce_baseline, dr_grpo), "
                                        "mean_std (group_norm)", choices=("none", "loo", "mean", "mean_std"))
    whiten_advantages: str = opt("std", "reinforce_plus_plus and gae: batch normalisation of the advantages: std "
                                        "(whiten), center (mean only: OpenRLHF's --no_advantage_std_norm), none "
                                        "(OpenRLHF's group_norm and dr_grpo)", choices=("std", "center", "none"))
    use_kl_in_reward: bool = opt(False, "subtract kl_coef × KL(policy || reference) from every token's reward "
                                        "(InstructGPT-style), instead of or beside actor.use_kl_loss")
    kl_penalty: str = opt("k1", "KL estimator of the reward penalty (verl aliases: kl=k1, mse=k2, low_var_kl=k3)",
                          choices=("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"))
    kl_ctrl_type: str = opt("fixed", "reward-penalty coefficient: fixed, or adaptive toward kl_target "
                                     "(Ziegler et al. 2019)", choices=("fixed", "adaptive"))
    kl_coef: float = opt(0.001, "initial reward-penalty KL coefficient", ge=0.0)
    kl_target: float = opt(0.1, "adaptive controller: target per-token KL", gt=0.0)
    kl_horizon: float = opt(10000.0, "adaptive controller: horizon in samples", gt=0.0)
    reward_clip: list = opt([], "[low, high]: each outcome reward clamped into it before the KL penalty and the "
                                "advantages (OpenRLHF's --reward_clip_range); empty: none")
    reward_fn: str | None = opt(None, "custom reward 'path/to/file.py:function' (verl compute_score signature); "
                                      "zero: no task reward (on-policy distillation's reward is its KL term)")
    reward_fn_kwargs: dict[str, Any] = opt({}, "keyword arguments algorithm.reward_fn is called with beside its four "
                                               "(verl's custom_reward_function.reward_kwargs)")
    reward_fn_batch: bool = opt(False, "algorithm.reward_fn scores a whole batch in one call: fn(data_sources=, "
                                       "solution_strs=, ground_truths=, extra_infos=) returns a list of scores "
                                       "(verl's reward_manager=batch)")
    reward_timeout_s: float = opt(0.0, "rule rewards: each row's limit in seconds; rows are scored side by side in "
                                       "worker processes and a row past the limit scores 0, its worker replaced "
                                       "(verl's reward_manager=prime: 300); 0: scored here, no limit", ge=0.0)
    reward_workers: int = opt(0, "with algorithm.reward_timeout_s: the worker processes; 0: the usable cores", ge=0)
    reward_model: str = opt("", "reward-model folder (from `alignrl train rm`): its score is the reward; the rule "
                                "reward still measures accuracy")
    reward_model_normalize: bool = opt(False, "the reward model's score as (score - mean) / std, with the mean and "
                                              "std of its config.json (`alignrl train rm` writes its held-out "
                                              "scores', as OpenRLHF's reward trainer), and the critic's values by "
                                              "the mean and std of its own config.json (one initialised from the "
                                              "reward model has them); OpenRLHF's --normalize_reward")
    reward_model_mix: str = opt("replace", "with a reward model (a folder or services.reward_url): replace uses its "
                                           "score alone; add adds the rule reward on rows whose data has an answer "
                                           "(verl's hybrid); sum adds it on every row (TRL's reward model among "
                                           "--reward_funcs)", choices=("replace", "add", "sum"))
    reward_model_weight: float = opt(1.0, "the reward model's score times this (TRL's --reward_weights, the model's "
                                          "first)")
    reward_model_retemplate: bool = opt(False, "the reward model has its own tokenizer (verl's reward_model.model."
                                               "input_tokenizer): each prompt's messages and the decoded response go "
                                               "through its chat template; one with the policy's scores the ids")
    reward_model_max_length: int = opt(0, "re-templated reward-model inputs keep their first N tokens (verl's "
                                          "reward_model.max_length); 0: data.max_prompt_length + the response cap",
                                       ge=0)
    format_reward_weight: float = opt(0.0, "weight of the '#### N' format reward added to correctness", ge=0.0)
    dynamic_sampling: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal (zero "
                                        "advantage) and generate more prompts until data.train_batch_size groups "
                                        "remain (verl's algorithm.filter_groups.enable)")
    dynamic_sampling_range: list = opt([], "dynamic sampling: [low, high] keeps the groups whose mean reward is "
                                           "strictly between them instead of those whose rewards differ (the same "
                                           "for rewards in [low, high]; OpenRLHF's --dynamic_filtering_reward_range)"
                                           "; empty: rewards differ")
    max_gen_rounds: int = opt(3, "dynamic sampling: extra generation rounds per step at most; if still short, "
                                 "train on the groups kept (verl's max_num_gen_batches, minus the first)", ge=0)
    overlong_buffer_len: int = opt(0, "DAPO soft overlong punishment: the last N tokens before "
                                      "the response cap (rollout.max_new_tokens; multi-turn: "
                                      "agent.max_response_length) cost a reward falling linearly to "
                                      "-overlong_penalty_factor; 0 disables", ge=0)
    overlong_penalty_factor: float = opt(1.0, "reward penalty of a response as long as the response cap",
                                         ge=0.0)
    truncated_reward_coef: float | None = opt(None, "responses cut at the response cap (no eos): a coefficient "
                                                      ">= 0 scales their reward by it, one < 0 replaces the reward "
                                                      "by it, after the overlong penalty (ProRL; OpenRLHF's "
                                                      "--stop_properly_penalty_coef); null leaves them")
    missing_eos_penalty: float = opt(0.0, "subtracted from the reward of a response cut at the response cap "
                                          "before it ended (TRL's --missing_eos_penalty); 0: none", ge=0.0)
    mask_truncated: bool = opt(False, "responses that hit rollout.max_new_tokens get no gradient (DAPO overlong "
                                      "filtering); they still count in the reward and length metrics")
    rollout_is: str = opt("none", "truncated importance sampling against the rollout engine's log-probs: "
                                  "one weight per token or per sequence (needs actor.recompute_old_logprobs)",
                          choices=("none", "token", "sequence"))
    rollout_is_threshold: float = opt(2.0, "rollout IS weights above this are truncated or masked", gt=0.0)
    rollout_is_threshold_lower: float | None = opt(None, "mask: weights below this are masked too (default "
                                                         "1/rollout_is_threshold); truncate: raised to it (OpenRLHF's "
                                                         "tis clamps to [low, high]; default: not raised)", ge=0.0)
    rollout_is_mode: str = opt("truncate", "truncate: min(w, threshold) (TIS); mask: tokens (or sequences) "
                                           "whose weight is outside [lower, threshold] leave the loss and its "
                                           "token count, as verl's rejection sampling; geo_mask (rollout_is=token): "
                                           "a sequence whose geometric-mean weight is outside leaves whole, the "
                                           "others keep their token weights (OpenRLHF's seq-mask-tis); zero: "
                                           "weights outside are 0, every token stays (verl's IcePop)",
                               choices=("truncate", "mask", "geo_mask", "zero"))
    rollout_is_batch_normalize: bool = opt(False, "rollout IS weights divided by their mean over the global batch's "
                                                  "tokens (rollout_is=token) or sequences, after truncation (verl's)")
    rollout_rs: str = opt("none", "rejection sampling against the rollout's log-probs, beside or without rollout_is: "
                                  "token, sequence, geometric (tokens, or sequences by the product or geometric mean "
                                  "of their ratios, outside [rollout_rs_threshold_lower, rollout_rs_threshold]), or "
                                  "current verl's options token_k1, seq_mean_k1, seq_max_k2, ... (comma-separated)")
    rollout_rs_threshold: Any = opt(None, "rollout_rs: upper bound of the kept ratios (null: rollout_is_threshold); "
                                          "for verl's options its spec: lower_upper for k1, one upper bound else")
    rollout_rs_threshold_lower: float | None = opt(None, "rollout_rs: lower bound; null: 1/upper", ge=0.0)
    rollout_token_veto_threshold: float | None = opt(None, "a sequence with a token whose ratio pi_trainer/pi_rollout "
                                                           "is below this leaves the loss whole (verl's veto); null: "
                                                           "none", gt=0.0)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def mini_batch_sequences(self) -> int:
        """Sequences per optimizer step over all ranks (actor.ppo_mini_batch_size in its unit)."""
        a = self.actor
        return a.ppo_mini_batch_size * (self.rollout.n if a.ppo_mini_batch_unit == "prompts" else 1)

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer's, the old policy's and the reference's log-probs are taken at: the sampling
        temperature, as verl's and TRL's GRPO take them, or 1 for online DPO, XPO, Nash-MD and SPIN, whose loss reads the models' own
        distributions, as TRL's online DPO reads them."""
        return 1.0 if self.algorithm.adv_estimator in PAIR_ESTIMATORS else self.rollout.temperature

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps of one epoch over an RL step's batch: the last mini-batch is smaller when the batch is
        not a multiple of the mini-batch, as verl splits it."""
        return -(-self.data.train_batch_size * self.rollout.n // self.mini_batch_sequences)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir) / self.trainer.experiment_name

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / self.trainer.checkpoint_dir

    @property
    def log_root(self) -> Path:
        return self.run_dir / self.trainer.log_dir
