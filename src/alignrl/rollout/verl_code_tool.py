"""verl's code interpreter tool (`verl.tools.sandbox_fusion_tools.SandboxFusionTool`) as alignrl's: a call
`{"code": "..."}` runs the program on a SandboxFusion service (`alignrl serve sandbox`, or SandboxFusion itself) and
answers its stdout followed by its stderr, or verl's "no stdout here" when the run did not finish (its time ran out).

The entry's `config` takes verl's keys: `sandbox_fusion_url` (required, as in verl), `default_timeout` (30 s),
`default_language` (python), `memory_limit_mb` (1024), `rate_limit` (10 runs at once; `enable_global_rate_limit:
false` lifts it; verl's `num_workers` sizes a Ray pool alignrl does not need). A call may set its own `language`,
and a `timeout` up to default_timeout. A service that cannot be reached stops the run in one line naming its URL, as
the search tool's does, rather than feeding the policy error texts to learn from.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

from alignrl.errors import ConfigError
from alignrl.rewards.errors import RewardError
from alignrl.rewards.sandbox_client import SandboxClient
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.verl_tool_api import BaseTool, OpenAIFunctionToolSchema, ToolResponse

NOT_FINISHED = "no stdout here"  # verl's words for a run that did not finish
# the schema verl's examples give the tool, used when the tool config gives none
SCHEMA = {"type": "function", "function": {
    "name": "code_interpreter", "description": "A tool for executing code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to execute."}},
                   "required": ["code"]}}}


class ThreadPool:
    """verl's execution pool as its tools call it, `await pool.execute.remote(fn, *args)`: `fn` in a thread, at most
    `limit` at once (verl runs it on a Ray actor under a global rate limiter)."""

    def __init__(self, limit: int):
        self.slots = threading.BoundedSemaphore(max(1, limit))
        self.execute = self  # verl's `execution_pool.execute.remote(...)`

    def remote(self, fn, *args, **kwargs):
        return asyncio.to_thread(self._limited, fn, *args, **kwargs)

    def _limited(self, fn, *args, **kwargs):
        with self.slots:
            return fn(*args, **kwargs)


class SandboxFusionTool(BaseTool):
    """verl's code interpreter over the sandbox client, with verl's attributes (a recipe's subclass, as ReTool's,
    overrides `execute` and calls `self.execution_pool.execute.remote(self.execute_code, ...)`)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self.sandbox_fusion_url = config.get("sandbox_fusion_url")
        if not isinstance(self.sandbox_fusion_url, str) or not self.sandbox_fusion_url:
            raise ConfigError("verl's SandboxFusionTool needs config.sandbox_fusion_url, e.g. "
                              "http://127.0.0.1:8080/run_code (start one with `alignrl serve sandbox`)")
        try:
            self.client = SandboxClient(self.sandbox_fusion_url)
        except RewardError as e:
            raise ConfigError(f"the code tool's config.sandbox_fusion_url: {e}") from None
        self.default_timeout = float(config.get("default_timeout", 30))
        self.default_language = str(config.get("default_language", "python"))
        self.memory_limit_mb = int(config.get("memory_limit_mb", 1024))
        self.rate_limit = int(config.get("rate_limit", 10))
        self.execution_pool = ThreadPool(self.rate_limit if config.get("enable_global_rate_limit", True) else 1 << 16)
        self._outputs: dict[str, list[str]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        self._outputs[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        parameters = parameters if isinstance(parameters, dict) else {}
        code = parameters.get("code", "")
        timeout = parameters.get("timeout", self.default_timeout)
        # the policy may shorten its run, never lengthen it: a slot of the service would be held as long as it asked
        timeout = min(float(timeout), self.default_timeout) if isinstance(timeout, (int, float)) and timeout > 0 \
            else self.default_timeout
        language = str(parameters.get("language", self.default_language))
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id,
                                                          code if isinstance(code, str) else str(code), timeout,
                                                          language)
        return result, None, None  # verl's: a run gives no score and no metrics

    def execute_code(self, instance_id: str, code: str, timeout: float = 30, language: str = "python") -> ToolResponse:
        """One run on the service: its stdout then its stderr, or verl's words for a run that did not finish."""
        try:
            result = self.client.run(code, "", float(timeout), self.memory_limit_mb, language)
        except RewardError as e:
            raise ServiceError(str(e), down=True) from None
        text = result.stdout + result.stderr if result.status == "Finished" else NOT_FINISHED
        self._outputs.setdefault(instance_id, []).append(text)
        return ToolResponse(text=text)

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        """The episode's outputs (verl's tool keeps a list; the reward comes from the run's reward function)."""
        return list(self._outputs.get(instance_id, []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._outputs.pop(instance_id, None)
