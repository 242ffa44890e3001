"""Multi-turn rollouts against a user's environment (agent.env_path, OpenRLHF's --agent_func_path): a RolloutEngine
over any other RolloutEngine that plays each episode as OpenRLHF's MultiTurnAgentExecutor does.

Per episode: `reset` gets the prompt's text and label and may return another observation (then that text, tokenized,
is the prompt); each turn generates from the prompt and the response so far, `step` gets the turn's text and returns
its reward, a feedback text appended after the turn's ids, and whether the episode is done. The ids the engine
generated are kept exactly (token in, token out); feedback ids are attended but not trained on (their log-probs
are 0 and the loss mask leaves them out, under actor.state_masking). The episode's reward is the sum of its steps'
"rewards", its score the last step's "scores" (OpenRLHF's: dynamic filtering reads it; here a score >= 1 counts as
correct), and numeric "extra_logs" become per-row stats, logged as agent/<name>. An environment of alignrl's own may
say, once its episode ended, what the reward function reads of it in extra_info (verl's tool loop: `episode_ended`).

Turns run batched: every live episode's next turn is one `generate` call (one per set of sampling params, when
steps changed an episode's: `env_sampling`), then their `step`s run concurrently on one event loop kept for the
engine's life (environments may hold connections bound to it). `step` gets OpenRLHF's states plus "truncated": True
when the turn reached the response cap (nothing can follow it; verl's tool loop then runs no calls). An episode ends
when `step` says done (its feedback is still appended, as OpenRLHF does, as far as the cap allows), after
agent.max_turns turns (0: no limit), or when its response reaches the cap (the turn is cut there and the episode
counts as truncated). A step may also return "environment_images" (alignrl's key, which verl's tool loop fills with
its tools' images): Pillow images, one per image placeholder of the feedback's text, which a vision-language policy's
processor widens to the images' tokens; the images follow the row's earlier ones (`_Row.images`) for its next turns
and the trainer's forwards. Such feedback is appended whole or not at all, never cut inside its image tokens: one
that does not fit in the room left ends the episode as truncated, as verl ends it (a done step's such feedback is
left out). With `prompt_room` (OpenRLHF's budget of prompt_max_len + generate_max_len), a prompt shorter than that
lends its unused tokens to its episode's response cap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from alignrl.data.images import PromptImages
from alignrl.data.records import Rollout, Sample
from alignrl.errors import UserError
from alignrl.interfaces import RolloutEngine, SamplingParams, derived_seed
from alignrl.rollout.agent import _Row, episodes_rollout
from alignrl.rollout.env_sampling import StepSampling, applied, changes, for_step
from alignrl.rollout.environments import EnvFactory, Environment, EnvironmentStepError
from alignrl.rollout.observation_images import check_placeholders, given_media, observation_ids, pictures_of

__all__ = ["EnvRollout", "EnvironmentStepError", "TaskPrompt", "with_labels"]


class TaskPrompt(list):
    """A prompt's token ids with its dataset row (its label: the ground truth), for engines that hand them to an
    environment, and the images of a prompt that has some (as an ImagePrompt carries them: every turn is generated
    with them, and the trainer's forwards read them)."""

    def __init__(self, ids, sample: Sample):
        super().__init__(ids)
        self.sample = sample
        self.images, self.pictures = getattr(ids, "images", None), getattr(ids, "pictures", ())

    @property
    def label(self):
        return self.sample.ground_truth


def with_labels(engine: RolloutEngine, samples: Sequence[Sample], prompts: Sequence[Sequence[int]]):
    """`prompts` as the engine takes them: with each row's ground truth when it reads labels (`EnvRollout`)."""
    if not getattr(engine, "reads_labels", False):
        return prompts
    return [TaskPrompt(p, s) for s, p in zip(samples, prompts)]


@dataclasses.dataclass
class _Episode:
    row: _Row
    env: Environment
    label: Any
    text: str  # the observation so far, as the environment reads it: prompt, turns and feedback
    cap: int  # its response's cap: the run's, plus what its prompt leaves of the prompt room when that is lent
    reward: float = 0.0
    score: float | None = None
    logs: dict[str, float] = dataclasses.field(default_factory=dict)
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # what its steps changed (alignrl's names)
    params: SamplingParams | None = None  # its last turn's sampling params, and the most tokens that turn could take
    turn_max: int = 0
    action: str = ""  # its last turn's text
    extras: dict[str, Any] | None = None  # what its environment adds to the reward function's extra_info


class EnvRollout:
    """RolloutEngine over an inner RolloutEngine and an environment factory (`environments.load_environment`)."""

    reads_labels = True  # RolloutMaker and evaluation pass TaskPrompts (`with_labels`)

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: EnvFactory, response_cap: int, max_turns: int = 0,
                 prompt_room: int = 0):
        """`make_env.gives_rewards` False (a tool environment): the steps' rewards are not the episode's, the run's
        reward function scores the response instead. `prompt_room` > 0 (the prompt cap, data.max_prompt_length):
        episodes are budgeted as OpenRLHF's executor budgets them, prompt_max_len + generate_max_len in all: a
        response may also use what its prompt leaves of the prompt room, and each turn may take all the room left (a
        step's max_tokens still caps it). 0: every response has `response_cap`, each turn params.max_new_tokens."""
        self.engine, self.tokenizer, self.make_env = engine, tokenizer, make_env
        self.cap, self.max_turns, self.prompt_room = int(response_cap), int(max_turns), int(prompt_room)
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
            for group_params, group in self._groups(live, params).items():
                self._turn(group, group_params, turn)
            turn += 1
            self.loop.run_until_complete(self._steps(live, last=turn == self.max_turns))
        self.loop.run_until_complete(self._ended(episodes))
        return self._rollout(episodes, len(prompts), params.n)

    async def _ended(self, episodes: list[_Episode]) -> None:
        """Environments that hold something per episode (verl's tool loop: its interaction's instance) release it
        once the episode ended, whether its step said done or a limit ended it, and return what the reward function
        reads of the episode beyond its row (verl's: its turn count, turn scores and tool rewards), or None."""
        ending = [e for e in episodes if hasattr(e.env, "episode_ended")]
        for e, extras in zip(ending, await asyncio.gather(*(e.env.episode_ended() for e in ending))):
            e.extras = extras if isinstance(extras, dict) else None  # a hook that returns nothing adds nothing

    def _groups(self, live: list[_Episode], params: SamplingParams) -> dict[SamplingParams, list[_Episode]]:
        """The live episodes by the sampling params of their next turn: all in one group (one generate call, as
        without environment changes) unless steps changed some episodes' params."""
        most = self.cap + self.prompt_room
        if self.prompt_room:  # OpenRLHF's turns are bounded by the budget left alone: each may take all its room
            params = dataclasses.replace(params, max_new_tokens=most)
        groups: dict[SamplingParams, list[_Episode]] = {}
        for e in live:
            groups.setdefault(applied(params, e.sampling, most), []).append(e)
        return groups

    def _turn(self, group: list[_Episode], params: SamplingParams, turn: int) -> None:
        """One batched generate call for `group`, at most the room its roomiest episode has left; each episode's
        turn appended (`_act`)."""
        room = max(e.cap - len(e.row.ids) for e in group)
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=min(params.max_new_tokens, room),
                                          seed=derived_seed(params.seed, turn))
        ro = self.engine.generate([e.row.context() for e in group], turn_params)  # with the prompt's images
        for j, e in enumerate(group):
            e.params, e.turn_max = params, min(params.max_new_tokens, e.cap - len(e.row.ids))
            e.action = self._act(e, ro, j)

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
            if seen != text and getattr(prompt, "images", None) is not None:  # its image tokens stand for pixels
                raise EnvironmentStepError(f"{self.env_name}.reset rewrote the observation of a prompt with images; "
                                           "return it unchanged ({'observation': states['observation']}) for such "
                                           "prompts, or train on text prompts")
            ids = list(prompt) if seen == text else self._encode(seen)  # unchanged: the prompt's own ids
            row = _Row(ids, source=prompt, stats={"turns": 0.0})
            # OpenRLHF's budget counts the observation reset returned; one over the prompt room leaves the response
            # its own cap (OpenRLHF cuts such an observation to leave generate_max_len)
            lent = max(0, self.prompt_room - len(ids)) if self.prompt_room else 0
            return _Episode(row, env, label, seen, self.cap + lent)

        return list(await asyncio.gather(*(one(p) for p in prompts for _ in range(n))))

    def _act(self, e: _Episode, ro: Rollout, j: int) -> str:
        """Appends the turn's generated ids (cut at the cap) to the episode; returns their text."""
        keep = ro.response_mask[j]
        ids, lps = ro.response_ids[j][keep].tolist(), ro.logprobs[j][keep].tolist()
        room = e.cap - len(e.row.ids)
        e.row.append(ids[:room], lps[:room], generated=True)
        e.row.stats["turns"] += 1
        if len(ids) > room or (len(ids) == room and bool(ro.truncated[j])):
            e.row.truncated = True
        return self.tokenizer.decode(ids[:room], skip_special_tokens=True)

    async def _steps(self, live: list[_Episode], last: bool) -> None:
        given = [for_step(e.params, e.turn_max, self.env_name) for e in live]
        # "truncated": the turn reached the cap, so nothing the step answers can follow it (an extra key: OpenRLHF's
        # files read only theirs)
        results = await asyncio.gather(*(self._call(e.env.step({"observation_text": e.text, "action_text": e.action,
                                                                 "label": e.label, "sampling_params": sampling,
                                                                 "truncated": len(e.row.ids) >= e.cap}), "step")
                                         for e, (sampling, _) in zip(live, given)))
        for e, (sampling, values), got in zip(live, given, results):
            self._take_step(e, got, last, sampling, values)

    def _take_step(self, e: _Episode, got: Any, last: bool, sampling: StepSampling, values: dict) -> None:
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
        # OpenRLHF samples the episode's next turns with a returned sampling_params; an empty one is none
        e.sampling.update(changes(got.get("sampling_params") or None, sampling, values, self.env_name))
        e.text += e.action + feedback
        ids, images, pictures = self._feedback_ids(feedback, got.get("environment_images"))
        room = e.cap - len(e.row.ids)
        if bool(got.get("done", False)):
            # OpenRLHF appends the last step's feedback too: context (log-prob 0, outside the loss mask), here cut to
            # the room left. That cut does not make the episode truncated: truncation says the policy's answer was
            # cut (the overlong penalty, truncated_reward_coef), and this one ended as the environment accepted it.
            # Feedback with images is appended whole or not at all: a cut would split its images' tokens
            keep = room if images is None else (len(ids) if len(ids) <= room else 0)
            e.row.append(ids[:keep], [0.0] * min(len(ids), keep), generated=False)
            if images is not None and keep:
                e.row.add_images(images, pictures)
            e.row.done = True
            return
        if last or e.row.truncated:  # no next turn: feedback asking for one would be read by nobody
            e.row.done = True
            return
        if len(ids) >= room:  # no room left to act on the feedback (verl's too): the episode ends here, cut
            e.row.done, e.row.truncated = True, True
            return
        e.row.append(ids, [0.0] * len(ids), generated=False)
        if images is not None:  # the next turns and the trainer read them after the row's earlier images
            e.row.add_images(images, pictures)

    def _feedback_ids(self, feedback: str, given: Any) -> tuple[list[int], PromptImages | None, list]:
        """The feedback's ids; with images (alignrl's "environment_images", verl's tools' images), each image
        placeholder of its text widened to the image's tokens by the model's processor, with those images as the
        model reads them and as Pillow images. Without images, the text's ids alone, as they always were."""
        what = f"{self.env_name}.step"
        if not given_media(given):
            check_placeholders(self.tokenizer, feedback, 0, what, EnvironmentStepError)
            return (self._encode(feedback) if feedback else []), None, []
        pictures = pictures_of(given, what, EnvironmentStepError)
        ids, images = observation_ids(self.tokenizer, feedback, pictures, what, EnvironmentStepError)
        return ids, images, pictures

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
        ro = episodes_rollout([e.row for e in episodes], n_prompts, n, self.pad_id)
        if any(e.extras is not None for e in episodes):  # else None: the rows' extra_info is read unchanged
            ro.reward_extras = [dict(e.extras or {}) for e in episodes]
        return ro
