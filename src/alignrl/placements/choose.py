"""Which producers a run's config asks for: the one place that reads `pipeline.placement`. In this process
(None: the placement builds the in-process producer), or ZeroMQ samplers feeding this trainer. A Ray placement
hands its own producers to the runner from its actor-group ranks and never comes here."""

from __future__ import annotations

from pathlib import Path

from alignrl.config import RunConfig
from alignrl.data.records import rows_digest
from alignrl.interfaces import RemoteProducers


def remote_producers(cfg: RunConfig, config_yaml: str, log_dir: Path, train_rows: list) -> RemoteProducers | None:
    """The producers in other processes that `cfg` names, or None for the in-process producer. `train_rows`: the
    training rows, which the samplers' own must match (their digest is taken only when samplers are used)."""
    if cfg.pipeline.placement == "zmq":
        from alignrl.placements.zmq.coordinator import Coordinator

        return Coordinator(cfg, config_yaml, log_dir, rows_digest(train_rows))
    return None
