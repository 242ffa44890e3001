"""verl's MCP tools (`config.type: mcp` in agent.tool_config_path) against a real MCP server of the official SDK
(tests/fixtures/mcp/demo_server.py), over stdio and over streamable HTTP and SSE on 127.0.0.1: the servers' tools and
schemas reach the prompts and the tool loop, a rollout's tool turn is the server's answer, verl's classes and a
user's subclass run as verl users write them, and every failure is one line."""

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from alignrl.data.collate import prompt_ids
from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rollout import mcp_client
from alignrl.rollout.env_agent import EnvRollout, TaskPrompt
from alignrl.rollout.mcp_client import McpServerError
from alignrl.rollout.mcp_tools import McpResultError, MCPSearchTool
from alignrl.rollout.tool_calls import ToolChat
from alignrl.rollout.verl_tools import ToolConfigError, ToolLoop, ToolResultError, load_tools, tool_environment, \
    tool_schemas
from alignrl.runtime.ports import free_ports
from conftest import one_line
from scripted_engine import ScriptedEngine as Scripted

pytestmark = pytest.mark.timeout(300)

SERVER = Path(__file__).parent / "fixtures" / "mcp" / "demo_server.py"
TIMEOUT = 120  # generous: a server's start imports the SDK on a shared machine


def _servers(folder: Path, name: str = "servers.json", **servers) -> Path:
    path = folder / name
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def _stdio(*extra) -> dict:
    return {"command": sys.executable, "args": [str(SERVER), *extra]}


def _config(folder: Path, servers: Path, selected=None, cls="verl.tools.mcp_search_tool.MCPSearchTool",
            name="tools.yaml", timeout=TIMEOUT) -> str:
    mcp = {"mcp_servers_config_path": str(servers)}
    if selected is not None:
        mcp["tool_selected_list"] = selected
    doc = {"tools": [{"class_name": cls, "config": {"type": "mcp", "timeout": timeout, "rate_limit": 120},
                      "mcp": mcp}]}
    path = folder / name
    path.write_text(json.dumps(doc))  # JSON is YAML
    return str(path)


def _call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _env(tok, path, **loop):
    return asyncio.run(tool_environment(path, tok, ToolLoop(**loop))())


def _step(env, text):
    return asyncio.run(env.step({"observation_text": "", "action_text": text, "label": None}))


@pytest.fixture(scope="module")
def stdio_servers(tmp_path_factory):
    """The demo server over stdio, connected once for the module's tests (its tool config's tools share it)."""
    folder = tmp_path_factory.mktemp("mcp")
    yield folder, _servers(folder, demo=_stdio())
    mcp_client.close_all()  # stops the stdio server


def test_the_servers_tools_and_schemas_reach_the_prompts_and_the_loop(stdio_servers):
    folder, servers = stdio_servers
    path = _config(folder, servers, ["add", "search"])
    schemas = tool_schemas(path)
    assert schemas == [
        {"type": "function", "function": {"name": "add", "description": "Add two integers.", "strict": False,
                                          "parameters": {"type": "object", "required": ["a", "b"], "properties": {
                                              "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "search", "description": "Search the tiny corpus.", "strict": False,
                                          "parameters": {"type": "object", "required": ["query"], "properties": {
                                              "query": {"type": "string"},
                                              "topk": {"type": "integer"}}}}}]  # Optional[int]: its anyOf's type
    tools = load_tools(path)
    assert [t.name for t in tools] == ["add", "search"] and all(type(t) is MCPSearchTool for t in tools)
    everything = tool_schemas(_config(folder, servers, name="all.yaml"))  # no selection: every tool of the server
    assert [s["function"]["name"] for s in everything] == ["add", "search", "crash", "snapshot", "broken_picture"]


def test_a_rollout_gets_the_servers_answer_as_its_tool_turn(tiny_model, stdio_servers):
    _, tok = tiny_model
    folder, servers = stdio_servers
    rows = [Sample([{"role": "user", "content": "what is 2 + 5?"}], "7")]
    prompts = [TaskPrompt(prompt_ids(tok, r), r) for r in rows]
    call, answer = tok.encode(_call("add", a=2, b=5), add_special_tokens=False), tok.encode(" so 7",
                                                                                             add_special_tokens=False)
    key = tuple(prompts[0])
    engine = Scripted({key: [call, answer]}, key=lambda p: key)  # one row: every turn is its
    make = tool_environment(_config(folder, servers, ["add"]), tok, ToolLoop())
    ro = EnvRollout(engine, tok, make, response_cap=400).generate(prompts, SamplingParams(max_new_tokens=200))
    feedback = tok.encode(ToolChat(tok, []).feedback(["7"]), add_special_tokens=False)
    assert ro.response_ids[0][ro.response_mask[0]].tolist() == call + feedback + answer  # the server's 2 + 5
    assert engine.calls[1][0][0] == list(prompts[0]) + call + feedback
    assert ro.stats["env/tool_calls"].tolist() == [1.0]


def test_tool_errors_are_the_tool_response_and_the_episode_goes_on(tiny_model, stdio_servers):
    _, tok = tiny_model
    folder, servers = stdio_servers
    env = _env(tok, _config(folder, servers, ["add", "search"]), max_parallel_calls=3)
    got = _step(env, _call("search", query="boom") + _call("add", a="x") + _call("search", query="paris", topk=2))
    feedback = got["environment_feedback"]
    assert "Error executing tool search" in feedback  # the server's text for a tool that raised
    assert "Error executing tool add" in feedback and "valid integer" in feedback  # arguments the schema refuses
    assert "Doc 1 (Title: paris) found 2" in feedback and got["done"] is False
    assert got["extra_logs"]["tool_calls"] == 3.0


def test_a_users_subclass_of_verls_mcp_base_tool_runs_unchanged(tiny_model, stdio_servers, monkeypatch):
    _, tok = tiny_model
    folder, servers = stdio_servers
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    (folder / "shout_tools.py").write_text(textwrap.dedent('''
        from verl.tools.mcp_base_tool import MCPBaseTool


        class ShoutTool(MCPBaseTool):
            def _parse_tool_result(self, content):
                return " ".join(p.text.upper() for p in content if p.type == "text"), {"status": "ok"}
    '''))
    path = _config(folder, servers, ["search"], cls="shout_tools.ShoutTool", name="shout.yaml")
    (tool,) = load_tools(path)
    instance = asyncio.run(tool.create())
    response, reward, metrics = asyncio.run(tool.execute(instance, {"query": "rome"}))
    assert response.text == "DOC 1 (TITLE: ROME) FOUND 1" and reward == 0.0 and metrics["status"] == "ok"
    assert asyncio.run(tool.calc_reward(instance)) == ["DOC 1 (TITLE: ROME) FOUND 1"]  # verl's result list
    assert "FOUND 1" in _step(_env(tok, path), _call("search", query="x"))["environment_feedback"]


def test_images_take_the_tool_image_path(tiny_model, stdio_servers):
    _, tok = tiny_model
    folder, servers = stdio_servers
    (tool,) = load_tools(_config(folder, servers, ["snapshot"], name="pic.yaml"))
    response, _, _ = asyncio.run(tool.execute(asyncio.run(tool.create()), {"color": "red"}))
    assert response.text == "a red square" and response.image[0].getpixel((0, 0)) == (255, 0, 0)
    env = _env(tok, _config(folder, servers, ["snapshot", "broken_picture"], name="pics.yaml"))
    with pytest.raises(ToolResultError) as err:  # the tiny policy reads text only
        _step(env, _call("snapshot", color="red"))
    assert "returned image, but the policy is a text-only model" in one_line(str(err.value))
    with pytest.raises(McpResultError) as err:
        _step(env, _call("broken_picture"))
    assert "returned an image (image/png) that cannot be decoded" in one_line(str(err.value))


@pytest.mark.parametrize("mcp, expect", [
    (None, "config.type: mcp without mcp.mcp_servers_config_path is not supported"),
    ({"mcp_servers_config_path": "missing.json"}, "mcp_servers_config_path=missing.json: no such file"),
    ({"mcp_servers_config_path": "SERVERS", "tool_selected_list": ["add", "nope"]},
     "do not offer 'nope' (they offer: add, broken_picture, crash, search, snapshot)"),
    ({"mcp_servers_config_path": "SERVERS", "tool_selected_list": "add"}, "tool_selected_list must be a list"),
])
def test_a_bad_mcp_entry_is_one_line(stdio_servers, mcp, expect):
    folder, servers = stdio_servers
    entry = {"class_name": "verl.tools.mcp_base_tool.MCPBaseTool", "config": {"type": "mcp", "timeout": TIMEOUT}}
    if mcp is not None:
        entry["mcp"] = {k: (str(servers) if v == "SERVERS" else v) for k, v in mcp.items()}
    path = folder / "bad.yaml"
    path.write_text(json.dumps({"tools": [entry]}))
    with pytest.raises(ToolConfigError) as err:
        load_tools(str(path))
    assert expect in one_line(str(err.value)) and "agent.tool_config_path" in str(err.value)


@pytest.mark.parametrize("servers, expect", [
    ("{", "cannot be read as JSON"),
    ('{"servers": {}}', "has no 'mcpServers' mapping"),
    ('{"mcpServers": {"x": {"args": []}}}', "mcpServers.x needs either a 'url' (HTTP) or a 'command'"),
    ('{"mcpServers": {"x": {"url": "http://127.0.0.1:9/mcp", "transport": "ws"}}}', "transport='ws': use sse"),
])
def test_a_bad_servers_file_is_one_line(tmp_path, servers, expect):
    (tmp_path / "servers.json").write_text(servers)
    with pytest.raises(ToolConfigError) as err:
        load_tools(_config(tmp_path, tmp_path / "servers.json"))
    assert expect in one_line(str(err.value))


def test_a_server_that_cannot_start_or_be_reached_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the failed servers' stderr files, which errors name
    port = free_ports(1)[0]  # nothing listens there
    cases = [
        ({"command": "no-such-mcp-server-xyz"}, "failed to start (FileNotFoundError"),
        ({"command": sys.executable, "args": ["-c", "import sys; print('no config for you', file=sys.stderr); "
                                                    "sys.exit(3)"]}, "ends: no config for you"),
        ({"url": f"http://127.0.0.1:{port}/mcp"}, "failed to start (ConnectError"),
        ({"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]}, "did not answer within 3s"),
    ]
    for i, (server, expect) in enumerate(cases):
        with pytest.raises(McpServerError) as err:
            load_tools(_config(tmp_path, _servers(tmp_path, f"s{i}.json", broken=server), timeout=3))
        assert expect in one_line(str(err.value)) and "MCP server 'broken'" in str(err.value)


def test_without_the_sdk_the_error_names_pip_install_mcp(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ToolConfigError) as err:
        load_tools(_config(tmp_path, _servers(tmp_path, demo=_stdio())))
    assert one_line(str(err.value)).endswith("pip install mcp")


def test_a_stdio_server_that_dies_mid_run_stops_the_run_in_one_line(tiny_model, tmp_path):
    _, tok = tiny_model
    env = _env(tok, _config(tmp_path, _servers(tmp_path, demo=_stdio()), ["add", "crash"]))
    try:
        assert "3" in _step(env, _call("add", a=1, b=2))["environment_feedback"]
        for _ in range(2):  # the call that kills it, and any after
            with pytest.raises(McpServerError) as err:
                _step(env, _call("crash"))
            assert "MCP server 'demo'" in one_line(str(err.value)) and "stopped answering" in str(err.value)
    finally:
        mcp_client.close_all()


def _wait_for_port(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, "the demo MCP server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the demo MCP server did not listen on {port}")


@pytest.mark.parametrize("transport, route, extra", [
    ("streamable-http", "/mcp", {}),
    ("streamable-http", "/mcp", {"transport": "streamable-http", "headers": {"X-Team": "rl"}}),  # a client of its own
    ("sse", "/sse", {"auth_token": "t0k"}),  # verl's Bearer token, over SSE
])
def test_an_http_server_answers_and_one_killed_mid_run_is_one_line(tiny_model, tmp_path, transport, route, extra):
    _, tok = tiny_model
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, str(SERVER), transport, str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, server)
        servers = _servers(tmp_path, demo={"url": f"http://127.0.0.1:{port}{route}", **extra})
        env = _env(tok, _config(tmp_path, servers, ["add"]))
        assert ToolChat(tok, []).feedback(["12"]) == _step(env, _call("add", a=5, b=7))["environment_feedback"]
        server.kill()
        server.wait(TIMEOUT)
        with pytest.raises(McpServerError) as err:
            _step(env, _call("add", a=1, b=1))
        assert f"MCP server 'demo' (http://127.0.0.1:{port}{route}) stopped answering" in one_line(str(err.value))
    finally:
        server.kill()
        server.wait(TIMEOUT)
        mcp_client.close_all()
