"""verl's code interpreter tool (`verl.tools.sandbox_fusion_tools.SandboxFusionTool`) as alignrl's: a call
`{"code": "..."}` runs the program on a SandboxFusion service (`alignrl serve sandbox`, or SandboxFusion itself) and
answers its stdout followed by its stderr, or verl's "no stdout here" when the run did not finish (its time ran out).

The entry's `config` takes verl's keys: `sandbox_fusion_url` (required, as in verl), `default_timeout` (30 s),
`default_language` (python), `memory_limit_mb` (1024), `rate_limit` (10 runs at once; `enable_global_rate_limit:
false` lifts it; verl's `num_workers` sizes a Ray pool alignrl does not need). A call may set its own `timeout` and
`language`. A service that cannot be reached stops the run in one line naming its URL, as the search tool's does,
rather than feeding the policy error texts to learn from.
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


class SandboxFusionTool(BaseTool):
    """verl's code interpreter over the sandbox client: runs go in threads, at most `rate_limit` at once."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        url = config.get("sandbox_fusion_url")
        if not isinstance(url, str) or not url:
            raise ConfigError("verl's SandboxFusionTool needs config.sandbox_fusion_url, e.g. "
                              "http://127.0.0.1:8080/run_code (start one with `alignrl serve sandbox`)")
        try:
            self.client = SandboxClient(url)
        except RewardError as e:
            raise ConfigError(f"the code tool's config.sandbox_fusion_url: {e}") from None
        self.timeout = float(config.get("default_timeout", 30))
        self.language = str(config.get("default_language", "python"))
        self.memory_mb = int(config.get("memory_limit_mb", 1024))
        limit = int(config.get("rate_limit", 10)) if config.get("enable_global_rate_limit", True) else 1 << 16
        self.slots = threading.BoundedSemaphore(max(1, limit))
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
        timeout = parameters.get("timeout", self.timeout)
        timeout = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else self.timeout
        text = await asyncio.to_thread(self._run, code if isinstance(code, str) else str(code), timeout,
                                       str(parameters.get("language", self.language)))
        self._outputs.setdefault(instance_id, []).append(text)
        return ToolResponse(text=text), None, None  # verl's: a run gives no score and no metrics

    def _run(self, code: str, timeout: float, language: str) -> str:
        with self.slots:
            try:
                result = self.client.run(code, "", timeout, self.memory_mb, language)
            except RewardError as e:
                raise ServiceError(str(e), down=True) from None
        return result.stdout + result.stderr if result.status == "Finished" else NOT_FINISHED

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        """The episode's outputs (verl's tool keeps a list; the reward comes from the run's reward function)."""
        return list(self._outputs.get(instance_id, []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._outputs.pop(instance_id, None)
