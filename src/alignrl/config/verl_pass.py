"""The state of one translation of verl-spelled overrides, shared by `verl_keys` and `verl_recent`."""

from __future__ import annotations

from dataclasses import dataclass, field

from alignrl.config.schema import ConfigError


class UnknownKeyError(ConfigError):
    """A key in one of verl's sections that alignrl does not know (one line naming it)."""


@dataclass
class TranslationPass:
    """What `verl_keys.translate` gathers while it reads the overrides one by one (`verl_recent` reads and fills it
    too)."""
    overrides: list[str] | tuple[str, ...]
    search_r1: bool = False  # a key only Search-R1's verl reads was given: that verl's behaviour, else 0.7's
    out: list[str] = field(default_factory=list)
    not_used: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    custom: dict[str, str] = field(default_factory=dict)  # verl's custom_reward_function.{path,name}
    dataset_cls: dict[str, str] = field(default_factory=dict)  # verl's data.custom_cls.{path,name}
    # key -> (value, why); a key given twice: listed once, last value
    not_applied: dict[str, tuple[str, str]] = field(default_factory=dict)
    critic_follows: dict[str, str] = field(default_factory=dict)  # verl's critic.ppo_mini_batch_size / ppo_epochs
    keep: dict[str, int] = field(default_factory=dict)  # verl's max_{actor,critic}_ckpt_to_keep, 0 for keep-all
    missing: dict[str, list[str]] = field(default_factory=dict)  # feature -> the keys that ask for it
    overlong: dict[str, str] = field(default_factory=dict)  # reward_model.overlong_buffer.{enable,len}
    reward_model: dict[str, str] = field(default_factory=dict)  # reward_model.enable, reward_model.model.path
    val_kwargs: dict = field(default_factory=dict)  # rollout.val_kwargs.{do_sample,temperature,top_p,top_k,n}
    rollout_correction: dict[str, tuple[str, object]] = field(default_factory=dict)  # name -> (text, value)
    later: dict[str, tuple[str, object]] = field(default_factory=dict)  # keys read once every override is known
    loss_mode: str = "vanilla"  # verl's actor.policy_loss.loss_mode
    remote_code: list[str] = field(default_factory=list)  # the *.trust_remote_code keys set true
    # actor / critic -> setting (group, strategy, zero_stage, offload, optimizer_offload) -> ("key=value", value)
    engine: dict[str, dict[str, tuple[str, object]]] = field(default_factory=dict)
    verl: bool = False
    output_is_run_dir: bool = False
    global_micro: int | None = None
