"""The flat configs of `alignrl train rm|dpo` (and the keys every offline trainer shares), read by
`preference.cli`: the keys the torchrun scripts' users edit, each with its default, range and meaning. Nothing here
imports torch."""

from __future__ import annotations

from dataclasses import dataclass
import math
from string import Formatter
from typing import Any

from alignrl.config import ConfigError, opt
from alignrl.config.model_schema import STORAGE_DTYPES


class LossNames(tuple):
    """A set of DPO loss names. `loss_type in names` for a list loss_type (TRL's multi-loss DPO) asks whether any of
    its losses is one of them, or, with `every`, all of them; "sft" (the chosen NLL, a part of every kind of list) is
    not counted."""

    every: bool

    def __new__(cls, names: tuple[str, ...], every: bool = False):
        self = super().__new__(cls, names)
        self.every = every
        return self

    def __contains__(self, item) -> bool:
        if not isinstance(item, (list, tuple)):
            return tuple.__contains__(self, item)
        named = [n for n in item if n != "sft"]
        return bool(named) and (all if self.every else any)(tuple.__contains__(self, n) for n in named)


# the DPO-family losses of `alignrl.core.preference.DPO_LOSSES` (a test holds the two equal); `safe` is the older
# name of safe_odpo, kept for the configs that spell it so. A list passes the choices check when all its losses do.
DPO_LOSS_NAMES = LossNames(("safe_mm_dpo", "safe_odpo", "sigmoid", "cdpo", "ipo", "ipo_token_mean", "hinge", "safe",
                            "robust", "exo_pair", "nca_pair", "sppo_hard", "aot", "aot_pair", "apo_zero", "apo_down",
                            "discopop", "bco_pair", "simpo", "cpo", "orpo"), every=True)
SMOOTHED_LOSSES = LossNames(("sigmoid", "cdpo", "robust", "exo_pair", "aot", "aot_pair", "simpo", "cpo"))
# the losses of the policy alone (TRL's CPOTrainer and ORPOTrainer): no reference model is loaded
REFERENCE_FREE = LossNames(("simpo", "cpo", "orpo"), every=True)
# a response's log-probability (the policy's and the reference's) is its token mean
LENGTH_NORMALISED = LossNames(("simpo", "orpo", "ipo_token_mean"), every=True)
SAFETY_LOSSES = ("safe_mm_dpo", "safe_odpo")  # the losses that read the two scorers
# TRL DPOTrainer's own losses: its use_weighting and ld_alpha act on them (not on the safety losses, nor on the CPO
# and ORPO trainers' simpo, cpo and orpo)
TRL_DPO_LOSSES = LossNames(tuple(n for n in DPO_LOSS_NAMES if n not in (*SAFETY_LOSSES, "safe", "simpo", "cpo",
                                                                          "orpo")), every=True)
# the losses of DPO's logits h, which an f-divergence other than reverse_kl changes (TRL's; the others read the
# log-ratios themselves)
F_DIVERGENCE_LOSSES = LossNames(("sigmoid", "cdpo", "robust", "exo_pair", "hinge", "ipo", "ipo_token_mean"))
F_DIVERGENCES = ("reverse_kl", "js_divergence", "alpha_divergence")  # alignrl.core.dpo_options (no torch here)


@dataclass(frozen=True)
class CommonConfig:
    model_path: str = opt("demo", "base model: an HF causal-LM folder, or 'demo' (the embedded tiny Qwen2)")
    output_dir: str | None = opt(None, "where the trained model folder is written (--output_dir)")
    logging_dir: str | None = opt(None, "metrics.jsonl and tensorboard/ (--logging_dir); default logs/training/<the "
                                        "output folder's name>, without --output_dir logs/training/<task>_rm (rm) "
                                        "or logs/training/dpo (dpo)")
    batch_size: int = opt(8, "preference pairs per device per micro-batch", ge=1)
    eval_batch_size: int = opt(16, "pairs per device per evaluation forward", ge=1)
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step", ge=1)
    train_batch_size: int = opt(0, "the global batch (OpenRLHF's --train_batch_size): sets gradient_accumulation_steps "
                                   "to train_batch_size / (batch_size × ranks) once the ranks are known; 0: "
                                   "gradient_accumulation_steps as given", ge=0)
    max_length: int = opt(256, "tokens of prompt + response (prompt keeps at most half, from its end)", ge=8)
    learning_rate: float = opt(1e-4, "peak AdamW learning rate", gt=0.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", ge=0.0)
    adam_betas: list = opt([0.9, 0.999], "AdamW's β1 and β2 (OpenRLHF: --adam_betas, its default 0.9 0.95)")
    warmup_ratio: float = opt(0.1, "fraction of optimizer steps of linear warm-up", ge=0.0, le=1.0)
    warmup_steps: int = opt(0, "optimizer steps of linear warm-up; when > 0 it replaces warmup_ratio", ge=0)
    lr_scheduler: str = opt("cosine", "learning-rate decay after warm-up (down to min_lr_ratio)",
                            choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = opt(0.1, "floor of the cosine or linear decay, as a fraction of the peak lr",
                               ge=0.0, le=1.0)
    grad_clip: float = opt(1.0, "max global grad norm; 0 disables", ge=0.0)
    epochs: int = opt(1, "passes over the training pairs", ge=1)
    max_steps: int = opt(0, "stop after this many optimizer steps; 0: run all epochs", ge=0)
    max_train_pairs: int = opt(0, "use only the first N training pairs of each file; 0: all", ge=0)
    train_files_probs: list = opt([], "one weight per training file: the files' rows blended by them as OpenRLHF's "
                                      "--dataset_probs blends datasets (drawn by weight with seed, a file that runs "
                                      "out starting again until every file has run out once); []: concatenated")
    max_eval_pairs: int = opt(0, "use only the first N held-out pairs of each file; 0: all", ge=0)
    seed: int = opt(42, "seed of the data order and of new score heads")
    strategy: str = opt("ddp", "training engine (ddp is one process without torchrun)",
                        choices=("single", "ddp", "fsdp2", "deepspeed"))
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (strategy=deepspeed)", choices=(0, 1, 2, 3))
    gradient_checkpointing: bool = opt(False, "recompute activations in backward (less memory, more time)")
    bf16: str = opt("auto", "bfloat16 mixed precision: auto = on when the GPU supports it; fp32 on CPU",
                    choices=("auto", "true", "false"))
    log_every: int = opt(5, "print and record training metrics every N optimizer steps", ge=1)
    max_nonfinite_updates: int = opt(3, "optimizer steps in a row skipped for a non-finite loss or gradient norm "
                                        "after which training stops, saving nothing", ge=1)
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)
    report_to: list = opt(["jsonl", "tensorboard"], "metric sinks under logging_dir: jsonl, tensorboard")
    use_lora: bool = opt(False, "train LoRA adapters (peft) instead of all weights (Safe-MM-DPO configs: use_lora)")
    lora_rank: int = opt(16, "LoRA rank r (Safe-MM-DPO configs: lora.r)", ge=1)
    lora_alpha: int = opt(32, "LoRA alpha: the adapter's update is scaled by alpha/r (lora.alpha)", ge=1)
    lora_dropout: float = opt(0.1, "dropout on the adapters' input (lora.dropout)", ge=0.0, le=0.9)
    lora_target_modules: Any = opt("all-linear", "modules that get adapters: a list of names, all-linear (every "
                                                 "linear layer of the blocks: q/k/v/o/gate/up/down_proj in "
                                                 "Llama-like models), or peft-default (PEFT's choice for the "
                                                 "architecture: TRL's --use_peft without --lora_target_modules)")
    lora_export: str = opt("merged", "what the saved folder holds with use_lora: merged (a plain HF model, adapters "
                                     "folded in) or adapter (peft's adapter folder)", choices=("merged", "adapter"))
    load_in_4bit: bool = opt(False, "QLoRA: the frozen base loads with its linear layers quantized to 4 bits "
                                    "(bitsandbytes, bnb_4bit_quant_type codes) under the LoRA adapters (needs "
                                    "use_lora; strategy single or ddp; the saved folder is the adapter's: "
                                    "lora_export=adapter)")
    bnb_4bit_quant_type: str = opt("nf4", "the 4-bit codes of load_in_4bit: nf4 (NormalFloat, QLoRA's) or fp4",
                                   choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = opt(True, "with load_in_4bit, quantize the blocks' scales again (about 0.4 bits "
                                                "a weight saved; OpenRLHF's setting)")
    bnb_4bit_quant_storage: str = opt("uint8", "the dtype load_in_4bit packs its 4-bit codes in: the same codes and "
                                               "results in any of them (TRL's --bnb_4bit_quant_storage)",
                                      choices=STORAGE_DTYPES)
    eval_steps: float = opt(0, "also measure the held-out pairs every N optimizer steps (eval/* metrics); below 1: "
                               "that share of the run's steps (TRL's ratio form); 0: only "
                             "before and after training", ge=0)
    eval_strategy: str = opt("steps", "when the held-out pairs are also measured during training: every eval_steps "
                                      "(steps), at each epoch's end (epoch), never (no); before and after training "
                                      "always", choices=("no", "steps", "epoch"))
    save_steps: float = opt(0, "also write a resumable checkpoint every N optimizer steps (weights, optimizer; λ for "
                               "safe_mm_dpo; where: checkpoint_layout); below 1: that share of the run's steps "
                               "(TRL's ratio form); 0: only the final model", ge=0)
    save_strategy: str = opt("steps", "when checkpoints are written: every save_steps (steps), at each epoch's end "
                                      "(epoch), never (no)", choices=("steps", "epoch", "no"))
    save_total_limit: int = opt(0, "keep only the newest N checkpoints, the older deleted once a new one is written "
                                   "(TRL's --save_total_limit, OpenRLHF's --max_ckpt_num, verl's max_ckpt_to_keep); "
                                   "0: all", ge=0)
    checkpoint_dir: str | None = opt(None, "the checkpoints' folder (OpenRLHF's --ckpt_path); default "
                                           "<output_dir>.checkpoints, with checkpoint_layout trl or verl output_dir")
    checkpoint_layout: str = opt("alignrl", "checkpoint folders step_N (alignrl), TRL's checkpoint-N with the model "
                                            "as an HF folder in each and one at the last step (trl), verl's "
                                            "global_step_N with global_step_N/huggingface (verl)",
                                 choices=("alignrl", "trl", "verl"))
    resume_from: str | None = opt(None, "a checkpoint folder to go on from (same config); auto: the newest in the "
                                        "checkpoints' folder, or the base model when there is none; latest: the "
                                        "newest, and none is an error")
    chat_template_kwargs: dict[str, Any] = opt({}, "extra variables of the chat template wherever a pair's prompt is "
                                                   "templated, e.g. {enable_thinking: false} for Qwen3 (the RL runs' "
                                                   "data.chat_template_kwargs; verl's apply_chat_template_kwargs)")
    input_template: str | None = opt(None, "without the chat template (apply_chat_template=false), a string prompt is "
                                           "this text with the prompt at its one {}, and a row is OpenRLHF's text: "
                                           "prompt + response, trailing newlines dropped, ' ' + eos appended, no bos "
                                           "(OpenRLHF's --input_template, e.g. 'User: {}\\nAssistant: '; '{}': the "
                                           "prompt as it is); null: TRL's text. Ignored with the chat template, as "
                                           "OpenRLHF ignores it; rows of chat messages are refused with it")

    def __post_init__(self) -> None:
        check_input_template(self.input_template)


def check_input_template(template: str | None) -> None:
    """One `{}` where the prompt goes and no other field (`str.format` fills it, as OpenRLHF's does)."""
    if template is None:
        return
    try:
        slots = [(name, spec, conv) for _, name, spec, conv in Formatter().parse(template) if name is not None]
    except ValueError:
        slots = []
    if slots != [("", "", None)]:
        raise ConfigError(f"input_template={template!r} must hold one {{}} where the prompt goes and no other braces "
                          "(write a literal brace as {{ or }}), e.g. input_template='User: {}\\nAssistant: '")


@dataclass(frozen=True)
class PairColumnsConfig(CommonConfig):
    """The columns of a preference file's TRL-layout rows (OpenRLHF's --prompt_key, --chosen_key, --rejected_key);
    PKU-SafeRLHF's and the Safe-MM-DPO project's rows keep their own names."""

    prompt_key: str = opt("prompt", "column of a pair's prompt (OpenRLHF: --prompt_key); a row without it takes "
                                    "the shared beginning of its two responses as the prompt")
    chosen_key: str = opt("chosen", "column of the preferred response (OpenRLHF: --chosen_key)")
    rejected_key: str = opt("rejected", "column of the dispreferred response (OpenRLHF: --rejected_key)")
    apply_chat_template: bool = opt(True, "a string prompt through the tokenizer's chat template as a user turn with "
                                          "the generation prompt (OpenRLHF's --apply_chat_template); false: as text, "
                                          "TRL's way or with input_template OpenRLHF's. Prompts of chat messages "
                                          "always go through it")


@dataclass(frozen=True)
class RMConfig(PairColumnsConfig):
    task: str = opt("helpful", "which preference data (--task): helpful or harmless", choices=("helpful", "harmless"))
    model_type: str = opt("auto", "reward (Bradley-Terry) or cost (Safe RLHF cost model); auto: helpful → reward, "
                                  "harmless → cost", choices=("auto", "reward", "cost"))
    helpful_train_file: str = opt("builtin:helpful", "helpful training pairs (.jsonl/.parquet or builtin:NAME)")
    helpful_eval_file: str = opt("builtin:helpful_test", "helpful held-out pairs")
    harmless_train_file: str = opt("builtin:harmless", "harmless training pairs (with safety labels for a cost model)")
    harmless_eval_file: str = opt("builtin:harmless_test", "harmless held-out pairs")
    learning_rate: float = opt(2e-4, "peak AdamW learning rate", gt=0.0)
    tokenizer_name: str | None = opt(None, "tokenizer folder when it is not model_path's (Safe-MM-DPO configs: "
                                           "tokenizer_name)")
    classification_loss_weight: float = opt(1.0, "cost model: weight of Safe RLHF's per-response sign term "
                                                 "-log σ(s·c) beside the pairwise term", ge=0.0)


@dataclass(frozen=True)
class DPOConfig(PairColumnsConfig):
    ref_model_path: str | None = opt(None, "frozen reference model; default: the initial weights of model_path")
    train_files: list = opt(["builtin:helpful", "builtin:harmless"], "preference files trained on (concatenated)")
    eval_files: list = opt(["builtin:helpful_test", "builtin:harmless_test"], "held-out preference files")
    prefer: str = opt("better", "PKU-SafeRLHF rows: which id is 'chosen'", choices=("better", "safer"))
    loss_type: Any = opt("safe_mm_dpo", "DPO-family loss (safe is the older name of safe_odpo; ipo_token_mean: TRL's "
                                        "ipo, on token means); a list, e.g. "
                                        "[sigmoid,bco_pair,sft], trains the weighted sum of its losses (TRL's "
                                        "multi-loss DPO, MPO; sft: the chosen responses' NLL)", choices=DPO_LOSS_NAMES)
    loss_weights: list = opt([], "a list loss_type's weights, one per loss (TRL's loss_weights); []: 1.0 each")
    beta: float = opt(0.1, "β: strength of the KL anchor to the reference (IPO: τ; safe_mm_dpo: β_ori)", gt=0.0)
    logp_reduction: str = opt("sum", "a response's log-probability: sum over its tokens (DPO's), or sequence_mean: "
                                     "the mean over prompt and response tokens (the reference Safe-MM-DPO script's)",
                              choices=("sum", "sequence_mean"))
    label_smoothing: float = opt(0.0, "sigmoid/cdpo, robust, exo_pair, aot, aot_pair: probability that a label is "
                                      "flipped (conservative DPO)", ge=0.0, le=0.5)
    discopop_tau: float = opt(0.05, "discopop: τ of the blend σ(β·h/τ) (TRL's discopop_tau)", gt=0.0)
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin γ in -log σ(β·(ā_c - ā_r) - γ) (TRL's "
                                  "simpo_gamma)")
    nll_loss_coef: float = opt(0.0, "weight of the chosen responses' negative log-likelihood (each response's token "
                                    "mean) beside the preference loss (RPO; OpenRLHF's --nll_loss_coef, TRL's "
                                    "rpo_alpha; TRL's CPOTrainer's cpo_alpha)", ge=0.0)
    precompute_ref_log_probs: bool = opt(False, "reference log-probs once up front, then free the reference copy")
    sync_ref_model: bool = opt(False, "TR-DPO: every ref_model_sync_steps optimizer steps the reference moves toward "
                                      "the policy, ref ← α·policy + (1 - α)·ref (TRL's sync_ref_model)")
    ref_model_mixup_alpha: float = opt(0.6, "sync_ref_model: α, the policy's share in each reference update (1: a "
                                            "hard copy)", gt=0.0, le=1.0)
    ref_model_sync_steps: int = opt(512, "sync_ref_model: optimizer steps between reference updates", ge=1)
    helpful_rm: str = opt("models/helpful_rm", "safe_*: helpfulness reward model folder (alignrl train rm --task "
                                               "helpful)")
    harmless_rm: str = opt("models/harmless_rm", "safe_*: harmlessness cost model folder (--task harmless)")
    safety_lambda: float = opt(1.0, "safe_odpo: λ in the utility r - λ·c", ge=0.0)
    offset_alpha: float = opt(0.5, "safe_odpo: α in the ODPO offset α·log(1 + |Δu|)", ge=0.0)
    lambda_init: float = opt(1.0, "safe_mm_dpo: initial Lagrange multiplier λ (Safe-MM-DPO configs: λ_init)", gt=0.0)
    lambda_lr: float = opt(0.01, "safe_mm_dpo: step of ln λ ← ln λ + λ_lr·λ·J_C (λ_lr)", ge=0.0)
    cost_threshold: float = opt(0.0, "safe_mm_dpo: d in J_C = E[cost] + d (cost_threshold)")
    beta_w: float = opt(0.5, "safe_mm_dpo: w of β(δ) = β·(1 + w·(1 - e^(-k|δ|))) (Safe-MM-DPO configs: w)", ge=0.0)
    beta_k: float = opt(0.5, "safe_mm_dpo: k of β(δ) (Safe-MM-DPO configs: k)", ge=0.0)
    kl_coeff: float = opt(0.0, "safe_mm_dpo: weight of KL(π‖π_ref) on the chosen responses (kl_coeff)", ge=0.0)
    reference_free: bool = opt(False, "the reference's log-probs are taken as 0, a reference that gives every "
                                      "response the same probability; no reference model is loaded (TRL's "
                                      "reference_free)")
    f_divergence_type: str = opt("reverse_kl", "the divergence to the reference behind the logits of sigmoid, "
                                               "robust, exo_pair, hinge and ipo: reverse_kl (DPO's), js_divergence or "
                                               "alpha_divergence (TRL's f_divergence_type)", choices=F_DIVERGENCES)
    f_alpha_divergence_coef: float = opt(1.0, "alpha_divergence: α of (u_r^-α - u_c^-α)/α, u = π/π_ref (TRL's "
                                              "f_alpha_divergence_coef)", gt=0.0)
    ld_alpha: float | None = opt(None, "LD-DPO: the policy's log-prob of a response's tokens past its pair's shorter "
                                       "length is weighted by ld_alpha (TRL's ld_alpha); null: off", ge=0.0, le=1.0)
    use_weighting: bool = opt(False, "WPO: each pair's loss weighted by min(1, exp(w_c + w_r)), w a response's token "
                                     "mean of log π(y_t) - log Σ_v π(v)², no gradient (TRL's use_weighting)")
    learning_rate: float = opt(5e-5, "peak AdamW learning rate", gt=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_loss_list(self)
        check_trl_options(self)


SAFETY_OR_ORPO = ("safe_mm_dpo", "safe_odpo", "safe", "orpo")  # they hold other terms or scorers: alone only


def check_loss_list(cfg: DPOConfig) -> None:
    """A list loss_type (TRL's multi-loss DPO): known losses each named once, of one kind (with a reference or
    without), weights that fit; a single loss takes no weights. One line for each mistake."""
    names, weights = cfg.loss_type, list(cfg.loss_weights)
    if not isinstance(names, (list, tuple)):
        if weights:
            raise ConfigError(f"loss_weights={weights} weighs the losses of a list loss_type; give "
                              f"loss_type=[{names},...] or drop loss_weights")
        return
    where = f"loss_type=[{','.join(map(str, names))}]"
    unknown = [n for n in names if not isinstance(n, str) or (n not in DPO_LOSS_NAMES and n != "sft")]
    if not names or unknown:
        raise ConfigError(f"{where}: " + (f"unknown loss {unknown[0]!r}; each one of: {', '.join(DPO_LOSS_NAMES)}, "
                                          "sft" if unknown else "an empty list; give at least one loss"))
    alone = [n for n in names if n in SAFETY_OR_ORPO]
    if alone:
        raise ConfigError(f"{where}: {alone[0]} is not combined with other losses (orpo holds its NLL term, the "
                          f"safety losses their scorers); give loss_type={alone[0]} alone, or a list without it")
    if len(set(names)) < len(names) or names == ["sft"] * len(names):
        raise ConfigError(f"{where}: " + ("a loss named twice; give each once, weighted by loss_weights"
                                          if len(set(names)) < len(names) else "sft alone is no preference loss; "
                                          "add one (e.g. [sigmoid,sft]) or use `alignrl train sft`"))
    free = [n for n in names if tuple.__contains__(REFERENCE_FREE, n)]
    if free and len(free) + names.count("sft") < len(names):
        with_ref = next(n for n in names if n != "sft" and n not in free)
        raise ConfigError(f"{where} mixes {free[0]} (no reference model) with {with_ref} (against the reference); "
                          "give losses of one kind")
    if weights and (len(weights) != len(names) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights)):
        raise ConfigError(f"loss_weights={weights} must be {len(names)} finite numbers, one per loss of {where}")
    if "robust" in names and cfg.label_smoothing >= 0.5:  # its loss divides by 1 - 2ε
        raise ConfigError("loss_type robust needs label_smoothing below 0.5 (the loss is divided by 1 - 2ε)")


def check_trl_options(cfg: DPOConfig) -> None:
    """TRL DPOTrainer's reference_free, f_divergence_type, ld_alpha and use_weighting: one line where a combination
    would act on nothing or cannot be computed."""
    listed = isinstance(cfg.loss_type, (list, tuple))
    names = list(cfg.loss_type) if listed else [cfg.loss_type]
    where = f"loss_type=[{','.join(map(str, names))}]" if listed else f"loss_type={cfg.loss_type}"
    asked = [k for k in ("ref_model_path", "sync_ref_model", "precompute_ref_log_probs", "kl_coeff") if getattr(cfg, k)]
    if cfg.reference_free and asked:
        raise ConfigError(f"reference_free=true loads no reference model, so {asked[0]}={getattr(cfg, asked[0])} has "
                          "nothing to act on; drop one of the two")
    if cfg.f_divergence_type != "reverse_kl" and cfg.loss_type not in F_DIVERGENCE_LOSSES:
        raise ConfigError(f"f_divergence_type={cfg.f_divergence_type} changes the logits of "
                          f"{', '.join(F_DIVERGENCE_LOSSES)}; {where} reads none of them: give one of those or "
                          "f_divergence_type=reverse_kl")
    if cfg.f_alpha_divergence_coef != 1.0 and cfg.f_divergence_type != "alpha_divergence":
        raise ConfigError(f"f_alpha_divergence_coef={cfg.f_alpha_divergence_coef} is read only with "
                          "f_divergence_type=alpha_divergence; set that or drop the coefficient")
    for set_as in ([f"ld_alpha={cfg.ld_alpha}"] if cfg.ld_alpha is not None else []) + (
            ["use_weighting=true"] if cfg.use_weighting else []):
        if cfg.loss_type not in TRL_DPO_LOSSES:
            raise ConfigError(f"{set_as} is TRL's DPOTrainer's and acts on its losses; {where} is "
                              "not one (safe_*, simpo, cpo and orpo are not): drop it or change loss_type")
    if cfg.ld_alpha is not None and (cfg.logp_reduction != "sum" or any(n in LENGTH_NORMALISED for n in names)):
        what = ("logp_reduction=sequence_mean" if cfg.logp_reduction != "sum" else
                next(f"loss_type {n}" for n in names if n in LENGTH_NORMALISED))
        raise ConfigError(f"ld_alpha={cfg.ld_alpha} splits a response's summed log-prob; {what} reads token means: "
                          "drop ld_alpha, or use summed log-probs (logp_reduction=sum, sigmoid, ipo, ...)")
    if cfg.use_weighting and cfg.logp_reduction != "sum":
        raise ConfigError("use_weighting=true reads the responses' token log-probs; logp_reduction=sequence_mean "
                          "spans the prompt too: set logp_reduction=sum or use_weighting=false")
    if cfg.reference_free and cfg.f_divergence_type == "alpha_divergence" and (
            cfg.logp_reduction == "sum" and any(n not in LENGTH_NORMALISED for n in names)):
        # u = π itself: e^(−α·log π) of a summed response reaches the overflow cap on both sides, the logits are 0
        raise ConfigError("reference_free=true with f_divergence_type=alpha_divergence puts a response's summed "
                          "log-prob in an exponent that overflows, and nothing trains: use loss_type=ipo_token_mean, "
                          "or another f_divergence_type")
