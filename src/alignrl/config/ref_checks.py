"""model.ref_path, a reference model of its own: the combinations that cannot use one. Whether the folder is a
model whose vocabulary is the policy's is checked where it loads (`placements.build.check_ref_folder`)."""

from __future__ import annotations

from alignrl.config.schema import RunConfig


def ref_path_problem(cfg: RunConfig) -> str | None:
    path = cfg.model.ref_path
    if not path:
        return None
    key = f"model.ref_path={path}"
    if cfg.services.reference_url:
        return (f"{key} and services.reference_url both name the reference: set one (the service loads its own "
                "model with `alignrl serve ref --model`)")
    if cfg.actor.ref_sync_steps:  # moving another model toward the policy would mix unrelated weights
        return (f"actor.ref_sync_steps={cfg.actor.ref_sync_steps} moves the reference toward the policy, and {key} is "
                "another model: set actor.ref_sync_steps=0, or leave model.ref_path empty")
    if cfg.pipeline.placement == "zmq":
        return (f"{key}: pipeline.placement=zmq samplers load their reference from the policy's --model-path; "
                "run with pipeline.placement=inline (in-process or Ray), or leave model.ref_path empty")
    return None
