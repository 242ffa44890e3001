"""verl's interactions (actor_rollout_ref.rollout.multi_turn.interaction_config_path, alignrl's
agent.interaction_config_path): a simulated user who answers the policy inside verl's tool agent loop
(`rollout.verl_tools.ToolEnvironment`).

The YAML lists `interaction: [{name, class_name, config}]` and is read as verl's registry reads it: an entry without
a name is named after its class, less an `Interaction` suffix, lower-cased; the entry's config with that name added
is the class's one argument (`cls(config=...)`). verl's gsm8k interaction is alignrl's own (`Gsm8kInteraction`,
scored by alignrl.rewards.gsm8k, flexible extraction); any other class_name is imported as a module path (the working
folder and PYTHONPATH). When verl is not installed, `verl.interactions.base` (BaseInteraction) is provided under its
name, so that an interaction file written for verl runs unchanged; an installed verl is used as it is.

An episode whose row has `extra_info.interaction_kwargs` starts the interaction its `name` picks, with those kwargs
(`start_interaction(instance_id, **kwargs)`). After each assistant turn without tool calls, `generate_response(
instance_id, messages, **kwargs)` reads the conversation so far (the row's messages, the assistant turns, the tool
responses and the earlier replies) and returns (should_terminate, reply, turn score, extra data). The reply is
appended as a user message, rendered as the chat template renders one (not trained on), and should_terminate ends
the episode after it. Each episode ends with `finalize_interaction(instance_id)`, however it ended. The turn scores
are logged (agent/interaction_score, the last; agent/interaction_score_mean); as in verl, the episode's reward is the
run's reward function on the whole response, which reads them in extra_info["turn_scores"] (`verl_tools`).

Left out: OmegaConf interpolations in the YAML (read as plain YAML), and multimodal replies.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import uuid
from pathlib import Path
from typing import Any

import yaml

from alignrl.errors import ConfigError, UserError
from alignrl.rewards import gsm8k
from alignrl.rollout.tool_calls import turn_context
from alignrl.rollout.verl_tool_api import import_class, installed_verl
from alignrl.utils.user_files import provide_modules

KEY = "agent.interaction_config_path"
GSM8K_CLASS = "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
EXAMPLE = "interaction: [{name: gsm8k, class_name: " + GSM8K_CLASS + ", config: {}}]"


class InteractionConfigError(ConfigError):
    """agent.interaction_config_path names a file or class alignrl cannot use; one line naming it and the fix."""


class InteractionError(UserError):
    """An interaction failed during an episode, or a row names none that the config has; one line saying which."""


class BaseInteraction:
    """verl's interaction base (verl.interactions.base): one object per configured interaction, an instance id per
    episode (start_interaction, generate_response each user turn, finalize_interaction)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        pass


class Gsm8kInteraction(BaseInteraction):
    """verl's gsm8k interaction: the last assistant message is the answer (`#### ` prefixed when it lacks one),
    scored against the row's ground_truth; a right answer ends the episode, a wrong one asks for another try."""

    RIGHT = "Your response is correct!"
    WRONG = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        content = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "") or ""
        content = content if isinstance(content, str) else str(content)
        self._instances[instance_id]["response"] = content if content.startswith("#### ") else "#### " + content
        score = await self.calculate_score(instance_id)
        right = score == 1.0
        return right, self.RIGHT if right else self.WRONG, score, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="flexible",
                                   format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILTIN: dict[str, type] = {GSM8K_CLASS: Gsm8kInteraction}


def interaction_api() -> type:
    """verl's BaseInteraction: an installed verl's, else this one, registered as verl.interactions.base."""
    installed = installed_verl(("verl.interactions.base",), InteractionConfigError, KEY, "interaction module")
    if installed:
        return installed[0].BaseInteraction
    provide_modules({"verl.interactions.base": {"BaseInteraction": BaseInteraction}},
                    "verl's interaction API, as alignrl provides it (verl is not installed)")
    return BaseInteraction


def default_name(class_name: str) -> str:
    """verl's name of an entry without one: the class's name less an `Interaction` suffix, lower-cased."""
    simple = class_name.rpartition(".")[2]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interactions(path: str) -> dict[str, Any]:
    """The interactions of verl's interaction config at `path` by name, each made as verl makes it
    (`cls(config={**config, "name": name})`). One line for a missing file, bad YAML, no list, an entry without
    class_name, a class that fails to import or lacks verl's async methods, a name given twice, a constructor that
    raises."""
    entries = _entries(path)
    interaction_api()  # verl.interactions.base importable before a user's module imports it
    made: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{KEY}={path}: interaction[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str) or not entry["class_name"]:
            raise InteractionConfigError(f"{where} has no class_name; give the interaction class's module path, "
                                         f"e.g. {GSM8K_CLASS}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}.config is a {type(config).__name__}; give a mapping (or {{}})")
        name = entry.get("name") or default_name(entry["class_name"])
        if not isinstance(name, str):
            raise InteractionConfigError(f"{where}.name={name!r} is not a text; name it as the rows' "
                                         "extra_info.interaction_kwargs.name does")
        if name in made:
            raise InteractionConfigError(f"{where}: interaction name {name!r} is given twice; give each its own name")
        cls = BUILTIN.get(entry["class_name"]) or _interaction_class(entry["class_name"], where)
        try:
            made[name] = cls(config={**config, "name": name})
        except Exception as exc:
            raise InteractionConfigError(f"{where}: {entry['class_name']}(config=...) raised {type(exc).__name__}: "
                                         f"{exc}".splitlines()[0] + "; fix the interaction or its entry") from exc
    return made


def _entries(path: str) -> list:
    file = Path(path)
    if not file.is_file():
        raise InteractionConfigError(f"{KEY}={path}: no such file (from {Path.cwd()}); give verl's interaction "
                                     f"config YAML ({EXAMPLE})")
    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise InteractionConfigError(f"{KEY}={path} is not valid YAML ({' '.join(str(exc).split())}); fix the file"
                                     ) from exc
    entries = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InteractionConfigError(f"{KEY}={path} has no 'interaction' list; write {EXAMPLE}")
    return entries


def _interaction_class(name: str, where: str) -> type:
    """A user's interaction class: verl awaits its start_interaction and generate_response, so both must be async."""
    cls = import_class(name, where, InteractionConfigError)
    for method in ("start_interaction", "generate_response"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise InteractionConfigError(f"{where}.class_name={name!r} has no async {method}(); derive it from "
                                         "verl.interactions.base.BaseInteraction and define it with async def")
    return cls


class UserChat:
    """The text a user message adds after an assistant turn: the message and the next generation prompt, as the
    chat template renders them after the conversation so far (`tool_calls.turn_context`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        context = turn_context(self._render, "user")
        if context is None:
            raise InteractionConfigError("the tokenizer's chat template renders a conversation's earlier turns "
                                         "differently once a user message follows them, so an interaction's reply "
                                         "cannot be appended as text; use a model whose template appends turns")
        self.base, self.prefix = context

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def feedback(self, text: str) -> str:
        return self._render(self.base + [{"role": "user", "content": text}], True)[len(self.prefix):]


@dataclasses.dataclass
class Talk:
    """One episode's conversation with its interaction: the messages verl hands generate_response, the turn scores."""

    interaction: Any
    kwargs: dict[str, Any]
    messages: list[dict[str, Any]]
    chat: UserChat
    instance_id: str
    scores: list[float] = dataclasses.field(default_factory=list)
    replies: int = 0

    def assistant(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def tools(self, texts: list[str]) -> None:
        self.messages.extend({"role": "tool", "content": text} for text in texts)

    async def reply(self) -> tuple[str, bool]:
        """The interaction's reply as the text to append, and whether it ends the episode."""
        got = await self.call("generate_response", self.instance_id, self.messages, **self.kwargs)
        what = f"{self._name()}.generate_response returned"
        if not isinstance(got, (tuple, list)) or len(got) != 4:
            raise InteractionError(f"{what} {type(got).__name__} {got!r:.80}; return (should_terminate, reply text, "
                                   "turn score, extra dict)")
        done, text, score, _ = got
        if not isinstance(text, str):
            raise InteractionError(f"{what} a {type(text).__name__} reply; return the reply as text")
        if score is not None:
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(float(score)):
                raise InteractionError(f"{what} the turn score {score!r}; return one finite number (or None)")
            self.scores.append(float(score))
        self.replies += 1
        self.messages.append({"role": "user", "content": text})
        return self.chat.feedback(text), bool(done)

    async def finish(self) -> None:
        """finalize_interaction(instance_id); without the id where it takes none (older verl's base signature)."""
        method = getattr(self.interaction, "finalize_interaction", None)
        if method is None:
            return
        try:
            inspect.signature(method).bind(self.instance_id)
            args: tuple = (self.instance_id,)
        except (TypeError, ValueError):
            args = ()
        await self.call("finalize_interaction", *args)

    def logs(self) -> dict[str, float]:
        """interaction_turns, and the turn scores' last and mean where there are any (NaN-free: an episode without
        scores writes none, and the run averages over the episodes that did)."""
        logs = {"interaction_turns": float(self.replies)}
        if self.scores:
            logs.update(interaction_score=self.scores[-1], interaction_score_mean=sum(self.scores) / len(self.scores))
        return logs

    def _name(self) -> str:
        return type(self.interaction).__name__

    async def call(self, method: str, *args, **kwargs) -> Any:
        """The interaction's `method` awaited; an exception in it is one line naming the class and the method."""
        try:
            return await getattr(self.interaction, method)(*args, **kwargs)
        except UserError:
            raise
        except Exception as exc:  # the user's code: one line, the run's files untouched
            raise InteractionError(f"{self._name()}.{method} raised {type(exc).__name__}: {exc}".splitlines()[0] +
                                   f" (fix the interaction, {KEY})") from exc


class Interactions:
    """A run's interactions by name, loaded once (as verl's ToolAgentLoop loads them per worker) and shared by the
    episodes, each with its own instance id."""

    def __init__(self, path: str, tokenizer):
        self.path, self.by_name, self.chat = path, load_interactions(path), UserChat(tokenizer)

    async def start(self, sample: Any) -> Talk | None:
        """The episode's conversation with the interaction its row names; None for a row without
        interaction_kwargs, whose episode runs the tool loop alone."""
        kwargs = (getattr(sample, "extra", None) or {}).get("interaction_kwargs")
        if kwargs is None:
            return None
        row = f"row {sample.source}" if getattr(sample, "source", None) else "a row"
        if not isinstance(kwargs, dict) or not isinstance(kwargs.get("name"), str):
            raise InteractionError(f"{row}: extra_info.interaction_kwargs has no 'name'; name the interaction of "
                                   f"{KEY}={self.path} that plays it ({', '.join(self.by_name)})")
        interaction = self.by_name.get(kwargs["name"])
        if interaction is None:
            raise InteractionError(f"{row}: extra_info.interaction_kwargs.name={kwargs['name']!r} is not in "
                                   f"{KEY}={self.path} (it has {', '.join(self.by_name)}); fix the data or the config")
        talk = Talk(interaction, dict(kwargs), [dict(m) for m in sample.messages], self.chat, uuid.uuid4().hex)
        await talk.call("start_interaction", talk.instance_id, **talk.kwargs)
        return talk
