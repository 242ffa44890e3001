"""verl's tool agent loop (actor_rollout_ref.rollout.multi_turn, alignrl's agent.tool_config_path): a tool config
YAML in verl's format, its tools, and an environment per episode that `rollout.env_agent.EnvRollout` plays (with
verl's interactions too).

The YAML lists `tools: [{class_name, config, tool_schema}]`. verl's gsm8k and search tools are alignrl's own
(`verl_builtin_tools`); any other class_name is imported as a module path (the working folder and PYTHONPATH) and
must subclass verl's `BaseTool`. An entry with `config.type: mcp` and verl's `mcp` section is a tool per tool of its
MCP servers (`mcp_tools`), connected when the tools are made (and when their schemas are read). When verl is not
installed, the modules such a tool imports are provided under their names (`verl_tool_api`); an installed verl is
used as it is.

An episode (`ToolEnvironment`) is verl's ToolAgentLoop: the prompt is the row's messages templated with the tools'
schemas, which the run's prompts carry (`tool_schemas`: data.filter_overlong_prompts and data.max_prompt_length
count their tokens, as verl's dataset does); after each assistant turn its hermes tool calls (up to
max_parallel_calls) run concurrently, each tool instance created with the row's
`extra_info.tools_kwargs[name].create_kwargs`, executed and released; the responses, cut to
max_tool_response_length, are appended as tool messages (not trained on) and the policy answers again. A response
with images (verl's `ToolResponse(image=[...])` of Pillow images, as its image_zoom_in_tool returns) is verl's
multimodal tool message, an image item per image before its text (only the text is cut), whose images a
vision-language policy reads after the row's earlier ones (`env_agent`); a video, an image that is not a Pillow image,
or images for a text-only policy is one line. A turn
without calls, the assistant- or user-turn limit, or the response cap ends it (a turn that reached the cap runs no
calls, as verl stops on length before parsing). The steps give no rewards: the run's reward function scores the
whole response, as verl's reward manager does, and reads the episode's num_turns, its interaction's turn_scores and
its tools' step rewards (tool_rewards) in extra_info, as verl merges its agent loop's extra_fields there.

With verl's interactions (agent.interaction_config_path, `verl_interactions`), a turn without calls of a row that
has `extra_info.interaction_kwargs` is answered by the interaction that row names, as a user message (not trained
on); its should_terminate ends the episode, the turn limits and the response cap end it as they end tool turns, and
its replies count as user turns. Without tools, turns are not parsed for calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from alignrl.data.records import Sample
from alignrl.errors import UserError
from alignrl.rewards.values import plain_number
from alignrl.utils.user_files import provide_modules
from alignrl.rollout import mcp_tools
from alignrl.rollout.observation_images import given_media, needs_vision, pictures_of
from alignrl.rollout.remote import ServiceError
from alignrl.rollout.tool_calls import ToolCall, ToolChat, parse_hermes, truncate_response
from alignrl.rollout.verl_builtin_tools import BUILTIN
from alignrl.rollout.verl_code_tool import SandboxFusionTool
from alignrl.rollout.verl_interactions import Interactions, Talk
from alignrl.rollout.verl_tool_api import KEY, BaseTool, ToolConfigError, import_class, verl_api


class ToolResultError(UserError):
    """A tool returned something the loop cannot append; one line naming the tool and the fix."""



@dataclasses.dataclass(frozen=True)
class ToolLoop:
    """verl's multi_turn settings (0: no limit)."""

    max_assistant_turns: int = 0
    max_user_turns: int = 0
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    truncate_side: str = "middle"
    format: str = "hermes"


class ToolEnvironment:
    """One episode of verl's tool loop, in the environment protocol `EnvRollout` plays (reset/step)."""

    def __init__(self, tools: dict[str, Any], chat: ToolChat | None, loop: ToolLoop,
                 interactions: Interactions | None = None):
        """`chat` None: no tools (a loop of interactions alone), so turns are not parsed for calls."""
        self.tools, self.chat, self.loop, self.interactions = tools, chat, loop, interactions
        self.tools_kwargs: dict = {}
        self.talk: Talk | None = None  # the episode's conversation with its interaction, when its row names one
        self.assistant_turns = self.user_turns = 0
        self.tool_rewards: list[float] = []  # each call's step reward, in call order, as verl's loop collects them
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_call_parse_errors": 0.0}

    async def reset(self, states: dict, **kwargs) -> dict:
        """The prompt as given: the row's chat templated with the tools' schemas and cut to data.max_prompt_length
        (`tool_schemas` in the run's prompts), or a prompt without a chat template. A prompt templated without the
        schemas where the template prints them (a caller that did not pass them) gets them, uncut."""
        sample = states.get("sample")
        if isinstance(sample, Sample):
            self.tools_kwargs = (sample.extra or {}).get("tools_kwargs") or {}
            if self.interactions is not None:
                self.talk = await self.interactions.start(sample)
            messages = list(sample.messages)
            if messages and sample.prompt_text is None and self.chat is not None and \
                    self.chat.lacks_schemas(states["observation"], messages):
                return {"observation": self.chat.prompt(messages)}
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        self.assistant_turns += 1
        loop = self.loop
        if states.get("truncated"):  # the turn reached the response cap: verl stops before parsing its calls
            return self._result("", done=True)
        if (loop.max_assistant_turns and self.assistant_turns >= loop.max_assistant_turns) or \
                (loop.max_user_turns and self.user_turns >= loop.max_user_turns):
            return self._result("", done=True)
        calls, bad = parse_hermes(states["action_text"]) if self.chat is not None else ([], 0)
        self.counts["tool_call_parse_errors"] += bad
        if self.talk is not None:
            self.talk.assistant(states["action_text"])
        if not calls:  # the interaction answers a turn without calls, as a user; without one the episode ends
            if self.talk is None:
                return self._result("", done=True)
            feedback, done = await self.talk.reply()
            self.user_turns += 1
            return self._result(feedback, done)
        answers = await asyncio.gather(*(self._call(c) for c in calls[:loop.max_parallel_calls]))
        texts = [text for text, _, _ in answers]
        self.tool_rewards += [reward for _, reward, _ in answers if reward is not None]  # verl skips a None reward
        self.user_turns += 1
        if self.talk is not None:
            self.talk.tools(texts)
        pictures = [p for _, _, p in answers]
        if not any(pictures):  # text alone: the tool turn exactly as before images were supported
            return self._result(self.chat.feedback(texts), done=False)
        result = self._result(self.chat.feedback(texts, [len(p) for p in pictures]), done=False)
        result["environment_images"] = [p for some in pictures for p in some]  # in the order of their placeholders
        return result

    async def episode_ended(self) -> dict[str, Any]:
        """Called once the episode ended, however it ended (`EnvRollout`): verl's interaction is finalized. Returns
        what verl's reward manager adds to the reward function's extra_info: the agent loop's extra_fields (the
        interaction's turn scores and the tools' step rewards, empty lists when there were none) and num_turns."""
        if self.talk is not None:
            await self.talk.finish()
        return {"turn_scores": list(self.talk.scores) if self.talk is not None else [],
                "tool_rewards": list(self.tool_rewards), "num_turns": self._num_turns()}

    def _num_turns(self) -> int:
        """verl's num_turns: the prompt's user turn, the assistant turns and the tool-response and interaction turns
        (agent/turns counts assistant turns only)."""
        return self.user_turns + self.assistant_turns + 1

    def _result(self, feedback: str, done: bool) -> dict:
        logs = dict(self.counts, tool_calls_per_turn=self.counts["tool_calls"] / self.assistant_turns,
                    verl_num_turns=float(self._num_turns()))
        if self.talk is not None:
            logs.update(self.talk.logs())
        return {"environment_feedback": feedback, "done": done, "extra_logs": logs}

    async def _call(self, call: ToolCall) -> tuple[str, float | None, list]:
        """The call's response text, cut to max_tool_response_length (the text alone: its images are kept whole), its
        step reward (execute's second value; None: none) and its images (Pillow images, [] without). A call that fails
        (an unknown tool, arguments that are not JSON, an exception in the tool) answers verl's error text with reward
        0.0, and the episode goes on as in verl; but a service of alignrl's own that stopped answering (the search
        tool's retrieval server, after its retries) stops the run in one line, rather than training the policy on error
        texts. Images the loop cannot append (a video, not Pillow images, a text-only policy) stop it in one line."""
        self.counts["tool_calls"] += 1
        tool = instance_id = None
        try:
            tool = self.tools[call.name]
            created = await tool.create(create_kwargs=(self.tools_kwargs.get(call.name) or {}).get("create_kwargs",
                                                                                                    {}))
            instance_id = created[0] if isinstance(created, tuple) else created
            got = await tool.execute(instance_id, json.loads(call.arguments))
        except (ServiceError, mcp_tools.McpResultError):  # a service gone, an MCP image that cannot be read
            raise
        except Exception as exc:
            self.counts["tool_errors"] += 1
            return f"Error when executing tool: {exc}", 0.0, []
        finally:
            if tool is not None and instance_id:
                await tool.release(instance_id)
        text, pictures = _response(got[0] if isinstance(got, tuple) else got, call.name)
        if pictures:
            needs_vision(self.chat.tokenizer, f"tool {call.name!r}", ToolResultError)
        reward = _step_reward(got[1], call.name) if isinstance(got, tuple) and len(got) > 1 else None
        return truncate_response(text, self.loop.max_tool_response_length, self.loop.truncate_side), reward, pictures


def _step_reward(value: Any, name: str) -> float | None:
    """A tool's step reward as the reward function reads it in extra_info["tool_rewards"]: a finite float, or None
    (no reward: verl leaves it out). Checked here, where the tool is known, rather than in the user's reward."""
    if value is None:
        return None
    value = plain_number(value)  # a 0-d tensor or numpy scalar, as tools return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ToolResultError(f"tool {name!r} returned the step reward {value!r:.80}; return a finite number (or None) "
                              "as execute's second value")
    return float(value)


def _response(response: Any, name: str) -> tuple[str, list]:
    """A tool's response as its text and its images (Pillow images, as verl's tools return them; [] without): verl's
    ToolResponse, a dict with "text" (and "image"), or a string (older verl tools). Videos are refused."""
    if isinstance(response, str):
        return response, []
    get = response.get if isinstance(response, dict) else lambda k: getattr(response, k, None)
    if given_media(get("video")):  # Qwen2-VL's video inputs (frames, their own grids and tokens) are not read here
        raise ToolResultError(f"tool {name!r} returned video: alignrl's tool loop appends text and images only; "
                              "return its frames as images (ToolResponse(image=[...]))")
    image = get("image")
    return get("text") or "", pictures_of(image, f"tool {name!r}", ToolResultError) if given_media(image) else []


def verl_tool_modules() -> tuple[type, type]:
    """verl's tool API (`verl_api`); where alignrl provides it, verl's code tool module too, which recipes subclass
    (ReTool's CustomSandboxFusionTool)."""
    base, schema_cls = verl_api()
    if base is BaseTool:
        provide_modules({"verl.tools.sandbox_fusion_tools": {"SandboxFusionTool": SandboxFusionTool},
                         **mcp_tools.PROVIDED}, "verl's code and MCP tools, as alignrl provides them (verl is not "
                        "installed)")
    return base, schema_cls


def load_tools(path: str) -> list:
    """The tools of verl's tool config YAML at `path`, each made as verl makes it (`cls(config=, tool_schema=)`).
    One line for a missing file, bad YAML, an entry without class_name, an unknown class, a bad schema."""
    entries = _entries(path)
    base, schema_cls = verl_tool_modules()
    tools = [t for i, entry in enumerate(entries) for t in _make_tools(entry, i, path, base, schema_cls)]
    _check_names([t.name for t in tools], path)
    return tools


def tool_schemas(path: str) -> list[dict] | None:
    """The tools' schemas of the tool config at `path` (None without one: agent.tool_config_path unset), as the
    episodes' prompts render them (`tool_environment`),
    read without making the tools: the prompts are measured and cut with them before the tools load, and making one
    may contact its service (the search tool asks its retrieval server). An entry without a tool_schema takes it
    from its class, as verl's BaseTool does: that tool alone is made here."""
    if not path:
        return None
    entries = _entries(path)
    base, schema_cls = verl_tool_modules()
    schemas = []
    for i, entry in enumerate(entries):
        where = _where(entry, i, path)
        if _is_mcp(entry):  # the servers give the schemas: they are connected here, once for the run's process
            schemas += [dump_schema(t.tool_schema) for t in _make_tools(entry, i, path, base, schema_cls)]
            continue
        schema = _schema(entry, where, schema_cls)
        schemas.append(dump_schema(schema if schema is not None else
                                   _make_tool(entry, i, path, base, schema_cls).tool_schema))
    _check_names([s["function"]["name"] for s in schemas], path)
    return schemas


def dump_schema(schema) -> dict:
    """A tool's schema as the chat template gets it (verl's dump: the fields the file or the tool set)."""
    return schema.model_dump(exclude_unset=True, exclude_none=True)


def _entries(path: str) -> list:
    """The 'tools' list of the tool config at `path`; one line for a missing file, bad YAML or no list."""
    file = Path(path)
    if not file.is_file():
        raise ToolConfigError(f"{KEY}={path}: no such file (from {Path.cwd()}); give verl's tool config YAML "
                              "(tools: [{class_name, config, tool_schema}])")
    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{KEY}={path} is not valid YAML ({' '.join(str(exc).split())}); fix the file") from exc
    entries = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{KEY}={path} has no 'tools' list; write tools: [{{class_name: ..., config: "
                              "{type: native}, tool_schema: {...}}]")
    return entries


def _check_names(names: list, path: str) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolConfigError(f"{KEY}={path}: tool name {twice[0]!r} is given twice; give each tool its own "
                              "tool_schema.function.name")


def _where(entry: Any, i: int, path: str) -> str:
    """Where entry `i` is, for its errors, once its class_name and config are checked."""
    where = f"{KEY}={path}: tools[{i}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ToolConfigError(f"{where} has no class_name; give the tool class's module path, e.g. "
                              "verl.tools.gsm8k_tool.Gsm8kTool")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config is a {type(config).__name__}; give a mapping (e.g. {{type: native}})")
    if config.get("type", "native") not in ("native", "mcp"):
        raise ToolConfigError(f"{where}.config.type={config['type']!r} is not supported (only native and MCP tools, "
                              "not benchmax ones); use a BaseTool subclass with type: native or type: mcp")
    return where


def _is_mcp(entry: dict) -> bool:
    return (entry.get("config") or {}).get("type") == "mcp"


def _make_tools(entry: Any, i: int, path: str, base: type, schema_cls: type) -> list:
    """Entry `i`'s tools: one for a native entry, one per selected tool of its servers for an MCP one."""
    where = _where(entry, i, path)
    if not _is_mcp(entry):
        return [_make_tool(entry, i, path, base, schema_cls)]
    name = entry["class_name"]
    return mcp_tools.entry_tools(entry, where, path, lambda: mcp_tools.BUILTIN_MCP.get(name) or BUILTIN.get(name) or
                                 _tool_class(name, where, base), schema_cls)


def _schema(entry: dict, where: str, schema_cls: type):
    """The entry's tool_schema validated as verl validates it, or None where the file gives none."""
    if entry.get("tool_schema") is None:
        return None
    try:
        return schema_cls.model_validate(entry["tool_schema"])
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ToolConfigError(f"{where}.tool_schema: {'.'.join(map(str, first['loc']))}: {first['msg']}; give "
                              "an OpenAI function schema {type: function, function: {name, description, "
                              "parameters}}") from exc


def _make_tool(entry: Any, i: int, path: str, base: type, schema_cls: type):
    where = _where(entry, i, path)
    schema = _schema(entry, where, schema_cls)
    cls = BUILTIN.get(entry["class_name"]) or _tool_class(entry["class_name"], where, base)
    try:
        return cls(config=entry.get("config") or {}, tool_schema=schema)
    except Exception as exc:
        raise ToolConfigError(f"{where}: {entry['class_name']}(config=..., tool_schema=...) raised "
                              f"{type(exc).__name__}: {exc}".splitlines()[0] + "; fix the tool or its entry") from exc


def _tool_class(name: str, where: str, base: type) -> type:
    cls = import_class(name, where, ToolConfigError)
    if not issubclass(cls, base):
        raise ToolConfigError(f"{where}.class_name={name!r} does not subclass verl's BaseTool; derive it from "
                              "verl.tools.base_tool.BaseTool")
    return cls


def tool_environment(path: str, tokenizer, loop: ToolLoop, interaction_path: str = ""):
    """The episode factory `EnvRollout` takes: an awaitable making a fresh `ToolEnvironment`, the tools of `path` and
    the interactions of `interaction_path` (either may be "") loaded once, as verl's ToolAgentLoop loads them per
    worker, and shared, each call or episode using its own instance id."""
    if loop.format != "hermes":
        raise ToolConfigError(f"agent.tool_format={loop.format!r} is not supported; use hermes")
    tools = {t.name: t for t in load_tools(path)} if path else {}
    schemas = [dump_schema(t.tool_schema) for t in tools.values()]  # what `tool_schemas` reads
    chat = ToolChat(tokenizer, schemas) if tools else None
    interactions = Interactions(interaction_path, tokenizer) if interaction_path else None

    async def make() -> ToolEnvironment:
        return ToolEnvironment(tools, chat, loop, interactions)

    make.env_name, make.gives_rewards = "ToolAgentLoop", False
    return make
