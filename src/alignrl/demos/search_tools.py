"""The search demo in verl's tool agent loop (`alignrl demo search --tool-loop`): the same world, its questions as
verl's Search-R1-like rows, verl's SearchTool in a tool config, and the base model's SFT trajectories in the loop's
own text.

A row is verl's `searchR1_nq` example row: the question as the user turn, `extra_info.tools_kwargs` for the search
tool, exact match on the last `<answer>` as its reward. An episode: the prompt (the row's chat with the tool's schema,
`ToolChat.prompt`), a turn that calls `<tool_call>{"name": "search", "arguments": {"query_list": [question]}}`, the
tool turn (`ToolChat.feedback` of SearchTool's JSON response), then a turn that restates the passage's sentence and
answers; or a single turn that guesses. The SFT text is made by the loop's own code: the prompt by `encode_prompts`
with `tool_schemas` of the demo's tool config, the tool turn by `ToolEnvironment.step` running `SearchTool.execute`
(over the in-process BM25 instead of the server, which returns the same passages), so the base model is tuned on the
very ids RL rolls out (tests/test_search_demo_tools.py plays the loop to check).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from alignrl.data.records import Sample
from alignrl.demos.search_data import PROMPT_TEMPLATE, Fact, World
from alignrl.rollout.verl_builtin_tools import SearchTool

TOOL_DATA_SOURCE = "searchR1_nq"  # verl's Search-R1-like example: exact match, capped when answers are sprayed
TOOL_CLASS = "verl.tools.search_tool.SearchTool"
TOOL_CONFIG_FILE = "search_tool_config.yaml"
# Short on purpose: the template prints the schema into every prompt, and each of its tokens costs every step
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Search the corpus.",
    "parameters": {"type": "object", "required": ["query_list"],
                   "properties": {"query_list": {"type": "array", "description": "queries"}}}}}
# ChatML (`models.tokenizer.CHAT_TEMPLATE`) with the tools' schemas in a system turn, as Qwen2.5's template prints
# them; without tools it renders exactly as the search demo's template does
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLACEHOLDER_URL = "http://127.0.0.1:9/retrieve"  # the schemas are read without making the tool: never contacted


def tool_config(url: str, topk: int, timeout_s: float = 30.0) -> dict:
    """verl's tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) with SearchTool at `url`."""
    return {"tools": [{"class_name": TOOL_CLASS,
                       "config": {"type": "native", "retrieval_service_url": url, "topk": topk, "timeout": timeout_s},
                       "tool_schema": TOOL_SCHEMA}]}


def write_tool_config(path: Path, url: str, topk: int, timeout_s: float = 30.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tool_config(url, topk, timeout_s), sort_keys=False))
    return path


def demo_schemas(folder: Path) -> list[dict]:
    """The schemas the run's prompts carry, read by the loop's `tool_schemas` from the demo's tool config."""
    from alignrl.rollout.verl_tools import tool_schemas

    return tool_schemas(str(write_tool_config(folder / TOOL_CONFIG_FILE, PLACEHOLDER_URL, 1)))


def tool_samples(facts: Sequence[Fact], split: str) -> list[Sample]:
    """verl's Search-R1-like rows: the question as the user turn, its answer as `{"target": [...]}`, the search
    tool's `create_kwargs` in `extra_info.tools_kwargs` (verl's preprocessing writes them; SearchTool ignores them)."""
    rows = []
    for i, f in enumerate(facts):
        truth = {"target": [f.value]}
        kwargs = {"search": {"create_kwargs": {"ground_truth": truth, "question": f.question,
                                               "data_source": TOOL_DATA_SOURCE}}}
        rows.append(Sample(messages=[{"role": "user", "content": PROMPT_TEMPLATE.format(question=f.question)}],
                           ground_truth=truth, data_source=TOOL_DATA_SOURCE,
                           extra={"split": split, "index": i, "tools_kwargs": kwargs}))
    return rows


def write_tool_data(out_dir: Path, world: World) -> dict[str, Path]:
    """The RL and held-out rows of `world` in verl's parquet layout."""
    from alignrl.data.loaders import write_verl_parquet

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {split: out_dir / f"search_tools_{split}.parquet" for split in ("train", "test")}
    for split, path in paths.items():
        write_verl_parquet(tool_samples(world.facts[split], split), path)
    return paths


# ---- the base model's SFT trajectories -------------------------------------------------------------

def call_turn(fact: Fact) -> str:
    """A turn that searches with the question as the query, in hermes' call format."""
    call = json.dumps({"name": TOOL_SCHEMA["function"]["name"], "arguments": {"query_list": [fact.question]}})
    return f"<think> I do not know this. </think>\n<tool_call>{call}</tool_call>"


def answer_turn(fact: Fact) -> str:
    """After the tool turn: restate the passage's sentence (the copy pattern of `search_data.search_response`)."""
    return (f"<think> {fact.relation.sentence.format(e=fact.person, v=fact.value)}. </think>\n"
            f"<answer> {fact.value}</answer>")


def guess_turn(guess: str) -> str:
    return f"<think> I know this. </think>\n<answer> {guess}</answer>"


class _Contents:
    """`RetrieverClient.search_contents` from a table: each query's passages, as the server answers them."""

    def __init__(self, found: dict[str, list[str]]):
        self.found = found

    def search_contents(self, queries: list[str]) -> list[list[str]]:
        return [self.found[q] for q in queries]


class LocalSearchTool(SearchTool):
    """verl's SearchTool (its `execute`: the response text the loop appends) over passages found in this process, so
    that building the SFT text needs no server."""

    def __init__(self, found: dict[str, list[str]], schema):
        super(SearchTool, self).__init__({"type": "native"}, schema)  # BaseTool's: no retrieval service to ask
        self.client, self.slots, self._results = _Contents(found), threading.BoundedSemaphore(1), {}


def tool_turns(facts: Sequence[Fact], contents: Callable[[list[str]], list[list[str]]], tokenizer,
               schemas: list[dict]) -> dict[str, str]:
    """Each fact's question -> the text the tool loop appends after its call turn (`ToolEnvironment.step` with the
    loop's defaults: agent.max_tool_response_length, agent.tool_response_truncate_side)."""
    from alignrl.rollout.tool_calls import ToolChat
    from alignrl.rollout.verl_tool_api import OpenAIFunctionToolSchema
    from alignrl.rollout.verl_tools import ToolEnvironment, ToolLoop

    questions = list(dict.fromkeys(f.question for f in facts))
    found = dict(zip(questions, contents(questions) if questions else []))
    tool = LocalSearchTool(found, OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))
    chat = ToolChat(tokenizer, schemas)

    async def one(fact: Fact) -> str:
        env = ToolEnvironment({tool.name: tool}, chat, ToolLoop(max_assistant_turns=2))
        got = await env.step({"action_text": call_turn(fact), "truncated": False})
        return got["environment_feedback"]

    async def every() -> list[str]:
        return await asyncio.gather(*(one(f) for f in by_question.values()))

    by_question = {f.question: f for f in facts}
    return dict(zip(by_question, asyncio.run(every())))


def tool_sft_samples(world: World, feedback: dict[str, str], search_fraction: float, seed: int,
                     eos: str) -> list[Sample]:
    """One trajectory per `sft` fact as `extra["turns"]`: (text, trained) pieces in the order the loop appends them
    (generated turns end with `eos`, as the engine stops on it); a seeded `search_fraction` search, the rest guess."""
    rng = random.Random(seed)
    facts = world.facts["sft"]
    searching = [rng.random() < search_fraction for _ in facts]
    guesses = [rng.choice(world.values[f.relation.name]) for f in facts]
    out = []
    for f, s, g, row in zip(facts, searching, guesses, tool_samples(facts, "sft")):
        turns = ([(call_turn(f) + eos, True), (feedback[f.question], False), (answer_turn(f) + eos, True)] if s
                 else [(guess_turn(g) + eos, True)])
        out.append(Sample(row.messages, row.ground_truth, row.data_source, {**row.extra, "turns": turns}))
    return out


def tool_trajectory_ids(tokenizer, turns: Sequence[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """A trajectory's response ids as the loop holds them (each turn and each tool turn encoded on its own) and its
    loss mask (the tool turns out)."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in turns:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def tool_tokenizer_texts(world: World, samples: Sequence[Sample], schemas: list[dict]) -> list[str]:
    """What the tool variant's tokenizer is trained on: passages, prompts with the schemas, and every turn, cut at
    newlines and at the chat template's special tokens (added as special tokens, never merged)."""
    head = "# Tools\n<tools>\n" + "".join(json.dumps(s) + "\n" for s in schemas) + "</tools>"
    texts = [f.passage for f in world.all_facts()] + [head] * 50
    texts += [PROMPT_TEMPLATE.format(question=f.question) for f in world.facts["sft"][:50]]
    texts += [text for s in samples for text, _ in s.extra["turns"]]
    for special in ("<|im_start|>", "<|im_end|>"):
        texts = [t.replace(special, "\n") for t in texts]
    return [p for t in texts for p in t.split("\n") if p] + ["\n", "\n\n"] * 50
