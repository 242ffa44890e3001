"""Multi-turn rollouts against a user's environment (agent.env_path, OpenRLHF's --agent_func_path): a RolloutEngine
over any other RolloutEngine that plays each episode as OpenRLHF's MultiTurnAgentExecutor does.

Per episode: `reset` gets the prompt's text and label and may return another observation (then that text, tokenized,
is the prompt); each turn generates from the prompt and the response so far, `step` gets the turn's text and returns
its reward, a feedback text appended after the turn's ids, and whether the episode is done. The ids the engine
generated are kept exactly (token in, token out); feedback ids are attended but not trained on (their log-probs
are 0 and the loss mask leaves them out, under actor.state_masking). The episode's reward is the sum of its steps'
"rewards", its score the last step's "scores" (OpenRLHF's: dynamic filtering reads it; here a score >= 1 counts as
correct), and numeric "extra_logs" become per-row stats, logged as agent/<name>.

Turns run batched: every live episode's next turn is one `generate` call, then their `step`s run concurrently on
one event loop kept for the engine's life (environments may hold connections bound to it). An episode ends when
`step` says done, after agent.max_turns turns (0: no limit), or when its response reaches the cap (the turn is cut
there and the episode counts as truncated).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from alignrl.data.records import Rollout, Sample
from alignrl.errors import UserError
from alignrl.interfaces import RolloutEngine, SamplingParams, derived_seed
from alignrl.rollout.agent import _Row, episodes_rollout
from alignrl.rollout.environments import EnvFactory, Environment



class EnvironmentStepError(UserError):
    """The user's environment did something alignrl cannot use: one line naming the method and the fix."""


class TaskPrompt(list):
    """A prompt's token ids with its dataset row (its label: the ground truth), for engines that hand them to an
    environment."""

    def __init__(self, ids, sample: Sample):
        super().__init__(ids)
        self.sample = sample

    @property
    def label(self):
        return self.sample.ground_truth


def with_labels(engine: RolloutEngine, samples: Sequence[Sample], prompts: Sequence[Sequence[int]]):
    """`prompts` as the engine takes them: with each row's ground truth when it reads labels (`EnvRollout`)."""
    if not getattr(engine, "reads_labels", False):
        return prompts
    if any(getattr(p, "images", None) is not None for p in prompts):  # reset() gets text: the images would be lost
        raise EnvironmentStepError("agent.env_path with prompts that have images is not supported: the environment "
                                   "reads the prompt as text; train on text prompts, or drop agent.env_path")
    return [TaskPrompt(p, s) for s, p in zip(samples, prompts)]


@dataclasses.dataclass
class _Episode:
    row: _Row
    env: Environment
    label: Any
    text: str  # the observation so far, as the environment reads it: prompt, turns and feedback
    reward: float = 0.0
    score: float | None = None
    logs: dict[str, float] = dataclasses.field(default_factory=dict)


class EnvRollout:
    """RolloutEngine over an inner RolloutEngine and an environment factory (`environments.load_environment`)."""

    reads_labels = True  # RolloutMaker and evaluation pass TaskPrompts (`with_labels`)

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: EnvFactory, response_cap: int, max_turns: int = 0):
        """`make_env.gives_rewards` False (a tool environment): the steps' rewards are not the episode's, the run's
        reward function scores the response instead."""
        self.engine, self.tokenizer, self.make_env = engine, tokenizer, make_env
        self.cap, self.max_turns = int(response_cap), int(max_turns)
        self.env_name = getattr(make_env, "env_name", "AgentInstance")
        self.gives_rewards = getattr(make_env, "gives_rewards", True)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.loop = asyncio.new_event_loop()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def response_cap(self, params: SamplingParams) -> int:
        return self.cap

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        """`params.n` episodes per prompt, contiguous; the rewards and scores in `Rollout.stats`."""
        episodes = self.loop.run_until_complete(self._reset(prompts, params.n))
        turn = 0
        while True:
            live = [e for e in episodes if not e.row.done]
            if not live:
                break
            room = max(self.cap - len(e.row.ids) for e in live)
            turn_params = dataclasses.replace(params, n=1, max_new_tokens=min(params.max_new_tokens, room),
                                              seed=derived_seed(params.seed, turn))
            ro = self.engine.generate([e.row.prompt + e.row.ids for e in live], turn_params)
            turn += 1
            actions = [self._act(e, ro, j) for j, e in enumerate(live)]
            self.loop.run_until_complete(self._steps(live, actions, last=turn == self.max_turns))
        return self._rollout(episodes, len(prompts), params.n)

    async def _reset(self, prompts: Sequence[Sequence[int]], n: int) -> list[_Episode]:
        async def one(prompt: Sequence[int]) -> _Episode:
            text = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
            label = getattr(prompt, "label", None)
            env = await self._call(self.make_env(), "__init__")  # a constructor that raises is the user's too
            # OpenRLHF's two keys; the row itself for environments that read more of it (its messages, extra_info)
            got = await self._call(env.reset({"observation": text, "label": label,
                                              "sample": getattr(prompt, "sample", None)}), "reset")
            seen = got.get("observation", text) if isinstance(got, dict) else None
            if not isinstance(seen, str):
                raise EnvironmentStepError(f"{self.env_name}.reset returned {type(got).__name__} without a text "
                                           "'observation'; return {'observation': text} (the prompt, or the states "
                                           "given)")
            ids = list(prompt) if seen == text else self._encode(seen)  # unchanged: the prompt's own ids
            row = _Row(ids, source=prompt, stats={"turns": 0.0})
            return _Episode(row, env, label, seen)

        return list(await asyncio.gather(*(one(p) for p in prompts for _ in range(n))))

    def _act(self, e: _Episode, ro: Rollout, j: int) -> str:
        """Appends the turn's generated ids (cut at the cap) to the episode; returns their text."""
        keep = ro.response_mask[j]
        ids, lps = ro.response_ids[j][keep].tolist(), ro.logprobs[j][keep].tolist()
        room = self.cap - len(e.row.ids)
        e.row.append(ids[:room], lps[:room], generated=True)
        e.row.stats["turns"] += 1
        if len(ids) > room or (len(ids) == room and bool(ro.truncated[j])):
            e.row.truncated = True
        return self.tokenizer.decode(ids[:room], skip_special_tokens=True)

    async def _steps(self, live: list[_Episode], actions: list[str], last: bool) -> None:
        results = await asyncio.gather(*(self._call(e.env.step({"observation_text": e.text, "action_text": a,
                                                                 "label": e.label, "sampling_params": None}), "step")
                                         for e, a in zip(live, actions)))
        for e, action, got in zip(live, actions, results):
            self._take_step(e, action, got, last)

    def _take_step(self, e: _Episode, action: str, got: Any, last: bool) -> None:
        if not isinstance(got, dict) or (self.gives_rewards and "rewards" not in got):
            raise EnvironmentStepError(f"{self.env_name}.step returned {type(got).__name__} without 'rewards'; return "
                                       "{'rewards': r, 'scores': s, 'environment_feedback': text, 'done': bool}")
        if self.gives_rewards:
            e.reward += self._number(got["rewards"], "rewards")
            e.score = self._number(got["scores"], "scores") if got.get("scores") is not None else e.reward
        for name, value in (got.get("extra_logs") or {}).items():
            if isinstance(value, (numbers.Real, torch.Tensor)) and not isinstance(value, bool):
                e.logs[str(name)] = self._number(value, f"extra_logs[{name!r}]")
        feedback = got.get("environment_feedback") or ""
        if not isinstance(feedback, str):
            raise EnvironmentStepError(f"{self.env_name}.step returned a {type(feedback).__name__} "
                                    "'environment_feedback'; return the text to append (or '')")
        e.text += action + feedback
        if bool(got.get("done", False)) or last or e.row.truncated:
            e.row.done = True
            return
        ids = self._encode(feedback)
        room = self.cap - len(e.row.ids)
        if len(ids) >= room:  # no room left to act on the feedback: the episode ends here, cut
            e.row.done, e.row.truncated = True, True
            return
        e.row.append(ids, [0.0] * len(ids), generated=False)

    def _number(self, value: Any, what: str) -> float:
        got = value.float().sum().item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if not isinstance(got, numbers.Real) or isinstance(got, bool) or not math.isfinite(float(got)):
            raise EnvironmentStepError(f"{self.env_name}.step returned {what}={value!r}; return one finite number "
                                    "(a float or a one-element tensor)")
        return float(got)

    async def _call(self, awaitable, method: str) -> Any:
        try:
            return await awaitable
        except UserError:
            raise
        except Exception as exc:  # the user's code: one line, the run's files untouched
            raise EnvironmentStepError(f"{self.env_name}.{method} raised {type(exc).__name__}: {exc} (fix the "
                                    "environment file, agent.env_path)") from exc

    def _rollout(self, episodes: list[_Episode], n_prompts: int, n: int) -> Rollout:
        names = sorted({k for e in episodes for k in e.logs})
        for e in episodes:  # a log an episode did not write is NaN: averaged over the episodes that did
            if self.gives_rewards:
                e.row.stats.update(env_reward=e.reward, env_score=e.reward if e.score is None else e.score)
            e.row.stats.update({f"env/{k}": e.logs.get(k, math.nan) for k in names})
        return episodes_rollout([e.row for e in episodes], n_prompts, n, self.pad_id)
