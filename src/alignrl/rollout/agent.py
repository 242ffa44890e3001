"""Multi-turn tool use (Search-R1): a RolloutEngine that runs any other RolloutEngine turn by turn and
lets the policy call a search tool between turns.

Each turn makes one batched `generate` call over the rows still running; a turn stops at `</search>`,
`</answer>`, eos or rollout.max_new_tokens. The turn's action is parsed as Search-R1 does (the first
`<(search|answer)>...</\\1>` of the turn's text, cut after the first `</search>`, else `</answer>`):

- answer: the row is done;
- search: the query goes to the tool with every other query of the turn (one call), and the passages
  come back as `\\n\\n<information>...</information>\\n\\n`, cut to `max_obs_length` tokens;
- no action (whether the turn ended at eos, a stop string or the length limit): Search-R1's corrective
  observation, and the row tries again next turn; an eos only ends the episode on the last turn.

After `max_turns` tool turns a last turn runs without search. The ids each turn generated are kept
exactly, and the observation ids are appended after them: the trainer sees the ids the engine
produced, never a re-tokenised text. The returned Rollout's `loss_mask` is True on generated tokens
only; its `response_mask` covers observations too, since later turns attend to them. Its log-probs
are the engine's on generated tokens and 0 on observations (no policy sampled them).

The response is bounded by `max_new_tokens` per turn and by `max_response_length` overall (generated
and observation tokens, as Search-R1 cuts its right side; default: the most the turns can produce,
`episode_cap`, so only the per-turn limit cuts).
Deliberately left out: tools other than search, parallel tool calls within a turn, chat-templated
tool messages (observations are plain text in the assistant's turn, as in Search-R1).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from alignrl.config.checks import episode_cap
from alignrl.data.collate import left_pad, right_pad
from alignrl.data.images import ImagePrompt, ImageRows, PromptImages, join_images
from alignrl.data.records import Rollout
from alignrl.interfaces import RolloutEngine, SamplingParams, derived_seed
from alignrl.utils.tracking import console

ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
ACTION_STOPS = ("</search>", "</answer>")
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> "
                  "and </search>. If I want to give the final answer, I should put the answer between <answer> "
                  "and </answer>. Let me try again.\n")
INFO_OPEN, INFO_CLOSE = "\n\n<information>", "</information>\n\n"
STAT_NAMES = ("searches", "valid_actions", "actions", "turns", "obs_truncated")


class SearchTool(Protocol):
    """One observation text per query, in one call (`rollout.retriever.RetrieverClient`)."""

    def search(self, queries: list[str]) -> list[str]: ...


def parse_action(text: str) -> tuple[str | None, str]:
    """(action, content) of one turn's text as Search-R1 reads it; (None, "") when there is none."""
    for end in ACTION_STOPS:  # Search-R1 cuts after the first </search>, else after the first </answer>
        if end in text:
            text = text.split(end, 1)[0] + end
            break
    m = ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


@dataclass
class _Row:
    """One sequence while it is being rolled out."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # the response so far: generated and observation ids
    source: Sequence[int] = ()  # the prompt as given: an ImagePrompt carries its images into every turn
    logprobs: list[float] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_NAMES, 0))
    observed: list[PromptImages] = field(default_factory=list)  # the images of observations in `ids`, in order
    observed_pictures: list = field(default_factory=list)  # the same images as Pillow images (for vLLM)

    def append(self, ids: list[int], logprobs: list[float], generated: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.generated += [generated] * len(ids)

    def add_images(self, images: PromptImages, pictures: Sequence) -> None:
        """The images of the observation just appended, whose image tokens are now at the end of `ids`."""
        self.observed.append(images)
        self.observed_pictures += list(pictures)

    def images(self) -> PromptImages | None:
        """All the row's images in the order of their image tokens: the prompt's, then its observations'."""
        return join_images([getattr(self.source, "images", None), *self.observed])

    def context(self) -> list[int]:
        """What the next turn is generated from: the prompt and the response so far, with the row's images."""
        ids = self.prompt + self.ids
        images = self.images()
        if images is None:
            return ids
        own = getattr(self.source, "pictures", ())
        # an engine that reads the Pillow images (vLLM) needs all of them or none: a prompt whose images came without
        # their pictures (decoded elsewhere) gives none, rather than only the observations', misplaced
        whole = bool(own) or getattr(self.source, "images", None) is None
        return ImagePrompt(ids, images, (*own, *self.observed_pictures) if whole else ())


def _start(prompt: Sequence[int], keep: int) -> _Row:
    """A row of `prompt` keeping its last `keep` tokens (0: all). A prompt with images is kept whole: its image
    tokens must stay, and data loading already bounded it (data.max_prompt_length never cuts image tokens)."""
    ids = list(prompt)
    if keep > 0 and getattr(prompt, "images", None) is None:
        ids = ids[-keep:]
    return _Row(ids, source=prompt)


class AgentRollout:
    """RolloutEngine over an inner RolloutEngine (embedded, HTTP server, vLLM) and a search tool."""

    def __init__(self, engine: RolloutEngine, tokenizer, tool: SearchTool | None, max_turns: int,
                 max_obs_length: int, max_start_length: int = 0, max_response_length: int | None = None):
        """`tool` None: a search gets an empty observation (Search-R1 without do_search).
        `max_start_length` > 0 keeps that many prompt tokens (from the right). `max_response_length`
        None (or 0): the most the turns can produce, so only the per-turn limit (params.max_new_tokens) cuts;
        a larger value than that changes nothing."""
        self.engine, self.tokenizer, self.tool = engine, tokenizer, tool
        self.max_turns, self.max_obs_length = int(max_turns), int(max_obs_length)
        self.max_start_length, self.max_response_length = int(max_start_length), max_response_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._warned = False

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))  # passages may be long

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def response_cap(self, params: SamplingParams) -> int:
        return episode_cap(self.max_turns, params.max_new_tokens, self.max_obs_length, self.max_response_length or 0)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        """`params.n` multi-turn samples per prompt, contiguous; per-row stats in `Rollout.stats`."""
        rows = [_start(p, self.max_start_length) for p in prompts for _ in range(params.n)]
        cap = self.response_cap(params)
        stops = tuple(dict.fromkeys((*params.stop, *ACTION_STOPS)))
        for turn in range(self.max_turns + 1):
            active = [r for r in rows if not r.done]
            if not active:
                break
            room = max(cap - len(r.ids) for r in active)
            turn_params = dataclasses.replace(params, n=1, max_new_tokens=min(params.max_new_tokens, room),
                                              stop=stops, seed=derived_seed(params.seed, turn))
            ro = self.engine.generate([r.context() for r in active], turn_params)
            queries = self._take_turn(active, ro, cap, last=turn == self.max_turns)
            self._observe(queries, cap)
        return self._rollout(rows, len(prompts), params.n)

    def _take_turn(self, active: list[_Row], ro: Rollout, cap: int, last: bool) -> list[tuple[_Row, str | None]]:
        """Appends each row's generated ids and decides what follows. Returns (row, observation source)
        pairs: a search query (str) or None for the corrective observation."""
        follow: list[tuple[_Row, str | None]] = []
        for j, row in enumerate(active):
            keep = ro.response_mask[j]
            ids, lps = ro.response_ids[j][keep].tolist(), ro.logprobs[j][keep].tolist()
            room = cap - len(row.ids)
            cut = len(ids) > room
            row.append(ids[:room], lps[:room], generated=True)
            row.stats["turns"] += 1
            row.stats["actions"] += 1
            text = self.tokenizer.decode(ids[:room], skip_special_tokens=True)
            action, content = parse_action(text)
            row.stats["valid_actions"] += action is not None
            if cut:
                row.done, row.truncated = True, True
            elif action == "answer" or last:
                row.done, row.truncated = True, bool(ro.truncated[j])
            elif len(row.ids) >= cap:
                row.done, row.truncated = True, True
            else:
                follow.append((row, content if action == "search" else None))
        return follow

    def _observe(self, follow: list[tuple[_Row, str | None]], cap: int) -> None:
        """Runs the turn's searches in one tool call and appends every observation."""
        searching = [(row, q) for row, q in follow if q is not None]
        found: list[str] = []
        if searching and self.tool is not None:
            found = self.tool.search([q for _, q in searching])
            if len(found) != len(searching):
                raise ValueError(f"search tool returned {len(found)} observations for {len(searching)} queries")
            for row, _ in searching:
                row.stats["searches"] += 1
        results = iter(found)
        for row, query in follow:
            if query is None:
                obs = self._encode(INVALID_ACTION)[: self.max_obs_length]
            else:
                obs = self.information_ids(next(results, "").strip(), row)
            if len(row.ids) + len(obs) >= cap:  # no room left to act on it: the row ends here
                row.done, row.truncated = True, True
                continue
            row.append(obs, [0.0] * len(obs), generated=False)

    def information_ids(self, passages: str, row: _Row) -> list[int]:
        """`<information>passages</information>` as ids, at most max_obs_length of them; a longer one keeps
        its opening and closing tags and loses the end of the passages."""
        ids = self._encode(f"{INFO_OPEN}{passages}{INFO_CLOSE}")
        if len(ids) <= self.max_obs_length:
            return ids
        row.stats["obs_truncated"] += 1
        if not self._warned:
            self._warned = True
            console.print(f"[yellow]a search observation of {len(ids)} tokens was cut to data.max_obs_length="
                          f"{self.max_obs_length}; raise it (or lower retriever.topk) to keep whole passages[/yellow]",
                          soft_wrap=True)
        head, tail = self._encode(INFO_OPEN), self._encode(INFO_CLOSE)
        body = self._encode(passages)[: max(0, self.max_obs_length - len(head) - len(tail))]
        return (head + body + tail)[: self.max_obs_length]

    def _rollout(self, rows: list[_Row], n_prompts: int, n: int) -> Rollout:
        return episodes_rollout(rows, n_prompts, n, self.pad_id)


def episodes_rollout(rows: list[_Row], n_prompts: int, n: int, pad_id: int) -> Rollout:
    """The Rollout of finished episodes (`n` contiguous rows per prompt): ids padded, the loss mask on generated
    tokens, the engine's log-probs there and 0 on observations, and each row's stats (the first row's keys)."""
    prompt_ids, prompt_mask = left_pad([r.prompt for r in rows], pad_id)
    response_ids, response_mask = right_pad([r.ids for r in rows], pad_id)
    loss_mask = torch.zeros_like(response_mask)
    logprobs = torch.zeros(response_ids.shape)
    for i, r in enumerate(rows):
        loss_mask[i, : len(r.ids)] = torch.tensor(r.generated, dtype=torch.bool)
        logprobs[i, : len(r.ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
    stats = {k: torch.tensor([float(r.stats[k]) for r in rows]) for k in (rows[0].stats if rows else ())}
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                   response_mask=response_mask, logprobs=logprobs,
                   truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
                   group=torch.arange(n_prompts).repeat_interleave(n), loss_mask=loss_mask, stats=stats,
                   images=_row_images(rows))  # the trainer's forwards read them too


def _row_images(rows: list[_Row]) -> ImageRows | None:
    """Each row's images (its prompt's and its observations'), or None when no row has any."""
    images = [r.images() for r in rows]
    return ImageRows(images) if any(i is not None for i in images) else None
