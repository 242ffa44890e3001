"""Connections to the MCP servers of verl's `config.type: mcp` tools (`mcp_tools`), over the official `mcp` SDK.

A servers file is the JSON verl and MCP clients share: `{"mcpServers": {name: server}}`, each server either a `url`
(streamable HTTP; SSE where the URL ends in /sse, `"transport": "sse"` is given, or an `auth_token` is given without
a transport, as verl does) with optional `headers` and `auth_token` (a Bearer header), or a `command` with `args`,
`env` and `cwd` (a subprocess over stdio, whose stderr goes to a log file the errors name). Each server is connected
once per process and servers file and held open for the run (verl's client opens a connection per call), on a loop
of its own in a background thread, so that the episodes' loops (whichever loop calls) share it.

Failures are one line: a missing or malformed file, the SDK not installed, a server that cannot be started or
reached within the timeout (a URL is retried until then, as verl waits for its servers), and a server that stops
answering mid-run (`McpServerError`, which stops the run rather than training the policy on error texts). A tool's
own error is not one: it is the call's result (`is_error`), returned as the server gave it.
Left out: OAuth flows, sampling and elicitation callbacks, resources and prompts (tools only).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from alignrl.rollout.remote import ServiceError
from alignrl.rollout.verl_tool_api import ToolConfigError

CONNECTION_CLOSED = -32000  # the MCP SDK's error code for a connection that closed under a request


class McpServerError(ServiceError):
    """An MCP server could not be started or reached, or stopped answering; one line naming it."""

    def __init__(self, message: str):
        super().__init__(message, down=True)

    def __reduce__(self):
        return McpServerError, (str(self),)


def sdk():
    """The `mcp` SDK's client pieces; one line naming `pip install mcp` when it is not installed."""
    try:
        from mcp import Client
        from mcp.client.sse import sse_client
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
    except ImportError as exc:
        raise ToolConfigError(f"MCP tools (config.type: mcp) need the MCP SDK, which failed to import ({exc}); "
                              "pip install mcp") from None
    return dict(Client=Client, sse_client=sse_client, StdioServerParameters=StdioServerParameters,
                stdio_client=stdio_client, streamable_http_client=streamable_http_client)


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One entry of a servers file."""

    name: str
    url: str = ""
    transport: str = ""  # "sse" or "streamable-http" for a URL
    headers: tuple = ()  # ((key, value), ...)
    command: str = ""
    args: tuple = ()
    env: tuple = ()
    cwd: str | None = None

    def where(self) -> str:
        """The server as messages and logs name it: its URL without query, or its command without arguments
        (arguments and query strings often carry keys)."""
        return f"MCP server {self.name!r} ({self.url.split('?')[0] if self.url else self.command[:120]})"


def read_servers(path: Path, where: str) -> list[ServerSpec]:
    """The servers of the servers file at `path`; `where` names the key that gave it, for its one-line errors."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ToolConfigError(f"{where}={path} cannot be read as JSON ({' '.join(str(exc).split())}); give "
                              '{"mcpServers": {"name": {"url": ...} or {"command": ..., "args": [...]}}}') from None
    servers = doc.get("mcpServers") if isinstance(doc, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ToolConfigError(f"{where}={path} has no 'mcpServers' mapping; give "
                              '{"mcpServers": {"name": {"url": ...} or {"command": ..., "args": [...]}}}')
    return [_spec(name, server, f"{where}={path}: mcpServers.{name}") for name, server in servers.items()]


def _spec(name: str, server: Any, where: str) -> ServerSpec:
    if not isinstance(server, dict) or bool(server.get("url")) == bool(server.get("command")):
        raise ToolConfigError(f"{where} needs either a 'url' (HTTP) or a 'command' with 'args' (stdio)")
    args, env, headers = server.get("args") or [], server.get("env") or {}, server.get("headers") or {}
    if not isinstance(args, list) or not isinstance(env, dict) or not isinstance(headers, dict):
        raise ToolConfigError(f"{where}: 'args' must be a list, 'env' and 'headers' mappings")
    if server.get("url"):
        url, transport = str(server["url"]), str(server.get("transport") or server.get("type") or "")
        transport = {"http": "streamable-http", "streamable_http": "streamable-http"}.get(transport, transport)
        if not transport:  # verl reaches a server with an auth_token over SSE
            sse = url.rstrip("/").endswith("/sse") or "auth_token" in server
            transport = "sse" if sse else "streamable-http"
        if transport not in ("sse", "streamable-http"):
            raise ToolConfigError(f"{where}.transport={transport!r}: use sse or streamable-http")
        if server.get("auth_token"):
            headers = {**headers, "Authorization": f"Bearer {server['auth_token']}"}
        return ServerSpec(name, url=url, transport=transport, headers=tuple((str(k), str(v)) for k, v in
                                                                              headers.items()))
    return ServerSpec(name, command=str(server["command"]), args=tuple(map(str, args)),
                      env=tuple((str(k), str(v)) for k, v in env.items()), cwd=server.get("cwd"))


class _Hub:
    """The background thread whose loop holds every connection, so that any loop (or none) can call the tools."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="alignrl-mcp", daemon=True).start()

    def run(self, coro, timeout: float):
        """`coro` run on the hub, waited for here (no loop running in this thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def wait(self, coro):
        """`coro` run on the hub, awaited from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


_HUB: _Hub | None = None
_HUB_LOCK = threading.Lock()


def hub() -> _Hub:
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = _Hub()
            atexit.register(close_all)
        return _HUB


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside `exc`'s exception groups (the SDK's task groups wrap a transport's failure)."""
    while getattr(exc, "exceptions", None):  # an ExceptionGroup (spelled so for Python 3.10's backport too)
        exc = exc.exceptions[0]
    return exc


def _say(exc: BaseException) -> str:
    leaf = _leaf(exc)
    text = " ".join(str(getattr(leaf, "message", None) or leaf).split()) or type(leaf).__name__
    return f"{type(leaf).__name__}: {text}"[:300]


class Server:
    """One MCP server held open: an owner task enters the SDK's client and waits; calls run in tasks of their own."""

    def __init__(self, spec: ServerSpec):
        self.spec, self.tools, self.error = spec, [], ""
        self.client = self.task = None
        self.log, self.errlog = "", None  # the stdio server's stderr file
        self.http = None  # the HTTP client of a streamable-HTTP server with headers
        self.ready: asyncio.Future | None = None
        self.stop = self.gone = None

    def _transport(self, api: dict):
        spec = self.spec
        if spec.url and spec.transport == "sse":
            return api["sse_client"](spec.url, headers=dict(spec.headers) or None)
        if spec.url:
            if spec.headers:  # the SDK takes headers as a client of its own; closed when the connection ends
                import httpx2

                self.http = httpx2.AsyncClient(headers=dict(spec.headers), timeout=httpx2.Timeout(30, read=300))
            return api["streamable_http_client"](spec.url, http_client=self.http)
        fd, self.log = tempfile.mkstemp(prefix=f"alignrl-mcp-{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}-",
                                        suffix=".log")
        params = api["StdioServerParameters"](command=spec.command, args=list(spec.args), env=dict(spec.env) or None,
                                              cwd=spec.cwd)
        self.errlog = os.fdopen(fd, "w")
        return api["stdio_client"](params, errlog=self.errlog)

    async def _hold(self, api: dict, timeout: float) -> None:
        try:
            async with api["Client"](self._transport(api), read_timeout_seconds=timeout) as client:
                tools, cursor = [], None
                while True:  # every page of the server's tool list
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.client, self.tools = client, tools
                self.ready.set_result(None)
                await self.stop.wait()
            if self.log:  # closed as asked: its stderr is kept only where an error names it
                Path(self.log).unlink(missing_ok=True)
        except BaseException as exc:  # its end, however it ends, is what callers wait on
            closing = isinstance(exc, asyncio.CancelledError) and self.stop.is_set()
            self.error = _say(exc)
            if not self.ready.done():
                self.ready.cancel() if closing else self.ready.set_exception(McpServerError(self._failed(exc)))
            if closing:
                raise
        finally:
            self.client = None
            self.gone.set()
            if self.errlog is not None:
                self.errlog.close()
            if self.http is not None:
                await self.http.aclose()

    def _failed(self, exc: BaseException) -> str:
        return f"{self.spec.where()} failed to start ({_say(exc)}){self._stderr()}"

    def _stderr(self) -> str:
        """Where a stdio server's stderr is, and its last line, for an error about it."""
        if not self.log or not Path(self.log).is_file():
            return ""
        lines = [line for line in Path(self.log).read_text(errors="replace").splitlines() if line.strip()]
        return f"; its stderr ({self.log}) ends: {' '.join(lines[-1].split())[:200]}" if lines else \
            f"; its stderr is in {self.log}"

    async def open(self, api: dict, timeout: float) -> None:
        """Connected and its tools listed within `timeout` seconds; a URL is tried again until then."""
        deadline = time.monotonic() + timeout
        while True:
            self.ready, self.stop, self.gone = asyncio.get_running_loop().create_future(), asyncio.Event(), \
                asyncio.Event()
            self.task = asyncio.ensure_future(self._hold(api, timeout))
            try:
                await asyncio.wait_for(asyncio.shield(self.ready), max(0.1, deadline - time.monotonic()))
                return
            except asyncio.TimeoutError:
                await self.close()
                raise McpServerError(f"{self.spec.where()} did not answer within {timeout:g}s; start it, check "
                                     "its url or command, or raise the tool's config.timeout") from None
            except McpServerError:
                if not self.spec.url or time.monotonic() + 1 > deadline:
                    raise
                await asyncio.sleep(1)  # a server that is still starting (verl waits for its servers too)

    async def call(self, name: str, arguments: dict, timeout: float):
        """The server's CallToolResult; McpServerError when the server is gone (or goes while answering)."""
        if self.client is None:
            raise self._down()
        call = asyncio.ensure_future(self.client.call_tool(name, arguments, read_timeout_seconds=timeout))
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            done, _ = await asyncio.wait({call, gone}, timeout=timeout + 5, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the episode awaiting this call was cancelled: take both tasks with it
            call.cancel()
            raise
        finally:
            gone.cancel()
        if call not in done:
            call.cancel()
            raise self._down() if self.gone.is_set() else TimeoutError(f"no answer within {timeout:g}s")
        if call.cancelled():  # by the connection's own task group, as it fell
            raise self._down()
        exc = call.exception()
        if exc is not None:
            if getattr(exc, "code", None) == CONNECTION_CLOSED or self.gone.is_set():
                raise self._down()
            raise exc
        return call.result()

    def _down(self) -> McpServerError:
        why = f" ({self.error})" if self.error else ""
        return McpServerError(f"{self.spec.where()} stopped answering{why}{self._stderr()}; restart it and the run "
                              "(its tool calls cannot go on)")

    async def close(self) -> None:
        """Closed: a connected server by leaving its client (a stdio server is stopped), one still connecting by
        cancelling it."""
        if self.task is None or self.task.done():
            return
        self.stop.set()
        if self.client is None:
            self.task.cancel()
        try:
            await asyncio.wait_for(self.task, 10)
        except BaseException:  # cancelled, or a server that will not close: left to the process's exit
            pass


class ServerGroup:
    """The servers of one servers file, connected together, and which of them offers each tool."""

    def __init__(self, servers: list[Server], rate_limit: int):
        self.servers, self.routes = servers, {}
        self.slots = asyncio.Semaphore(max(1, rate_limit))  # calls in flight at once, on the hub's loop
        for server in servers:
            for tool in server.tools:
                self.routes.setdefault(tool.name, server)

    def alive(self) -> bool:
        return all(s.client is not None for s in self.servers)

    async def call(self, name: str, arguments: dict, timeout: float):
        async with self.slots:
            return await self.routes[name].call(name, arguments, timeout)


_GROUPS: dict[tuple, ServerGroup] = {}
ROUTES: dict[str, ServerGroup] = {}  # tool name -> the group that serves it, as verl's client manager maps them


def connect(path: Path, where: str, timeout: float, rate_limit: int) -> ServerGroup:
    """The servers of `path` connected and their tools listed, once per process and file content: the prompts'
    schemas and the episodes' tools share the connections (a group whose server died is connected again)."""
    api = sdk()
    specs = read_servers(path, where)
    key = (str(path.resolve()), path.read_text())
    group = _GROUPS.get(key)
    if group is None or not group.alive():
        if group is not None:
            hub().run(_close(group), 30)
        group = _GROUPS[key] = hub().run(_open(api, specs, timeout, rate_limit), timeout * len(specs) + 30)
    for name in group.routes:
        ROUTES[name] = group
    return group


async def _open(api: dict, specs: list[ServerSpec], timeout: float, rate_limit: int) -> ServerGroup:
    servers = [Server(spec) for spec in specs]
    try:
        await asyncio.gather(*(s.open(api, timeout) for s in servers))
    except BaseException:
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        raise
    return ServerGroup(servers, rate_limit)


async def _close(group: ServerGroup) -> None:
    await asyncio.gather(*(s.close() for s in group.servers), return_exceptions=True)


async def call_tool(name: str, arguments: dict, timeout: float):
    """Tool `name` called on the server that offers it, from any loop (verl's ClientManager.call_tool)."""
    group = ROUTES.get(name)
    if group is None:
        raise ToolConfigError(f"no connected MCP server offers tool {name!r}; list it in the tool config "
                              "(config.type: mcp, mcp.tool_selected_list)")
    return await hub().wait(group.call(name, arguments, timeout))


def close_all() -> None:
    """Every connection closed (stdio servers stopped); at exit, and by tests."""
    if _HUB is None:
        return
    groups = list(_GROUPS.values())
    _GROUPS.clear()
    ROUTES.clear()
    for group in groups:
        try:
            _HUB.run(_close(group), 30)
        except Exception:  # exiting: a server that will not close is left to the operating system
            pass
