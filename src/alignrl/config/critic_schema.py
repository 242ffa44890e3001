"""The value model's and the cost constraint's sections of the run configuration (PPO with a critic, PPO-Lagrangian);
part of `alignrl.config.schema`'s RunConfig."""

from __future__ import annotations

from dataclasses import dataclass

from alignrl.config.option import opt


@dataclass(frozen=True)
class CriticConfig:
    enable: bool = opt(False, "train a value model (PPO with a critic); required by algorithm.adv_estimator=gae")
    model_path: str | None = opt(None, "value model folder; None initialises it from model.path (new scalar head)")
    lr: float = opt(1e-5, "critic AdamW learning rate", gt=0.0)
    lr_warmup_steps: int = opt(0, "linear warm-up of the critic lr (optimizer steps)", ge=0)
    lr_warmup_steps_ratio: float = opt(0.0, "critic warm-up as a fraction of trainer.total_training_steps (verl's "
                                            "critic.optim.lr_warmup_steps_ratio); used when lr_warmup_steps is 0",
                                       ge=0.0, le=1.0)
    lr_scheduler: str = opt("constant", "critic schedule after warm-up", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = opt(0.0, "critic: floor of the cosine or linear decay as a fraction of critic.lr",
                               ge=0.0, le=1.0)
    weight_decay: float = opt(0.0, "critic AdamW weight decay", ge=0.0)
    betas: list = opt([0.9, 0.999], "critic AdamW betas")
    warmup_steps: int = opt(0, "RL steps that train only the critic before the actor starts (verl's "
                               "trainer.critic_warmup - 1: verl counts steps from 1)", ge=0)
    cliprange_value: float = opt(0.5, "value clipping around the old values; 0 turns it off", ge=0.0)
    grad_clip: float = opt(1.0, "critic max grad norm; 0 disables", ge=0.0)
    use_remove_padding: bool = opt(False, "pack a micro-batch's real tokens into one row for the value model's "
                                          "forwards (verl's critic.model.use_remove_padding); see "
                                          "actor.use_remove_padding")


@dataclass(frozen=True)
class SafetyConfig:
    cost_fn: str | None = opt(None, "PPO-Lagrangian (Safe RLHF): per-response cost 'path/to/file.py:function' "
                                    "(compute_score signature); needs algorithm.adv_estimator=gae")
    cost_model: str | None = opt(None, "PPO-Lagrangian cost from a cost model (HF sequence-classification folder, "
                                        "one label) instead of safety.cost_fn")
    cost_limit: float = opt(0.0, "constraint: mean episode cost <= cost_limit")
    lambda_init: float = opt(1.0, "initial Lagrange multiplier (kept as log lambda, as Safe RLHF's)", gt=0.0)
    lambda_lr: float = opt(0.1, "step size of log lambda: log lambda += lambda_lr * (J_c - cost_limit) * lambda",
                           ge=0.0)
    lambda_max: float | None = opt(100.0, "cap on the multiplier (Safe RLHF's lambda_max); null: e^50, where "
                                          "the float would soon overflow", gt=0.0)
    lambda_update_delay_steps: int = opt(0, "RL steps before the multiplier starts to move", ge=0)
    episode_cost_window_size: int = opt(128, "J_c is the mean cost of this many latest episodes", ge=1)
