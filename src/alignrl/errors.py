"""The exception types that mean "the user's input is wrong" (a config, data file, model folder, reward
function, service, DeepSpeed config, a pipeline peer that is absent or speaks nonsense, a pipeline port that is
taken or unsafe to bind): every command line prints them as one line and exits 2, never a traceback. Imported
lazily: the modules that define them pull in torch."""

from __future__ import annotations

import os

PROGRAM_ENV = "ALIGNRL_PROG"
# set by a launcher (run_distributed.py) for the processes it starts: on Ctrl-C it speaks for them all
LAUNCHER_ENV = "ALIGNRL_LAUNCHER"


def program() -> str:
    """The command the user typed, for the front of every error line: `alignrl`, or a seed's script
    (training_worker.py) that runs alignrl in its own processes and torchrun ranks, which inherit the name."""
    return os.environ.get(PROGRAM_ENV, "alignrl")


def user_errors() -> tuple[type[Exception], ...]:
    from alignrl.config import ConfigError
    from alignrl.data.loaders import DataError
    from alignrl.dist.coordinator import PipelineError
    from alignrl.dist.shared_weights import SharedUnavailable
    from alignrl.dist.zmq_link import InsecureBind, PortInUse
    from alignrl.models.loader import ModelError
    from alignrl.rewards.registry import RewardError
    from alignrl.rollout.remote import ServiceError
    from alignrl.serve.weights import WireError
    from alignrl.train.engines.deepspeed import DeepSpeedConfigError

    return (ConfigError, DataError, ModelError, RewardError, ServiceError, DeepSpeedConfigError, PipelineError,
            WireError, PortInUse, InsecureBind, SharedUnavailable)
