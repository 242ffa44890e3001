"""`alignrl train rloo`: TRL's RLOO command line (`trl rloo`, trl/scripts/rloo.py: its script arguments, ModelConfig
and RLOOConfig flags) as alignrl config keys, run as `alignrl train grpo` runs.

    alignrl train rloo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward --output_dir out --num_generations 4 --per_device_train_batch_size 8

The recipe is TRL's RLOOTrainer on the RL loop: algorithm.adv_estimator=rloo (each answer's reward minus the mean
of its prompt's other answers), with --beta's KL to the reference in the reward before that baseline (a sequence's
k1 summed over its tokens, algorithm.use_kl_in_reward with a fixed kl_coef, no KL loss term), the loss PPO's clip
on each answer's full likelihood ratio averaged over the answers (actor.policy_loss=seq_ppo_clip), and
--normalize_advantages as algorithm.grpo_std_scope=batch (the whole batch's mean and std + 1e-4). Everything RLOO
shares with `trl grpo` (data, model and LoRA, batches and generation rounds, optimizer, steps, checkpoints,
evaluation, logging, vLLM's flags, `--config` YAML) is read and translated by the same code (`trl_grpo_flags`,
`trl_grpo_keys`). Every default here is RLOOConfig's.
"""

from __future__ import annotations

import os
import sys

from alignrl.compat import trl_grpo_flags as F
from alignrl.compat import trl_grpo_keys as K
from alignrl.compat.trl_grpo_flags import Flag, TrlFlagError

PROG = "alignrl train rloo"
WHAT = "RLOO"
# GRPOConfig's flags RLOOConfig has not (its loss options and vLLM's importance sampling): unknown here
GRPO_ONLY = {"loss_type", "scale_rewards", "importance_sampling_level", "sapo_temperature_neg",
             "sapo_temperature_pos", "delta", "use_bias_correction_kl", "top_entropy_quantile",
             "multi_objective_aggregation", "off_policy_mask_threshold", "vespo_k_pos", "vespo_lambda_pos",
             "vespo_k_neg", "vespo_lambda_neg", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_cap", "cast_lm_head_to_fp32"}
# RLOOConfig's own, or its own defaults of GRPO's names (trl/trainer/rloo_config.py)
OWN = [Flag("num_generations", int, 2), Flag("beta", float, 0.05), Flag("normalize_advantages", "bool", False),
       Flag("reward_clip_range", "floats", None)]
_OWN = {f.name: f for f in OWN}
TAKEN = ([_OWN.get(f.name, f) for f in F.TAKEN if f.name not in GRPO_ONLY]
         + [f for f in OWN if f.name not in {g.name for g in F.TAKEN}])
NOT_APPLIED = {why: tuple(f for f in group if f.name not in GRPO_ONLY) for why, group in F.NOT_APPLIED.items()}
NOT_APPLIED["generation runs on alignrl's own engines: rollout.* keys, services.generate_url for a served one"] += (
    Flag("vllm_structured_outputs_regex", "opt_str", None),)
NOT_APPLIED["every column reaches the reward functions, and the data loads in this process"] += (
    Flag("model_init_kwargs", "opt_str", None),)
REFUSED = {name: rule for name, rule in F.REFUSED.items() if name != "max_tool_calling_iterations"}


def parser():
    return F.parser(TAKEN, NOT_APPLIED, REFUSED, PROG, "RLOO with TRL's `trl rloo` flags: each answer's reward "
                    "minus the mean of its prompt's other answers, PPO's clip on each answer's likelihood ratio "
                    "(alignrl's RL loop, algorithm.adv_estimator=rloo)")


def check(args) -> None:
    """RLOOConfig's values alignrl cannot take, or TRL itself refuses, one line each."""
    if args.num_generations < 2:
        raise TrlFlagError(f"--num_generations {args.num_generations}: RLOO needs at least 2 generations per prompt "
                           "for its leave-one-out baseline (TRL's rule)")
    if args.beta < 0:
        raise TrlFlagError(f"--beta {args.beta}: the KL coefficient is 0 (no reference) or above")
    clip = args.reward_clip_range
    if clip is not None and (len(clip) != 2 or clip[0] >= clip[1]):
        raise TrlFlagError(f"--reward_clip_range {' '.join(map(str, clip))}: give two different numbers, the lower "
                           "first (--reward_clip_range -1 1)")
    if args.sync_ref_model and args.beta == 0:
        raise TrlFlagError("--sync_ref_model moves the reference the KL penalty reads, which --beta 0.0 leaves out: "
                           "give --beta above 0, or drop it")
    if not 0 <= args.epsilon < 1 or (args.epsilon_high is not None and args.epsilon_high < 0):
        raise TrlFlagError(f"--epsilon {args.epsilon} / --epsilon_high {args.epsilon_high}: the ratio is clipped to "
                           "[1 - epsilon, 1 + epsilon_high]; give epsilon in [0, 1) and epsilon_high of 0 or more")


def loss_keys(args) -> list[str]:
    """RLOO's estimator, its KL in the reward, its loss and its options as alignrl's keys."""
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    out = ["algorithm.adv_estimator=rloo", "actor.policy_loss=seq_ppo_clip", f"actor.clip_ratio_low={args.epsilon}",
           f"actor.clip_ratio_high={high}", f"algorithm.use_kl_in_reward={str(args.beta > 0).lower()}",
           f"algorithm.kl_coef={args.beta}", "algorithm.kl_penalty=k1", "algorithm.kl_ctrl_type=fixed",
           "actor.use_kl_loss=false", "actor.entropy_coeff=0.0",
           # TRL's old log-probs (the ratio's and the KL's) are the trained model's, taken again after generation
           "actor.recompute_old_logprobs=true",
           f"algorithm.mask_truncated={str(args.mask_truncated_completions).lower()}",
           "algorithm.norm_adv_by_std_in_grpo=true",
           f"algorithm.grpo_std_scope={'batch' if args.normalize_advantages else 'group'}"]
    if args.reward_clip_range is not None:
        out.append(f"algorithm.reward_clip=[{args.reward_clip_range[0]},{args.reward_clip_range[1]}]")
    return out


def defaults_line(args) -> str:
    """RLOOConfig's defaults a line leaves out, those taken and those not."""
    quiet = {"dataset_train_split", "dataset_test_split", "per_device_eval_batch_size", "use_peft", "max_steps",
             "max_prompt_length"}  # alignrl's own cap, said on a line of its own
    quiet |= {"num_train_epochs"} if args.max_steps > 0 else set()
    quiet |= {"save_steps"} if args.save_strategy != "steps" else set()
    quiet |= set() if args.use_peft else {"lora_r", "lora_alpha", "lora_dropout", *F.FOUR_BIT}
    quiet |= set() if args.sync_ref_model else {"sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"}
    taken = [f"{f.name} {f.default}" for f in TAKEN if f.name not in args.given and f.default is not None
             and f.name not in quiet]
    not_taken = [f"{name} {why}" for name, why in K.NOT_TAKEN_DEFAULTS.items() if name not in args.given]
    return f"TRL's defaults taken: {', '.join(taken)}" + (f"; not taken: {', '.join(not_taken)}" if not_taken else "")


def from_line(words: list[str]) -> tuple[list[str], list[str]]:
    """An RLOO line (the words after the command) as alignrl's words for `train grpo` (overrides, the line's own
    key=value overrides after them, --nproc), with the start lines saying how."""
    flags, own, nproc = F.split_line(words)
    args = F.parse(flags, parser(), REFUSED, WHAT)
    check(args)
    vars(args).update(multi_objective_aggregation="sum_then_normalize")  # TRL's RLOO sums its weighted rewards
    world = nproc or int(os.environ.get("WORLD_SIZE", "1"))
    overrides, lines = K.translate(args, world, loss_keys, defaults_line, "RLOOConfig")
    if args.mask_truncated_completions:
        lines.append("--mask_truncated_completions: a truncated answer leaves the loss's count of answers here (TRL's "
                     "keeps it, at no gradient), so the others weigh a little more"
                     + ("; it also keeps its KL penalty in its reward (TRL's drops it)" if args.beta > 0 else ""))
    lines += F.unused_lines(args, NOT_APPLIED)
    return overrides + own + (["--nproc", str(nproc)] if nproc else []), lines


def main(argv: list[str] | None = None) -> int:
    from alignrl.compat.trl_config_file import run_command

    return run_command(list(sys.argv[1:] if argv is None else argv), parser(), from_line, WHAT)


if __name__ == "__main__":
    sys.exit(main())
