"""The text side of verl's tool agent loop (`rollout.verl_tools`): the hermes tool-call parser, the truncation of a
tool's response, and the chat-template text of a prompt with tool schemas and of a turn's tool responses.

Each follows verl's `ToolAgentLoop` and `HermesToolParser` (verl/experimental/agent_loop): a call is a JSON object
`{"name": ..., "arguments": ...}` between `<tool_call>` and `</tool_call>`; a block that is not such an object is
skipped (and counted); a response longer than max_tool_response_length characters is cut with verl's markers; the
tool messages are rendered with the generation prompt, less what the template prints for an empty conversation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from alignrl.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TRUNCATE_SIDES = ("left", "middle", "right")


class ToolTemplateError(ConfigError):
    """The tokenizer's chat template cannot render what the tool loop needs; one line naming the fix."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments as a JSON text (verl's FunctionCall)."""

    name: str
    arguments: str


def parse_hermes(text: str) -> tuple[list[ToolCall], int]:
    """The calls in `text`, in order, and how many `<tool_call>` blocks were not a JSON object with a name and
    arguments (verl logs and skips those). Text without both tags has no calls, as in verl."""
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return [], 0
    calls, bad = [], 0
    for block in TOOL_CALL.findall(text):
        try:
            got = json.loads(block)
            name, arguments = got["name"], got["arguments"]
        except (ValueError, TypeError, KeyError):
            bad += 1
            continue
        if not isinstance(name, str):
            bad += 1
            continue
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls, bad


def truncate_response(text: str, limit: int, side: str) -> str:
    """`text` cut to about `limit` characters as verl cuts a tool's response: "left" keeps the start, "right" the
    end, "middle" both halves, each with verl's "(truncated)" marker where text was dropped."""
    if not text or len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def turn_context(render: Callable[[list[dict], bool], str], role: str) -> tuple[list[dict], str] | None:
    """What messages of `role` appended after an assistant turn are rendered after, and the text that renders to, cut
    from each appended turn's render; None when the template renders the earlier turns differently once such messages
    follow them (their text cannot be appended).

    verl renders the appended messages alone and drops what the template prints for an empty conversation (a default
    system block, for Qwen's); that is done here whenever that text is the render's start. Templates whose empty
    conversation is not (one that prints an empty turn for it) get the messages after a short user and assistant
    exchange instead, less that exchange's text: the same turn, without text of another turn."""
    probe = [{"role": role, "content": "x"}]
    try:
        empty = render([{}], False)
    except Exception:  # a template that reads every message's role: no empty-conversation text
        empty = None
    if empty is not None and render(probe, True).startswith(empty):
        return [], empty
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    prefix = render(base, False)
    return (base, prefix) if render(base + probe, True).startswith(prefix) else None


class ToolChat:
    """A tokenizer's chat template as the tool loop uses it: the prompt with the tools' schemas, and the text that
    follows an assistant turn with the turn's tool responses and the next generation prompt."""

    def __init__(self, tokenizer, schemas: Sequence[dict[str, Any]]):
        self.tokenizer, self.schemas = tokenizer, list(schemas)
        self.base, self.prefix = self._context()
        probe = [{"role": "user", "content": "x"}]  # a template that prints no tools renders both alike
        self.prints_schemas = bool(self.schemas) and self.prompt(probe) != self._render(probe, True)

    def _render(self, messages: list[dict], generation: bool, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False,
                                                  **kwargs)

    def _context(self) -> tuple[list[dict], str]:
        """The messages rendered before the tool messages and the text they render to (`turn_context`)."""
        try:
            self._render([{"role": "tool", "content": "x"}], True)
        except Exception as exc:  # the template's own check (roles must alternate, no tool role)
            raise ToolTemplateError(f"the tokenizer's chat template cannot render a tool message ({type(exc).__name__}"
                                    f": {exc}); use a model whose template has a tool role (Qwen2.5, Llama 3.1)"
                                    ) from exc
        context = turn_context(self._render, "tool")
        if context is None:
            raise ToolTemplateError("the tokenizer's chat template renders a conversation's earlier turns differently "
                                    "once tool messages follow them, so a tool response cannot be appended as text; "
                                    "use a model whose template appends turns (Qwen2.5, Llama 3.1)")
        return context

    def prompt(self, messages: list[dict]) -> str:
        """The row's messages with the tools' schemas and the generation prompt (verl's first prompt)."""
        return self._render(messages, True, tools=self.schemas or None)

    def lacks_schemas(self, text: str, messages: list[dict]) -> bool:
        """Whether `text` is `messages`' prompt templated without the schemas, where the template prints them."""
        return self.prints_schemas and text == self._render(messages, True)

    def feedback(self, responses: Sequence[str], images: Sequence[int] = ()) -> str:
        """The text after an assistant turn: its tool responses as tool messages, then the generation prompt.
        `images[i]` > 0: response i came with that many images, and its message's content is verl's multimodal
        list, an image item per image and then its text (if any), which the template renders as image placeholders."""
        messages = [{"role": "tool", "content": text} if not (images and images[i]) else
                    {"role": "tool", "content": [*({"type": "image"} for _ in range(images[i])),
                                                 *([{"type": "text", "text": text}] if text else [])]}
                    for i, text in enumerate(responses)]
        return self._render(self.base + messages, True)[len(self.prefix):]
