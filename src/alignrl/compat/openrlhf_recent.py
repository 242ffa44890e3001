"""The `train_ppo_ray` flags OpenRLHF added after 0.6 (0.7-0.9 and its current, dotted spelling): precision and
attention by name, clip-higher, GSPO, held-out sampling, token-budget micro-batches, importance-sampling correction
against the engine's log-probs, and the vision-language data flags. Their checks and their alignrl config keys;
`openrlhf_flags` adds them to its parser, `openrlhf_keys` to its overrides.
"""

from __future__ import annotations

import json

from alignrl.config import ConfigError

# OpenRLHF's --param_dtype -> alignrl's model.dtype (on CUDA; a CPU run trains in float32 whatever is asked)
PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# OpenRLHF's default token budget per GPU of --use_dynamic_batch (--train_max_tokens_per_gpu)
OPENRLHF_TRAIN_TOKENS = 16192
# OpenRLHF's [low, high] default of --vllm_is_truncated_threshold since it took a pair (with the correction types);
# before (0.8), one number, 2, the upper bound of truncated IS
IS_PAIR_DEFAULT = (0.5, 5.0)
IS_SINGLE_DEFAULT = 2.0
# the attention implementations alignrl runs (PyTorch's SDPA); any other is listed as not applied
SDPA = (None, "sdpa")


class RecentFlagError(ConfigError):
    """A post-0.6 OpenRLHF flag with a value alignrl cannot follow; one line naming it and the fix."""


def add_recent_flags(g) -> None:
    """The post-0.6 flags, OpenRLHF's names and meanings; None defaults mean 'not given'."""
    g.add_argument("--param_dtype", default=None, choices=("bf16", "fp16"),
                   help="training and rollout dtype on CUDA (OpenRLHF 0.8+; --bf16 before); CPU runs use float32")
    g.add_argument("--attn_implementation", default=None,
                   help="accepted; attention runs through PyTorch's SDPA here")
    g.add_argument("--eps_clip_low_high", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="asymmetric PPO clip (DAPO clip-higher): ratio in [1 - LOW, 1 + HIGH]; replaces --eps_clip")
    g.add_argument("--policy_loss_type", default="ppo", choices=("ppo", "gspo"),
                   help="gspo: sequence-level ratios (GSPO) instead of token-level PPO")
    g.add_argument("--eval_temperature", type=float, default=None, help="held-out sampling temperature")
    g.add_argument("--eval_n_samples_per_prompt", type=int, default=None, help="held-out answers per problem")
    g.add_argument("--stop_properly_penalty_coef", type=float, default=None,
                   help="rewards of responses cut at the length cap: scaled by C >= 0, replaced by C < 0")
    g.add_argument("--use_dynamic_batch", action="store_true",
                   help="update micro-batches by a token budget (--train_max_tokens_per_gpu) instead of a row count")
    g.add_argument("--train_max_tokens_per_gpu", type=int, default=None,
                   help=f"token budget per update micro-batch and GPU (default {OPENRLHF_TRAIN_TOKENS})")
    g.add_argument("--rollout_max_tokens_per_gpu", type=int, default=None,
                   help="token budget of the no-grad forwards (not applied: they take --micro_rollout_batch_size rows)")
    g.add_argument("--enable_vllm_is_correction", "--vllm_enable_is_correction", dest="enable_vllm_is_correction",
                   action="store_true", help="importance-sampling correction against the engine's log-probs")
    g.add_argument("--vllm_is_truncated_threshold", type=float, nargs="+", default=None, metavar="T",
                   help="one number: the upper truncation bound (OpenRLHF 0.8); two: [low, high] (later)")
    g.add_argument("--vllm_is_correction_type", default=None, choices=("tis", "icepop", "seq-mask-tis"),
                   help="tis: clamp token weights into [low, high]; icepop: drop tokens whose weight leaves it; "
                        "seq-mask-tis: drop sequences whose geometric-mean weight leaves it")
    g.add_argument("--use_icepop", action="store_true",
                   help="OpenRLHF's older switch of --vllm_is_correction_type icepop")
    g.add_argument("--freeze_visual_encoder", action="store_true", help="the vision encoder does not train "
                   "(as --freeze_prefix visual)")
    g.add_argument("--image_key", default=None, help="column of a row's images (alignrl's default: images)")
    g.add_argument("--max_images_per_prompt", type=int, default=None,
                   help="accepted; alignrl's engines take every image of a prompt")
    g.add_argument("--async_train", action="store_true",
                   help="accepted; on the Ray placement each step trains on the batch its own weights generated")
    g.add_argument("--async_queue_size", type=int, default=None, help="accepted with --async_train")


def check_recent(args) -> None:
    """The post-0.6 flags' values, one line each."""
    if args.eps_clip_low_high is not None and min(args.eps_clip_low_high) < 0:
        raise RecentFlagError(f"--eps_clip_low_high {args.eps_clip_low_high[0]} {args.eps_clip_low_high[1]}: both "
                              "bounds must be >= 0 (the ratio is clipped to [1 - LOW, 1 + HIGH])")
    threshold = args.vllm_is_truncated_threshold
    if threshold is not None and (len(threshold) > 2 or min(threshold) < 0 or threshold[-1] <= 0 or
                                  (len(threshold) == 2 and threshold[0] >= threshold[1])):
        raise RecentFlagError("--vllm_is_truncated_threshold takes HIGH or LOW HIGH with 0 <= LOW < HIGH and HIGH > 0")
    for flag in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu", "max_images_per_prompt",
                 "eval_n_samples_per_prompt"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise RecentFlagError(f"--{flag} must be at least 1")
    if args.use_icepop and args.vllm_is_correction_type not in (None, "icepop"):
        raise RecentFlagError(f"--use_icepop with --vllm_is_correction_type {args.vllm_is_correction_type}: "
                              "--use_icepop is the older spelling of --vllm_is_correction_type icepop; give one")


def correction_type(args) -> str | None:
    """The IS-correction type asked for: --vllm_is_correction_type, else icepop with OpenRLHF's older --use_icepop
    (which took the [low, high] pair too), else None (OpenRLHF's tis)."""
    return args.vllm_is_correction_type or ("icepop" if args.use_icepop else None)


def dtype_key(args) -> str:
    """model.dtype on CUDA: --param_dtype, else --bf16, else float32."""
    if args.param_dtype:
        return f"model.dtype={PARAM_DTYPES[args.param_dtype]}"
    return f"model.dtype={'bfloat16' if args.bf16 else 'float32'}"


def is_weights(args) -> tuple[str, float, float | None]:
    """(rollout_is_mode, upper bound, lower bound or None) of the IS-correction flags: tis clamps the weights into
    [low, high] (a one-number threshold is OpenRLHF 0.8's upper bound alone), icepop drops the tokens outside,
    seq-mask-tis the sequences whose geometric-mean weight is outside (their other tokens keep their own weights)."""
    given = args.vllm_is_truncated_threshold
    kind = correction_type(args) or "tis"
    if given is None:  # the correction type came with the [low, high] pair; the bare switch is 0.8's truncation at 2
        low, high = IS_PAIR_DEFAULT if correction_type(args) else (None, IS_SINGLE_DEFAULT)
    else:
        low, high = (given[0], given[1]) if len(given) == 2 else (None, given[0])
    if kind in ("icepop", "seq-mask-tis"):  # tokens, or whole sequences by their weights' geometric mean, dropped
        return "mask" if kind == "icepop" else "geo_mask", high, low if low is not None else 0.0
    return "truncate", high, low or None  # a low bound of 0 raises nothing


def recent_keys(args) -> list[str]:
    """alignrl config keys of the post-0.6 flags (model.dtype is the device-dependent dtype_key)."""
    out = []
    if args.eps_clip_low_high is not None:  # OpenRLHF: it replaces --eps_clip on both sides
        out += [f"actor.clip_ratio_low={args.eps_clip_low_high[0]}", f"actor.clip_ratio_high={args.eps_clip_low_high[1]}"]
    if args.policy_loss_type == "gspo":
        out.append("actor.policy_loss=gspo")
    if args.eval_temperature is not None:
        out.append(f"rollout.val_temperature={args.eval_temperature}")
    if args.eval_n_samples_per_prompt is not None:
        out.append(f"rollout.val_n={args.eval_n_samples_per_prompt}")
    if args.use_dynamic_batch:
        out += ["actor.use_dynamic_bsz=true",
                f"actor.ppo_max_token_len={args.train_max_tokens_per_gpu or OPENRLHF_TRAIN_TOKENS}"]
    if args.enable_vllm_is_correction:
        mode, high, low = is_weights(args)
        out += ["algorithm.rollout_is=token", f"algorithm.rollout_is_mode={mode}",
                f"algorithm.rollout_is_threshold={high}", "actor.recompute_old_logprobs=true"]
        if low is not None:
            out.append(f"algorithm.rollout_is_threshold_lower={low}")
    if args.stop_properly_penalty_coef is not None:
        out.append(f"algorithm.truncated_reward_coef={args.stop_properly_penalty_coef}")
    if args.image_key:
        out.append(f"data.image_key={json.dumps(args.image_key)}")
    return out


def recent_unused(args) -> list[tuple[tuple[str, ...], str]]:
    """(flags, reason) groups of post-0.6 flags given that change nothing here."""
    budgets = ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu")
    out = [(("attn_implementation",) if args.attn_implementation not in SDPA else (),
            "not applied here: attention runs through PyTorch's SDPA"),
           (("max_images_per_prompt",), "not applied here: alignrl's engines take every image of a prompt"),
           (("rollout_max_tokens_per_gpu",) if args.use_dynamic_batch else budgets,
            "not applied here: the no-grad forwards take --micro_rollout_batch_size rows" if args.use_dynamic_batch
            else "a token budget applies with --use_dynamic_batch only, as in OpenRLHF")]
    if args.async_train or args.async_queue_size is not None:
        out.append((("async_train", "async_queue_size"), "not applied here: on the Ray placement generation and "
                    "training take turns, each step on the policy that generated its batch (pipeline.placement=zmq "
                    "with pipeline.max_staleness=1 overlaps them)"))
    if not args.enable_vllm_is_correction:
        out.append((("vllm_is_truncated_threshold", "vllm_is_correction_type", "use_icepop"),
                    "not applied without --enable_vllm_is_correction"))
    return out


def is_vlm(args) -> bool:
    """A vision-language policy: --train_vlm (LMM-R1's older flag), or the model folder's config.json has a
    vision_config, which current LMM-R1 and OpenRLHF scripts rely on without any flag."""
    from alignrl.models.vision import is_vision_folder

    return bool(getattr(args, "train_vlm", False)) or (args.pretrain != "demo" and is_vision_folder(args.pretrain))
