"""verl's own tools, as alignrl's: a tool config naming `verl.tools.gsm8k_tool.Gsm8kTool`,
`verl.tools.geo3k_tool.Geo3kTool`, `verl.tools.search_tool.SearchTool` or
`verl.tools.sandbox_fusion_tools.SandboxFusionTool` (`verl_code_tool`) gets these (`BUILTIN`), with verl's config
keys, call schemas and response texts.

`Gsm8kTool` scores an `answer` against the row's ground truth (alignrl.rewards.gsm8k, flexible extraction);
`Geo3kTool` grades it by verl's geo3k rule (alignrl.rewards.geo3k, accuracy alone).

`SearchTool` is the tool of verl's Search-R1-like example, against any server of Search-R1's /retrieve API
(`alignrl serve retrieve`, or Search-R1's own `retrieval_server.py`). Its entry's `config` takes verl's keys:
`retrieval_service_url` (required), `topk` (3), `timeout` or `default_timeout` (30 s), `rate_limit` (120 searches at
once; `enable_global_rate_limit: false` lifts it; verl's `num_workers` sizes a Ray pool alignrl does not need).
A call `{"query_list": [...]}` answers, as verl's does, `{"result": "<each query's passages, joined by ---> "}` in
JSON, each passage `Doc i (Title: t)` and its text on the next line. A call without a query list answers verl's
error text and the episode goes on. The server is asked once when the tool is made, so a server that is down stops
the run before its first step; one that stops answering mid-run, after the client's retries, stops it too (one line
naming the URL) rather than feeding the policy error texts to learn from.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

from alignrl.errors import ConfigError
from alignrl.rewards import geo3k, gsm8k
from alignrl.rollout.retriever import RetrieverClient
from alignrl.rollout.verl_code_tool import SandboxFusionTool
from alignrl.rollout.verl_tool_api import BaseTool, OpenAIFunctionToolSchema, ToolResponse

MISSING_QUERIES = "Error: 'query_list' is missing, empty, or not a list in parameters."  # verl's words


class AnswerTool(BaseTool):
    """verl's answer-checking tools (Gsm8kTool, Geo3kTool): a call's `answer` is scored against the row's ground truth
    (create_kwargs) by `score`, the response says the parsed answer and its score, and the step reward is verl's
    penalty of -0.05 for an answer that did not improve on the episode's last one (0.0 otherwise)."""

    score: Callable[[str, Any], float]  # (answer, ground truth) -> reward: each tool's own rule, below

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:  # verl's agent loop passes the row's create_kwargs whole
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = parameters.get("answer", "") if isinstance(parameters, dict) else ""
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return 0.0 if state["ground_truth"] is None else self.score(state["response"], state["ground_truth"])

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def gsm8k_answer_score(answer: str, ground_truth: Any) -> float:
    """verl's gsm8k tool: the answer read as a "#### " line, flexible extraction, 1.0 when right."""
    response = answer if answer.startswith("#### ") else "#### " + answer
    return gsm8k.compute_score(response, str(ground_truth), method="flexible", format_score=0.0, score=1.0)


def geo3k_answer_score(answer: str, ground_truth: Any) -> float:
    """verl's geo3k tool (its multi-turn vision example): the whole answer graded by the geo3k rule's accuracy
    (mathruler), no format term: 1.0 when right."""
    return geo3k.compute_score(answer, ground_truth, use_boxed=False, format_score=0.0)


class Gsm8kTool(AnswerTool):
    score = staticmethod(gsm8k_answer_score)


class Geo3kTool(AnswerTool):
    score = staticmethod(geo3k_answer_score)


def verl_layout(contents: list[str]) -> str:
    """verl's layout of one query's passages (each a title line, then its text)."""
    return "\n\n".join(f"Doc {i} (Title: {title})\n{text}"
                       for i, (title, _, text) in enumerate((c.partition("\n") for c in contents), start=1)).strip()


class SearchTool(BaseTool):
    """verl's SearchTool over alignrl's retrieval client: searches run in threads, at most `rate_limit` at once."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        url = config.get("retrieval_service_url")
        if not isinstance(url, str) or not url:
            raise ConfigError("verl's SearchTool needs config.retrieval_service_url, e.g. "
                              "http://127.0.0.1:8000/retrieve (start one with `alignrl serve retrieve`)")
        timeout = float(config.get("timeout", config.get("default_timeout", 30)))
        self.client = RetrieverClient(url, topk=int(config.get("topk", 3)), timeout_s=timeout,
                                      keys=("the search tool's config.retrieval_service_url", "config.timeout"))
        self.client.check()
        limit = int(config.get("rate_limit", 120)) if config.get("enable_global_rate_limit", True) else 1 << 16
        self.slots = threading.BoundedSemaphore(max(1, limit))
        self._results: dict[str, list[str]] = {}

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        self._results[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        queries = parameters.get("query_list") if isinstance(parameters, dict) else None
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=json.dumps({"result": MISSING_QUERIES})), 0.0, {}
        contents = await asyncio.to_thread(self._search, [str(q) for q in queries])
        text = json.dumps({"result": "\n---\n".join(map(verl_layout, contents))}, ensure_ascii=False)
        self._results.setdefault(instance_id, []).append(text)
        return ToolResponse(text=text), 0.0, {"query_count": len(queries), "total_results": sum(map(len, contents))}

    def _search(self, queries: list[str]) -> list[list[str]]:
        with self.slots:
            return self.client.search_contents(queries)

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        """The episode's search results, as verl's tool returns them (the reward comes from the run's reward)."""
        return list(self._results.get(instance_id, []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._results.pop(instance_id, None)


BUILTIN: dict[str, type[BaseTool]] = {
    **dict.fromkeys(("verl.tools.gsm8k_tool.Gsm8kTool", "verl.workers.tool.gsm8k_tool.Gsm8kTool"), Gsm8kTool),
    "verl.tools.search_tool.SearchTool": SearchTool,
    "verl.tools.geo3k_tool.Geo3kTool": Geo3kTool,
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": SandboxFusionTool,
}
