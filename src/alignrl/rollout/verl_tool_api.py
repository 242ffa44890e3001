"""verl's tool API (`verl.tools.base_tool`, `verl.tools.schemas`, `verl.utils.rollout_trace`) as verl's tools are
written against it: an installed verl's when there is one, else these classes, registered under verl's module names
so that a tool file importing them runs unchanged (`verl_api`)."""

from __future__ import annotations

import importlib
import os
import sys
import uuid
from typing import Any, Literal

from pydantic import BaseModel

from alignrl.errors import ConfigError, UserError
from alignrl.utils.user_files import provide_modules, provide_verl_apis

KEY = "agent.tool_config_path"
GSM8K_CLASSES = ("verl.tools.gsm8k_tool.Gsm8kTool", "verl.workers.tool.gsm8k_tool.Gsm8kTool")


class ToolConfigError(ConfigError):
    """agent.tool_config_path names a file or tool alignrl cannot use; one line naming it and the fix."""



# verl.tools.schemas: the OpenAI function-calling models verl's tools are written against
class OpenAIFunctionPropertySchema(BaseModel):
    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    name: str
    arguments: str  # JSON text


class OpenAIFunctionCallSchema(BaseModel):
    name: str
    arguments: dict[str, Any]


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


def rollout_trace_op(fn):
    """verl.utils.rollout_trace's tracing decorator; no tracing here."""
    return fn


class BaseTool:
    """verl's tool base: one object per tool, an instance id per call (create, execute, release)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError("no tool_schema: give one in the tool config or return it from get_openai_tool_schema()")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass


_PROVIDED = {
    "verl.tools.schemas": {c.__name__: c for c in (
        OpenAIFunctionPropertySchema, OpenAIFunctionParametersSchema, OpenAIFunctionSchema, OpenAIFunctionToolSchema,
        OpenAIFunctionParsedSchema, OpenAIFunctionCallSchema, OpenAIFunctionToolCall, ToolResponse)},
    "verl.tools.base_tool": {"BaseTool": BaseTool, "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
                             "ToolResponse": ToolResponse},
    "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op},
}


def installed_verl(modules: tuple[str, ...], error: type[UserError], key: str, what: str) -> list | None:
    """The installed verl's `modules`; None when verl is not installed (alignrl then provides its own). An installed
    verl that fails to import (a dependency of its own missing, a broken file) is one line raising `error`."""
    try:
        return [importlib.import_module(name) for name in modules]
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("verl"):  # an installed verl missing one of its own dependencies
            raise error(f"{key}: the installed verl's {what} fail to import ({exc}); install what they need, or "
                        f"uninstall verl to use the {what} alignrl provides") from exc
    except Exception as exc:
        raise error(f"{key}: the installed verl's {what} fail to import ({type(exc).__name__}: "
                    f"{exc})".splitlines()[0] + "; repair or uninstall verl") from exc
    return None


def verl_api() -> tuple[type, type]:
    """verl's BaseTool and OpenAIFunctionToolSchema: an installed verl's, else these, registered under verl's module
    names so that a tool file importing them runs unchanged (parent packages that are missing, or hold no tools, as
    the repository's `verl.trainer` shim does, get the missing submodules)."""
    installed = installed_verl(("verl.tools.base_tool", "verl.tools.schemas"), ToolConfigError, KEY, "tool modules")
    if installed:
        return installed[0].BaseTool, installed[1].OpenAIFunctionToolSchema
    provide_modules(_PROVIDED, "verl's tool API, as alignrl provides it (verl is not installed)")
    return BaseTool, OpenAIFunctionToolSchema


def import_class(name: str, where: str, error: type[UserError]) -> type:
    """The class at module path `name` (a tool's or an interaction's class_name), imported with the working folder
    on the path (as `python -m` has it); one line raising `error` for a name that is not a module path, a module that
    fails to import, or a class that is not there."""
    module_name, _, class_name = name.rpartition(".")
    if not module_name:
        raise error(f"{where}.class_name={name!r} is not a module path; write it as package.module.Class")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # last: the working folder's modules never shadow installed ones
    provide_verl_apis()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise error(f"{where}.class_name={name!r}: module {module_name} failed to import "
                    f"({type(exc).__name__}: {exc})".splitlines()[0] + "; put it in the working folder or "
                    "on PYTHONPATH, and install what it imports") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise error(f"{where}.class_name={name!r}: {module_name} has no class {class_name}; check the name")
    return cls
