"""model.ref_path, a reference model of its own: the combinations that cannot use one. Whether the folder is a
model whose vocabulary is the policy's is checked where it loads (`placements.build.check_ref_folder`)."""

from __future__ import annotations

from alignrl.config.schema import PAIR_ESTIMATORS, RunConfig


def needs_reference(cfg: RunConfig) -> bool:
    """Whether the run uses reference log-probs: a KL loss, a KL penalty in the reward, or online DPO's (XPO's) loss."""
    return ((cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0) or cfg.algorithm.use_kl_in_reward
            or cfg.algorithm.adv_estimator in PAIR_ESTIMATORS)


def ref_path_problem(cfg: RunConfig) -> str | None:
    path = cfg.model.ref_path
    if not path:
        return None
    key = f"model.ref_path={path}"
    if not needs_reference(cfg):  # on-policy distillation without its KL term would train on nothing, silently
        return (f"{key} is read only by a KL term or online DPO's loss, and this run has none: add "
                "algorithm.use_kl_in_reward=true (on-policy distillation) or actor.use_kl_loss=true with "
                "actor.kl_loss_coef > 0, or leave model.ref_path empty")
    if cfg.services.reference_url:
        return (f"{key} and services.reference_url both name the reference: set one (the service loads its own "
                "model with `alignrl serve ref --model`)")
    if cfg.actor.ref_sync_steps:  # moving another model toward the policy would mix unrelated weights
        return (f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} moves the reference toward the policy, and {key} is "
                "another model: set actor.ref_sync_steps=0, or leave model.ref_path empty")
    if cfg.pipeline.placement == "zmq":
        return (f"{key}: the ZeroMQ samplers check the weights they start from against model.path's alone, not a "
                "reference of its own; run with pipeline.placement=inline (in-process or Ray), or leave "
                "model.ref_path empty")
    return None
