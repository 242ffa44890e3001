"""Rule-reward server speaking OpenRLHF's remote reward protocol (LMM-R1's `math_verifier`):

    alignrl serve reward --protocol openrlhf --dataset FILE[,FILE] --input_key message --prompt-template chatml

`POST /get_reward` takes `{"query": [...], "prompts": [...], "labels": [...]}`: each query is a prompt and its
response as the policy's tokenizer decodes them (chat tokens kept), each prompt the prompt alone; `prompts` and
`labels` may be left out. It answers `{"rewards": [...]}`, each 0.5 × format (`<think>...</think><answer>...
</answer>`) + math-verified accuracy of the answer against the reference (`rewards.think_answer`).

The reference of a query is found by its prompt, as LMM-R1 finds it: the dataset's rows are indexed by their
prompt value as the file holds it (what LMM-R1's trainer sends) and by the text of their last user turn (what a
chat-templated prompt shows between `<|im_start|>user` and `<|im_end|>`, images left out). A prompt no row has, or
one whose user text several rows with different answers share, takes the request's label when it has one, and is
otherwise refused (HTTP 400, one line): scoring it against a guessed row would train on wrong rewards.
Deliberately left out: LMM-R1's nearest-prompt fallback (edit distance to every row), for the same reason.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignrl.rewards import think_answer
from alignrl.serve.common import RequestError, check_args, fail, new_app, start

PROG = "alignrl serve reward --protocol openrlhf"
# template name: (the last user turn's text, what starts the response); LMM-R1's three
TEMPLATES = {"chatml": (r"<\|im_start\|>user\n(.*?)<\|im_end\|>", "<|im_start|>assistant\n"),
             "qwen1": (r"｜User｜>(.*?)<｜Assistant｜>", "<｜Assistant｜>"),
             "base": (r"User: (.*?)\n\nAssistant:", "Assistant: ")}
END_TOKENS = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|endoftext|>")
_VISION_RE = re.compile(r"<\|vision_start\|>.*?<\|vision_end\|>|<\|(?:image|video)_pad\|>", re.DOTALL)
AMBIGUOUS = object()  # a user text several rows with different answers share


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenRLHF versions add fields; the three below are read

    query: list[str] = Field(min_length=1)
    prompts: list[str] | None = None
    labels: list[Any] | None = None


def user_text(messages: Any) -> str | None:
    """The text of the last user turn of chat `messages` (a list of {"role", "content"}, content a string or
    OpenAI-style items), images left out; None when `messages` is no chat."""
    if not isinstance(messages, list):
        return None
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return None
    content = users[-1].get("content")
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        texts = [str(c.get("text", "")) for c in content if isinstance(c, dict) and c.get("type") == "text"]
        return "".join(texts).strip()
    return None


def _as_chat(value: Any) -> Any:
    """A prompt value as the chat it holds: a JSON string of a message list (the chatml files' `message`) is
    parsed; a plain string is one user turn."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError:
                pass
        return [{"role": "user", "content": value}]
    return value


@dataclass
class PromptIndex:
    """Reference answers by prompt: `raw` by the prompt value as the file holds it, `by_user` by the last user
    turn's text (AMBIGUOUS where rows sharing it disagree)."""

    template: str = "chatml"
    raw: dict[str, str] = field(default_factory=dict)
    by_user: dict[str, object] = field(default_factory=dict)

    def add(self, prompt: Any, answer: str) -> None:
        if isinstance(prompt, str):
            self.raw[prompt] = answer
        key = user_text(_as_chat(prompt))
        if key is not None:
            seen = self.by_user.get(key)
            self.by_user[key] = answer if seen is None or seen == answer else AMBIGUOUS

    def user_turn(self, prompt: str) -> str:
        """The last user turn's text of a templated prompt (images out), else the prompt's chat's, else itself."""
        found = re.findall(TEMPLATES[self.template][0], prompt, re.DOTALL)
        if found:
            return _VISION_RE.sub("", found[-1]).strip()
        text = user_text(_as_chat(prompt))
        return text if text is not None else prompt.strip()

    def answer(self, prompt: str, label: Any, i: int) -> str:
        if prompt in self.raw:
            return self.raw[prompt]
        key = self.user_turn(prompt)
        found = self.by_user.get(key)
        if isinstance(found, str):
            return found
        if label is not None and str(label).strip():
            return str(label)
        shown = " ".join(key.split())[:80]
        if found is AMBIGUOUS:
            raise RequestError(f"prompt {i} (user turn {shown!r}) matches dataset rows with different answers and "
                               "came without a label: send the prompt as the dataset holds it, or a label")
        raise RequestError(f"prompt {i} (user turn {shown!r}) is in no row of the server's --dataset and came "
                           "without a label: start the server with the data the run trains on, or send labels")

    def response(self, query: str, prompt: str | None) -> str:
        """The response part of a query: after its prompt when it starts with it, else after the last response
        prefix of the template, else the whole query; end-of-turn tokens removed."""
        prefix = TEMPLATES[self.template][1]
        if prompt and query.startswith(prompt):
            text = query[len(prompt):]
        elif prefix in query:
            text = query[query.rindex(prefix) + len(prefix):]
        else:
            text = query
        for end in END_TOKENS:
            text = text.replace(end, "")
        return text.strip()

    def prompt_of(self, query: str) -> str:
        """A query's prompt when the request sent none (OpenRLHF before 0.6 sends queries only)."""
        prefix = TEMPLATES[self.template][1]
        return query[:query.rindex(prefix) + len(prefix)] if prefix in query else query


def read_rows(paths: str) -> list[dict]:
    """Rows of comma-separated JSON (a list of objects) or JSONL files; ValueError (one line) otherwise."""
    rows: list = []
    for name in [p.strip() for p in paths.split(",") if p.strip()]:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"--dataset file {name} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
            if name.endswith(".jsonl"):
                rows += [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                data = json.loads(text)
                rows += data if isinstance(data, list) else [data]
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"--dataset file {name} is not valid JSON/JSONL ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120]}); give a JSON list of rows or one JSON row a "
                             "line") from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"--dataset {paths} holds no rows, or rows that are not JSON objects")
    return rows


def build_index(rows: list[dict], input_key: str, label_key: str, template: str) -> PromptIndex:
    index = PromptIndex(template)
    for i, row in enumerate(rows):
        if input_key not in row or label_key not in row:
            missing = input_key if input_key not in row else label_key
            raise ValueError(f"--dataset row {i} has no {missing!r} (keys: {', '.join(sorted(row))[:120]}); "
                             "set --input_key / --label_key to its prompt and answer columns")
        index.add(row[input_key], str(row[label_key]).strip())
    return index


@dataclass
class RuleRewardService:
    index: PromptIndex
    format_weight: float = think_answer.FORMAT_WEIGHT

    def rewards(self, req: RewardRequest) -> list[float]:
        n = len(req.query)
        for name, values in (("prompts", req.prompts), ("labels", req.labels)):
            if values is not None and len(values) != n:
                raise RequestError(f"{len(values)} {name} for {n} queries; send one per query (or leave {name} out)")
        prompts = req.prompts or [self.index.prompt_of(q) for q in req.query]
        labels = req.labels or [None] * n
        answers = [self.index.answer(p, lab, i) for i, (p, lab) in enumerate(zip(prompts, labels))]
        return [think_answer.score(self.index.response(q, p), a, self.format_weight)
                for q, p, a in zip(req.query, prompts, answers)]


def build_app(svc: RuleRewardService, max_body: int):
    app = new_app("alignrl rule reward (OpenRLHF protocol)", "reward", max_body)

    @app.post("/get_reward")
    def get_reward(req: RewardRequest) -> dict:  # sync: FastAPI runs it in its thread pool, off the event loop
        return {"rewards": svc.rewards(req)}

    return app


def parser() -> argparse.ArgumentParser:
    from alignrl.runtime.one_line import OneLineParser
    from alignrl.wire.http_service import API_KEY_ENV

    p = OneLineParser(prog=PROG, description="rule reward (R1 format + math accuracy) over OpenRLHF's protocol")
    p.add_argument("--dataset", required=True, help="JSON or JSONL rows (comma-separated files) with prompt and answer")
    p.add_argument("--input_key", default="prompt", help="the rows' prompt column (LMM-R1's default: prompt)")
    p.add_argument("--label_key", default="answer", help="the rows' answer column")
    p.add_argument("--prompt-template", "--prompt_template", dest="prompt_template", default="chatml",
                   choices=sorted(TEMPLATES), help="chat format the prompts are rendered in")
    p.add_argument("--format_weight", type=float, default=think_answer.FORMAT_WEIGHT,
                   help="weight of the <think>/<answer> format term")
    p.add_argument("--host", default="127.0.0.1",
                   help=f"address to bind (default loopback only; any other host needs {API_KEY_ENV} set)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max_body_mb", type=float, default=64.0, help="largest JSON request body accepted")
    return p


def load_service(args: argparse.Namespace) -> RuleRewardService:
    index = build_index(read_rows(args.dataset), args.input_key, args.label_key, args.prompt_template)
    return RuleRewardService(index, args.format_weight)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.device, args.batch_window_ms = "auto", 0.0  # the model services' flags `check_args` reads
    problem = check_args(args)
    if problem:
        return fail(PROG, problem)
    return start("reward", args, load_service, build_app)
