"""A user's interactive environment for multi-turn rollouts: a Python file in OpenRLHF's agent format
(`--agent_func_path`, alignrl's agent.env_path), loaded so that such a file runs unchanged without OpenRLHF.

The file defines a class `AgentInstance` (subclassing `openrlhf.utils.agent.AgentInstanceBase`) with two coroutines:
`reset({"observation": prompt text, "label": label})` returning {"observation": text}, and `step({"observation_text",
"action_text", "label", "sampling_params"})` returning {"rewards", "scores", "environment_feedback", "done",
"extra_logs"}; with a vision-language policy it may also return "environment_images", Pillow images whose
placeholders the feedback holds (alignrl's key, `rollout.env_agent`). Each episode gets its own instance, made with
no arguments (an `async def __init__`, as older OpenRLHF examples write it, is awaited). Its `AgentExecutor` class
is not used: alignrl runs the turns itself (`rollout.env_agent`), as OpenRLHF's MultiTurnAgentExecutor does; a file
whose executor overrides `execute` is refused, since its custom token-level loop would be skipped.

When OpenRLHF is not installed, `openrlhf.utils.agent` is provided here (the three base classes the files import);
an installed OpenRLHF is used as it is.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from alignrl.errors import ConfigError, UserError
from alignrl.utils.user_files import import_user_file, provide_modules

API_MODULE = "openrlhf.utils.agent"


class EnvironmentFileError(ConfigError):
    """agent.env_path names a file alignrl cannot run; one line naming it and the fix."""


class EnvironmentStepError(UserError):
    """The user's environment did something alignrl cannot use: one line naming the method and the fix."""


class Environment(Protocol):
    """One episode's environment: OpenRLHF's AgentInstance."""

    async def reset(self, states: dict, **kwargs) -> dict: ...

    async def step(self, states: dict, **kwargs) -> dict: ...


EnvFactory = Callable[[], Awaitable[Environment]]


class AgentInstanceBase(ABC):
    """OpenRLHF's base of an episode's environment: `reset` passes the prompt through unless overridden."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError


class AgentExecutorBase:
    """OpenRLHF's executor base. Files subclass it to name their AgentInstance; alignrl runs the turns itself."""

    def __init__(self, agent_instance_cls=None, *args, **kwargs):
        self.agent_instance_cls = agent_instance_cls


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor: `super().__init__(AgentInstance)` in a file names the environment class."""


def _api_module() -> types.ModuleType:
    """The `openrlhf.utils.agent` module the files import: OpenRLHF's own when it is installed, else these classes
    under that name (with its parent packages, registered only if absent)."""
    try:
        return importlib.import_module(API_MODULE)
    except ImportError:
        pass
    provide_modules({API_MODULE: {"AgentInstanceBase": AgentInstanceBase, "AgentExecutorBase": AgentExecutorBase,
                                  "MultiTurnAgentExecutor": MultiTurnAgentExecutor}},
                    "OpenRLHF's agent base classes, as alignrl provides them (OpenRLHF is not installed)")
    return sys.modules[API_MODULE]


def load_environment(path: str, key: str = "agent.env_path") -> EnvFactory:
    """The file's episode factory: an awaitable making a fresh AgentInstance. One line for a missing file, a file
    that fails to import, has no AgentInstance with a `step` coroutine, or whose executor runs its own loop."""
    file = Path(path)
    if not file.is_file():
        raise EnvironmentFileError(f"{key}={path}: no such file (from {Path.cwd()}); give the Python file that "
                                   "defines the environment's AgentInstance class")
    api = _api_module()
    module = import_user_file(file, key, EnvironmentFileError, "alignrl_environment_",
                              f"install what it imports (alignrl provides only {API_MODULE} of OpenRLHF)")
    instance_cls = _instance_class(module, api, path, key)
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type) and "execute" in vars(executor):
        raise EnvironmentFileError(f"{key}={path}: its AgentExecutor overrides execute() (a custom token-level loop), "
                                   "which alignrl does not run; keep the turns in AgentInstance.reset/step and drop "
                                   "the override")
    return _factory(instance_cls)


def _instance_class(module, api, path: str, key: str) -> type:
    """The file's AgentInstance: the class of that name, else its one subclass of AgentInstanceBase."""
    cls = getattr(module, "AgentInstance", None)
    if not isinstance(cls, type):
        own = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, api.AgentInstanceBase)
               and c is not api.AgentInstanceBase and c.__module__ == module.__name__]
        if len(own) != 1:
            raise EnvironmentFileError(f"{key}={path}: found {len(own)} AgentInstanceBase subclasses and no class "
                                       "named AgentInstance; define one AgentInstance(AgentInstanceBase) with async "
                                       "reset() and step()")
        cls = own[0]
    if not inspect.iscoroutinefunction(getattr(cls, "step", None)):
        raise EnvironmentFileError(f"{key}={path}: {cls.__name__}.step must be a coroutine (async def step(self, "
                                   "states, **kwargs)), as OpenRLHF awaits it")
    return cls


def _factory(cls: type) -> EnvFactory:
    """A fresh instance per episode, made with no arguments as OpenRLHF makes them; an async __init__ is awaited."""
    async def make() -> Any:
        if inspect.iscoroutinefunction(cls.__init__):
            env = cls.__new__(cls)
            await cls.__init__(env)
            return env
        return cls()

    make.env_name = cls.__name__
    return make
