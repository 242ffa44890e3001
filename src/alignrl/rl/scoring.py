"""The reward stage of the producer: task rewards (a rule on the decoded text, or a reward model on the
ids), shaping, correctness, and the safety cost. Pure orchestration of the reward functions; it knows
nothing of where the rollout came from or where the scores go."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from alignrl.core.advantages import decoupled_group_sum, normalize_then_sum
from alignrl.core.shaping import missing_eos_penalty, overlong_penalty, truncated_reward
from alignrl.data.records import Rollout, Sample, Scores
from alignrl.interfaces import SequenceScorer
from alignrl.rewards.registry import ScoreError, finite_score, reads_prompt_text, score_row
from alignrl.rewards.reward_log import extra_columns
from alignrl.rewards.trl_reward import WithColumns
from alignrl.rewards.values import RowScore, TimedOut, filter_score, is_correct

# verl's compute_score signature: (data_source, solution_str, ground_truth, extra_info) -> float
RewardFn = Callable[[str, str, str, dict], float]
# the key of a row's `Rollout.reward_extras` that keeps the columns TRL's functions logged of it (log_extra), for the
# step's logged generations; never part of the extra_info a reward function reads
LOGGED = "trl_log_extra"


@dataclass(frozen=True)
class RewardComponents:
    """verl's GDPO (algorithm.adv_estimator=gdpo): the keys of the dicts the reward function returns, each
    normalized in its prompt group (as GRPO's advantage, by its std or not), then weighted and summed."""

    keys: tuple[str, ...]
    weights: tuple[float, ...] = ()  # one each; empty: 1 each
    norm_by_std: bool = True

    def reward(self, rewards: Sequence[float], rows: Sequence[Sample], group: torch.Tensor, who: str) -> list[float]:
        """Each row's decoupled sum, from its reward value's numbers by key (a row past the time limit scores 0 in
        each, as in the reward); a row of function `who` without a key, or with a value that is not finite, is one
        line naming the row."""
        table = torch.tensor([[_component(r, k, rows[i], i, who) for k in self.keys] for i, r in enumerate(rewards)],
                             dtype=torch.float32).reshape(len(rewards), len(self.keys))
        weights = torch.tensor(self.weights or [1.0] * len(self.keys), dtype=torch.float32)
        return decoupled_group_sum(table, group, weights, self.norm_by_std).tolist()


def _component(value: float, key: str, row: Sample, i: int, who: str) -> float:
    if isinstance(value, TimedOut):
        return 0.0
    got = getattr(value, "parts", {}).get(key)
    if got is None or not torch.isfinite(torch.tensor(got)):
        what = f"returned no number under {key!r}" if got is None else f"returned {key}={got}"
        raise ScoreError(who, what, row.data_source,
                         "return a dict with a finite number under each of algorithm.gdpo_reward_keys "
                         "({'score': s, 'format_reward': f, ...})").at(row.source or i, "reward function")
    return got


@dataclass
class RewardStage:
    tokenizer: object
    reward_fn: RewardFn  # the training reward (may add format shaping to correctness)
    correct_fn: RewardFn  # correctness alone (its "acc" where it gives one, else >= 1 counts as correct)
    max_new_tokens: int  # the longest response: rollout.max_new_tokens, a multi-turn episode's cap (response_cap)
    overlong_buffer_len: int = 0  # DAPO soft overlong punishment (0: off)
    overlong_penalty_factor: float = 1.0
    reward_model: SequenceScorer | None = None  # its score (times model_weight) replaces the rule reward, or the
    model_mix: str = "replace"  # rule reward is added to it on rows that have an answer to check (add), on all (sum)
    model_weight: float = 1.0
    cost_fn: RewardFn | None = None  # PPO-Lagrangian cost: a rule on the decoded response...
    cost_model: SequenceScorer | None = None  # ...or a cost model on the ids
    truncated_reward_coef: float | None = None  # responses cut at the cap: reward scaled (>= 0) or replaced (< 0)
    missing_eos_penalty: float = 0.0  # responses cut at the cap: this subtracted from their reward (TRL's)
    # TRL's normalize_then_sum: each of the reward's functions normalized in its prompt group before the weighted sum
    normalize_each: bool = False
    components: RewardComponents | None = None  # verl's GDPO: the reward function's dict components apart

    def texts(self, ro: Rollout) -> list[str]:
        return decoded(self.tokenizer, ro.response_ids, ro.response_mask)

    def task_rewards(self, rows: Sequence[Sample], texts: Sequence[str],
                     prompts: Sequence[str] | None = None, ids: Sequence[list[int]] | None = None) -> list[float]:
        return rule_scores(self.reward_fn, "reward function", rows, texts, prompts, ids)

    def response_ids(self, ro: Rollout) -> list[list[int]] | None:
        """The responses' token ids, for reward functions that read them (None: none does)."""
        if not any(reads_ids(f) for f in (self.reward_fn, self.correct_fn, self.cost_fn) if f is not None):
            return None
        return response_id_lists(ro)

    def prompt_texts(self, ro: Rollout) -> list[str] | None:
        """The prompts as the policy read them, for reward functions that read the prompt (None: none does)."""
        if not any(reads_prompt_text(f) for f in (self.reward_fn, self.correct_fn, self.cost_fn) if f is not None):
            return None
        return prompt_texts(self.tokenizer, ro.prompt_ids, ro.prompt_mask)

    def score(self, ro: Rollout, samples: Sequence[Sample]) -> Scores:
        """Rewards plus the overlong penalty when configured; correctness is never shaped. `samples`
        are the rollout's prompts in group order. Every reward and cost is checked finite here, at the
        boundary: past it a NaN spreads through the advantages into every weight. The columns TRL's functions log
        of the rows (log_extra) stay with the rollout's rows (`logged_columns`), through dynamic sampling's choice."""
        with extra_columns() as columns:
            scores = self._score(ro, samples)
        keep_columns(ro, columns)
        return scores

    def _score(self, ro: Rollout, samples: Sequence[Sample]) -> Scores:
        rows = with_reward_extras(ro, [samples[g] for g in ro.group.tolist()])
        rewards, correct = self.task_scores(ro, rows)
        out = torch.tensor(rewards, dtype=torch.float32)
        filters = for_filtering(ro, rewards)
        if self.reward_model is not None:
            kept = torch.tensor([self.model_mix == "sum" or (self.model_mix == "add" and s.ground_truth not in
                                                              (None, "")) for s in rows])
            out = self.model_weight * model_scores(self.reward_model, "reward model", ro, rows) + \
                torch.where(kept, out, 0.0)
        if self.overlong_buffer_len:
            out = out + overlong_penalty(ro.response_lengths, self.max_new_tokens, self.overlong_buffer_len,
                                         self.overlong_penalty_factor)
        if self.truncated_reward_coef is not None:
            out = truncated_reward(out, ro.truncated, self.truncated_reward_coef)
        if self.missing_eos_penalty:
            out = missing_eos_penalty(out, ro.truncated, self.missing_eos_penalty)
        costs = None
        if self.cost_fn is not None:
            texts, prompts = self.texts(ro), self.prompt_texts(ro)
            costs = torch.tensor(rule_scores(self.cost_fn, "cost function", rows, texts, prompts,
                                             self.response_ids(ro)))
        elif self.cost_model is not None:
            costs = model_scores(self.cost_model, "cost model", ro, rows)
        # the logs show the plain score where the reward trains normalized per group (GDPO's)
        shown = filters if self.normalize_each or self.components is not None else None
        return Scores(out, torch.tensor(correct), costs, filter_scores=filters, shown=shown)

    def task_scores(self, ro: Rollout, rows: Sequence[Sample]) -> tuple[list[float], list[bool]]:
        """Each row's task reward and whether it is correct (a correctness score >= 1): from the environment that
        played the episode (`rollout.env_agent`: its rewards and its last score), else the rule functions."""
        played = played_correct(ro)
        if played is not None:
            return ro.stats["env_reward"].tolist(), played.tolist()
        texts, prompts, ids = self.texts(ro), self.prompt_texts(ro), self.response_ids(ro)
        if self.normalize_each:  # correctness reads the plain weighted sum; the reward, the group-normalized one
            table, weights = function_table(self.reward_fn, "reward function", rows, texts, prompts, ids)
            plain = torch.nansum(table * weights, dim=1).tolist()
            # dynamic sampling's bounds read the plain sum too (RowScore's filter score), not the normalized reward
            normalized = normalize_then_sum(table, ro.group, weights).tolist()
            return [RowScore(r, p) for r, p in zip(normalized, plain)], [is_correct(p) for p in plain]
        rewards = self.task_rewards(rows, texts, prompts, ids)
        if self.correct_fn is self.reward_fn:  # no shaping: correctness is the reward itself
            correct = [is_correct(r) for r in rewards]
        else:
            correct = [is_correct(r) for r in rule_scores(self.correct_fn, "reward function", rows, texts, prompts,
                                                          ids)]
        if self.components is not None:  # the reward trains decoupled; the filtering and the logs read the score
            summed = self.components.reward(rewards, rows, ro.group, getattr(self.reward_fn, "__name__",
                                                                              repr(self.reward_fn)))
            given = [filter_score(p) for p in rewards]  # a dict's own filter_score stays the one filtering reads
            return [RowScore(r, float(p) if g is None else g) for r, p, g in zip(summed, rewards, given)], correct
        return rewards, correct


def with_reward_extras(ro: Rollout, rows: list[Sample]) -> list[Sample]:
    """`rows` (one per rollout row) with what each episode adds to its extra_info (`Rollout.reward_extras`), over
    the row's own keys as verl's reward manager merges them: where verl's tool loop played an episode, its num_turns
    (ReTool's reward credits tool calls by it), turn_scores and tool_rewards. `rows` itself where nothing is added.
    The values are copies: a reward function that edits its extra_info leaves the rollout's record as it was."""
    if ro.reward_extras is None:
        return rows
    added = [{k: v for k, v in (x or {}).items() if k != LOGGED} for x in ro.reward_extras]
    return [replace(s, extra=_merged(s.extra, copy.deepcopy(x))) if x else s for s, x in zip(rows, added)]


def keep_columns(ro: Rollout, columns: dict[str, list]) -> None:
    """The columns TRL's functions logged of the rollout's rows (one value a row), kept in its rows' reward_extras
    (which follow the rows wherever dynamic sampling or the ranks' shares take them)."""
    if not columns:
        return
    extras = ro.reward_extras or [{} for _ in ro.group]
    ro.reward_extras = [{**x, LOGGED: {**x.get(LOGGED, {}), **{c: v[i] for c, v in columns.items()}}}
                        for i, x in enumerate(extras)]


def logged_columns(ro: Rollout) -> list[dict]:
    """Each row's columns logged by TRL's functions (log_extra), {} where none."""
    return [dict((x or {}).get(LOGGED, {})) for x in ro.reward_extras or [None] * len(ro.group)]


def plain_columns(ro: Rollout) -> list[dict] | None:
    """`logged_columns` in plain values (numbers, text, lists and maps; anything else as its text), as they cross
    to a ZeroMQ trainer; None where no row has any."""
    rows = logged_columns(ro)
    return json.loads(json.dumps(rows, default=str)) if any(rows) else None


def put_columns(ro: Rollout, rows: object) -> None:
    """`plain_columns`'s rows back with the rollout's rows (a ZeroMQ trainer's batch); ValueError where they are
    not one map a row."""
    if rows is None:
        return
    if not isinstance(rows, list) or len(rows) != len(ro.group) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"the batch's logged columns are not one map for each of its {len(ro.group)} rows")
    extras = ro.reward_extras or [{} for _ in rows]
    ro.reward_extras = [{**x, LOGGED: r} for x, r in zip(extras, rows)]


def _merged(extra: dict | None, added: dict) -> dict:
    """The row's extra_info with the episode's keys over it; a by-column row keeps its columns (TRL's functions
    read them)."""
    merged = {**(extra or {}), **added}
    columns = getattr(extra, "columns", None)
    return merged if columns is None else WithColumns(merged, columns)


def played_correct(ro: Rollout) -> torch.Tensor | None:
    """(B,) bool: the episodes an environment played whose last score is 1 or more; None when no environment scored
    them (`rollout.env_agent` leaves its rewards and scores in `Rollout.stats`)."""
    return ro.stats["env_score"] >= 1.0 if "env_score" in ro.stats else None


def for_filtering(ro: Rollout, rewards: Sequence[float]) -> torch.Tensor | None:
    """What OpenRLHF's dynamic filtering tests in place of the task reward, before any shaping: an environment's last
    scores, or an OpenRLHF reward file's "scores" (`values.RowScore`); None when nothing gives them."""
    if "env_score" in ro.stats:
        return ro.stats["env_score"]
    given = [filter_score(r) for r in rewards]
    if all(g is None for g in given):
        return None
    return torch.tensor([float(r) if g is None else g for r, g in zip(rewards, given)], dtype=torch.float32)


def rule_scores(fn: RewardFn, kind: str, rows: Sequence[Sample], texts: Sequence[str],
                prompts: Sequence[str] | None = None, ids: Sequence[list[int]] | None = None) -> list[float]:
    """`fn` on each (row, text), each result a finite float, else a one-line ScoreError naming `fn`
    (`file.py:function` for a user's function), the row and its data_source. The row is the sample's
    place in its data file (`train.parquet row 17`, `train.jsonl:18`) when it was loaded from one, else
    its index in `rows`. `prompts`: each row's prompt text, for a function that reads it; `ids`: each response's
    token ids, for one that reads them (`response_id_lists`)."""
    out, name = [], getattr(fn, "__name__", repr(fn))
    values = values_at_once(fn, rows, texts, prompts, ids, kind)
    for i, (s, t) in enumerate(zip(rows, texts)):
        try:
            value = values[i] if values is not None else score_row(fn, s.data_source, t, s.ground_truth, s.extra,
                                                                    prompts[i] if prompts else None)
            if isinstance(value, ScoreError):  # a row scored in a worker (timed_values)
                raise value
            out.append(finite_score(value, name, s.data_source))
        except ScoreError as e:  # raised where the row is unknown: name it, in its data file when it has one
            raise e.at(s.source or i, kind) from e.__cause__
    return out


def function_table(fn, kind: str, rows: Sequence[Sample], texts: Sequence[str], prompts: Sequence[str] | None,
                   ids: Sequence[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) each of `fn`'s K functions' value of each row (NaN where one skipped the row), unweighted, and the K
    weights: a reward of several weighted functions (TRL's) asked for them apart. A bad value names its row."""
    more = {"prompts": list(prompts) if prompts else None, "completion_ids": ids}
    table = _called_on_batch(fn.per_function, rows, texts, more, kind)
    for values in table:
        for i, value in enumerate(values):
            if isinstance(value, ScoreError):
                raise value.at(rows[i].source or i, kind)
    nan = float("nan")
    out = torch.tensor([[nan if v is None else v for v in values] for values in table], dtype=torch.float32)
    return out.T.reshape(len(rows), len(table)), torch.tensor(fn.weights, dtype=torch.float32)


def values_at_once(fn, rows: Sequence[Sample], texts: Sequence[str], prompts: Sequence[str] | None,
                   ids: Sequence[list[int]] | None = None, kind: str = "reward function") -> list | None:
    """Each row's value from a function that scores a whole batch in one call (verl's batch manager, TRL's
    functions: a judge model or a service scores many answers at once) or from a timed rule's workers; None for a
    rule scored here row by row."""
    whole = getattr(fn, "batch", None)
    if whole is None or not rows:
        return timed_values(fn, rows, texts, prompts)
    more: dict[str, object] = {}
    if reads_prompt_text(fn):
        more["prompts"] = list(prompts) if prompts else None
    if reads_ids(fn):
        more["completion_ids"] = ids
    return _called_on_batch(whole, rows, texts, more, kind)


def _called_on_batch(call, rows: Sequence[Sample], texts: Sequence[str], more: dict, kind: str):
    """`call` on the batch's columns (data sources, texts, ground truths, extras) and `more`; a ScoreError of the
    call as a whole names the batch, as no one row is to blame."""
    try:
        return call([s.data_source for s in rows], list(texts), [s.ground_truth for s in rows],
                    [s.extra for s in rows], **more)
    except ScoreError as e:
        raise e.at(f"a batch of {len(rows)} rows", kind) from e.__cause__


def reads_ids(fn) -> bool:
    """Whether `fn` takes the responses' token ids beside their texts (TRL's `completion_ids`)."""
    return bool(getattr(fn, "reads_ids", False))


def response_id_lists(ro: Rollout) -> list[list[int]]:
    """Each response's token ids without the padding, as TRL's `completion_ids` holds them."""
    return [row[mask.bool()].tolist() for row, mask in zip(ro.response_ids, ro.response_mask)]


def timed_values(fn, rows: Sequence[Sample], texts: Sequence[str], prompts: Sequence[str] | None) -> list | None:
    """Each row's value from a rule under a time limit (`rewards.timed_rules`: scored side by side in workers, a
    failed row holding its ScoreError), or None for a rule scored here row by row."""
    if getattr(fn, "rows", None) is None:
        return None
    return fn.rows([(s.data_source, t, s.ground_truth, s.extra, prompts[i] if prompts else None)
                    for i, (s, t) in enumerate(zip(rows, texts))])


def decoded(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Each row's tokens under `mask` as text, special tokens left out: what a rule scores, and what verl's dumps
    hold."""
    return tokenizer.batch_decode(ids.masked_fill(~mask.bool(), tokenizer.pad_token_id), skip_special_tokens=True)


def prompt_texts(tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
    """Each prompt as the policy read it: its tokens without the padding, special tokens (the chat template's) kept."""
    return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            for ids, mask in zip(prompt_ids, prompt_mask)]


def model_scores(scorer: SequenceScorer, kind: str, ro: Rollout, rows: Sequence[Sample]) -> torch.Tensor:
    """The scorer's (B,) scores, checked finite: a reward model with non-finite weights scores NaN."""
    tensors = (ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
    # a rule service (OpenRLHF's /get_reward) checks answers: it gets the rows' ground truth with the texts; a reward
    # model of its own chat template (`models.rm_template`) reads the prompts as messages
    scores = (scorer.score(*tensors, labels=[r.ground_truth for r in rows]) if getattr(scorer, "takes_labels", False)
              else scorer.score(*tensors, messages=[r.messages for r in rows])
              if getattr(scorer, "takes_messages", False) else scorer.score(*tensors))
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        name = getattr(scorer, "name", type(scorer).__name__)  # ModelScorer: its folder; a service: its class
        raise ScoreError(name, f"scored {scores[i].item()}", rows[i].data_source,
                         "check the model's weights (non-finite weights score NaN)", row=rows[i].source or i, kind=kind)
    return scores
