"""verl's MCP tools (a tool config entry with `config.type: mcp`): the entry's `mcp.mcp_servers_config_path` names
the servers file (`mcp_client`), whose servers are connected when the tools are made; every tool they offer, or those
in `mcp.tool_selected_list`, becomes a tool of the entry's class_name with the schema the server gives (verl's
mcp2openai: the MCP tool's inputSchema as the OpenAI function's parameters), and a call runs `call_tool` on its
server. The entry's `config` goes to each tool, as in verl: `timeout` (30 s, per call and to connect) and
`rate_limit` (here: calls in flight at once per servers file, 10).

`MCPBaseTool` and `MCPSearchTool` are verl's classes as alignrl provides them, under verl's module names when verl
is not installed, so that a user's subclass (overriding `_parse_tool_result`, or verl's older `post_process`) runs
unchanged. As in verl, the response is the result's text parts joined by a space, and a call that fails answers
`{"result": "Search execution failed: ..."}` and the episode goes on; a tool's own error is its result's text.
Unlike verl, image parts are the response's images (alignrl's tool-image path: a vision-language policy reads them,
a text-only one stops in one line), and a server that stops answering stops the run in one line.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from alignrl.data.picture_json import MAX_PICTURE_PIXELS
from alignrl.errors import UserError
from alignrl.rollout import mcp_client
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.verl_tool_api import BaseTool, OpenAIFunctionToolSchema, ToolConfigError, ToolResponse

MISSING_PARAMETERS = "Error: 'parameters' is missing or empty."  # verl's words
VERL_MCP_BASE = "verl.tools.mcp_base_tool"


class McpResultError(UserError):
    """An MCP tool's result the loop cannot append; one line naming the tool."""


class MCPClientManager:
    """verl's ClientManager as tools call it: `call_tool(name, parameters, timeout)` on the server offering `name`."""

    @property
    def tool_client_mapping(self) -> dict:
        return dict(mcp_client.ROUTES)

    async def call_tool(self, tool_name: str, parameters: dict, timeout: float):
        return await mcp_client.call_tool(tool_name, parameters, timeout)


ClientManager = MCPClientManager()


class MCPBaseTool(BaseTool):
    """verl's MCPBaseTool: each call runs on the MCP server offering the tool; the instance keeps its responses, which
    calc_reward returns (verl's search-result list)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict] = {}
        self.timeout = float(config.get("timeout", 30))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": []}
        return instance_id

    async def _call_tool(self, instance_id: str, parameters: dict[str, Any]) -> tuple[str, dict]:
        """The call's response text and metadata (`_parse_tool_result` of its content); its images, decoded, under
        metadata["_images"]."""
        result = await ClientManager.call_tool(self.name, parameters, self.timeout)
        text, metadata = self._parse_tool_result(list(result.content or []))
        metadata = dict(metadata or {})
        metadata["_images"] = images_of(result.content or [], self.name)
        if getattr(result, "is_error", False):
            metadata.setdefault("status", "error")
        return text, metadata

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        if not self.name or parameters is None:
            return ToolResponse(text=json.dumps({"result": MISSING_PARAMETERS})), 0.0, {}
        try:
            text, metadata = await self._call_tool(instance_id, parameters)
        except (ServiceError, McpResultError):  # a server gone, an image that cannot be read: the run stops
            raise
        except Exception as exc:  # a failed call: verl's error text, and the episode goes on
            return ToolResponse(text=json.dumps({"result": f"Search execution failed: {exc}"})), 0.0, \
                {"error": str(exc)}
        self._instance_dict.setdefault(instance_id, {"response": "", "reward": []})["reward"].append(text.strip())
        images = metadata.pop("_images", [])
        metrics = {"query_count": metadata.get("query_count", 0), "status": metadata.get("status", "unknown"),
                   "total_results": metadata.get("total_results", 0),
                   "api_request_error": metadata.get("api_request_error", "")}
        return ToolResponse(text=text, image=images or None), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs) -> list[str]:
        return list(self._instance_dict.get(instance_id, {}).get("reward", []))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        """verl's parse (older verl calls it post_process: a subclass overriding either is used)."""
        return self.post_process(content)

    def post_process(self, content: list) -> tuple[str, dict]:
        return " ".join(part.text for part in content if getattr(part, "type", "") == "text"), {}


class MCPSearchTool(MCPBaseTool):
    """verl's MCPSearchTool: the text parts concatenated, counted as the results."""

    def _parse_tool_result(self, content: list) -> tuple[str, dict]:
        texts = [part.text for part in content if getattr(part, "type", "") == "text"]
        return "".join(texts), {"api_request_error": "", "status": "success", "queries": [], "query_count": 0,
                                "total_results": len(texts)}


BUILTIN_MCP = {f"{VERL_MCP_BASE}.MCPBaseTool": MCPBaseTool, "verl.tools.mcp_search_tool.MCPSearchTool": MCPSearchTool}


def mcp2openai(tool) -> dict:
    """An MCP tool's OpenAI function schema, as verl builds it (its inputSchema as the parameters); a description the
    server leaves out is "", and a property without a type takes its first non-null anyOf/oneOf type (an optional
    argument), which verl's schema models require."""
    params = dict(getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {})
    params.setdefault("type", "object")
    params["properties"] = {name: _typed(prop) for name, prop in (params.get("properties") or {}).items()}
    params["required"] = params.get("required") or []
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": params, "strict": False}}


def _typed(prop: Any) -> Any:
    if not isinstance(prop, dict) or "type" in prop:
        return prop
    types = [p.get("type") for p in prop.get("anyOf") or prop.get("oneOf") or [] if isinstance(p, dict)]
    first = next((t for t in types if isinstance(t, str) and t != "null"), None)
    return {**prop, "type": first} if first else prop


def images_of(content: list, name: str) -> list:
    """The image parts of a result as Pillow images; one line for one that cannot be decoded."""
    from PIL import Image

    images = []
    for part in content:
        if getattr(part, "type", "") != "image":
            continue
        try:
            image = Image.open(io.BytesIO(base64.b64decode(part.data, validate=True)))
            if image.size[0] * image.size[1] > MAX_PICTURE_PIXELS:  # from the header, before decoding
                raise ValueError(f"{image.size[0]}x{image.size[1]} is over {MAX_PICTURE_PIXELS} pixels")
            image.load()
        except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise McpResultError(f"MCP tool {name!r} returned an image ({getattr(part, 'mime_type', '?')}) that "
                                 f"cannot be decoded ({exc}); return base64 PNG or JPEG data") from None
        images.append(image)
    return images


def check_class(cls: type, where: str) -> None:
    """An installed verl's own MCPBaseTool reaches its servers through verl's client manager, which alignrl does not
    connect: its subclasses are refused in one line."""
    theirs = [c for c in cls.__mro__ if c.__name__ == "MCPBaseTool" and c.__module__ == VERL_MCP_BASE
              and c is not MCPBaseTool]
    if theirs:
        raise ToolConfigError(f"{where}.class_name={cls.__module__}.{cls.__name__} subclasses the installed verl's "
                              "MCPBaseTool, whose client alignrl does not connect; derive it from "
                              "alignrl.rollout.mcp_tools.MCPBaseTool")


def _servers_file(value: Any, tool_config: str, where: str) -> Path:
    """The servers file: relative to the working folder (as verl opens it), else to the tool config's folder."""
    if not isinstance(value, str) or not value:
        raise ToolConfigError(f"{where}: config.type: mcp without mcp.mcp_servers_config_path is not supported; give "
                              "mcp: {mcp_servers_config_path: servers.json, tool_selected_list: [tool, ...]}")
    for path in (Path(value), Path(tool_config).parent / value):
        if path.is_file():
            return path
    raise ToolConfigError(f"{where}.mcp.mcp_servers_config_path={value}: no such file (from {Path.cwd()}); give the "
                          'JSON of {"mcpServers": {...}}')


def entry_tools(entry: dict, where: str, tool_config: str, tool_class: Callable[[], type], schema_cls: type) -> list:
    """The tools of MCP entry `entry`: its servers connected, each selected tool made as verl makes it
    (`tool_class()(config=, tool_schema=)`, the class imported once the `mcp` section is checked). One line for a bad
    `mcp` section, a selected tool no server offers, a tool two servers offer, a schema verl's models refuse."""
    mcp = entry.get("mcp")
    path = _servers_file(mcp.get("mcp_servers_config_path") if isinstance(mcp, dict) else None, tool_config, where)
    selected = mcp.get("tool_selected_list") or []
    if not isinstance(selected, list) or not all(isinstance(s, str) for s in selected):
        raise ToolConfigError(f"{where}.mcp.tool_selected_list must be a list of tool names")
    cls = tool_class()
    check_class(cls, where)
    config = entry.get("config") or {}
    group = mcp_client.connect(path, f"{where}.mcp.mcp_servers_config_path", float(config.get("timeout", 30)),
                               int(config.get("rate_limit", 10)))
    offered: dict[str, list] = {}
    for server in group.servers:
        for tool in server.tools:
            offered.setdefault(tool.name, []).append((server.spec.name, tool))
    twice = next((n for n, s in offered.items() if len(s) > 1 and (not selected or n in selected)), None)
    if twice:
        raise ToolConfigError(f"{where}: tool {twice!r} is offered by MCP servers "
                              f"{', '.join(repr(s) for s, _ in offered[twice])}; keep one of them in the servers file")
    missing = [n for n in selected if n not in offered]
    if missing or not offered:
        raise ToolConfigError(f"{where}.mcp.tool_selected_list: the MCP servers of {path} do not offer "
                              f"{', '.join(map(repr, missing)) or 'any tool'} (they offer: "
                              f"{', '.join(sorted(offered)) or 'nothing'}); select among those")
    return [_make(cls, config, offered[name][0][1], schema_cls, where) for name in (selected or offered)]


def _make(cls: type, config: dict, tool, schema_cls: type, where: str):
    try:
        schema = schema_cls.model_validate(mcp2openai(tool))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ToolConfigError(f"{where}: MCP tool {tool.name!r}'s input schema does not fit verl's function schema "
                              f"({'.'.join(map(str, first['loc']))}: {first['msg']}); give the tool typed "
                              "arguments") from None
    try:
        return cls(config=dict(config), tool_schema=schema)
    except Exception as exc:
        raise ToolConfigError(f"{where}: {cls.__name__}(config=..., tool_schema={tool.name}) raised "
                              f"{type(exc).__name__}: {exc}".splitlines()[0] + "; fix the tool or its entry") from None


PROVIDED = {
    VERL_MCP_BASE: {"MCPBaseTool": MCPBaseTool},
    "verl.tools.mcp_search_tool": {"MCPSearchTool": MCPSearchTool},
    "verl.tools.utils.mcp_clients.McpClientManager": {"ClientManager": ClientManager,
                                                      "MCPClientManager": MCPClientManager},
    "verl.tools.utils.mcp_clients.utils": {"mcp2openai": mcp2openai},
}
