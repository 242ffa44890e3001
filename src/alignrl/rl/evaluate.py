"""Held-out evaluation: accuracy (greedy, or sampled as verl's val_kwargs), and the room RL has to improve it
(pass@k when sampling).

Besides `accuracy` (full reward, e.g. strict `#### N` for GSM8K-style sources), GSM8K-style sources
also get `accuracy_flexible` (last number in the text), which separates learning the answer format
from learning to compute the answer.

`room` reports greedy pass@1 next to pass@k at the rollout temperature (k = samples per prompt), overall
and by difficulty (`extra["ops"]`, the number of operations of a synthetic problem): RL mostly turns
problems the model sometimes solves into problems it solves greedily, so pass@k bounds what a run can
gain, and the per-difficulty split shows where that room is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from alignrl.data.records import Sample
from alignrl.interfaces import SamplingParams
from alignrl.rewards import gsm8k
from alignrl.rewards.registry import REWARDS, ScoreError, reads_prompt_text, score_row
from alignrl.rewards.values import is_correct
from alignrl.rewards.reward_log import TrainerState, extra_columns, logging_rewards
from alignrl.rl.scoring import (decoded, keep_columns, logged_columns, played_correct, prompt_texts, reads_ids,
                                response_id_lists, values_at_once, with_reward_extras)
from alignrl.rollout.env_agent import with_labels


def _scores(engine, tokenizer, samples: Sequence[Sample], prompts: Sequence[Sequence[int]], correct_fn,
            params: SamplingParams, batch_size: int, progress: Callable[[int], None] | None = None,
            answers: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(strict, flexible) correctness, each (len(samples), params.n) of 0/1, batch by batch of prompts;
    `progress` is told the number of problems of each batch once it is scored; `answers`, when given, gets each
    answer's (prompt text, response text, ground truth, strict correctness, the columns TRL's reward functions logged
    of it)."""
    strict, flexible = [], []
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        ro = engine.generate(with_labels(engine, batch, prompts[start:start + batch_size]), params)
        texts = decoded(tokenizer, ro.response_ids, ro.response_mask)
        played = played_correct(ro)
        # an environment played the episodes, or the rule scores them
        right = (played.float().tolist() if played is not None else
                 rule_correct(tokenizer, ro, texts, batch, start, correct_fn, params.n))
        strict += right
        if answers is not None:
            answers += zip(decoded(tokenizer, ro.prompt_ids, ro.prompt_mask), texts,
                           [batch[j // params.n].ground_truth for j in range(len(texts))], right, logged_columns(ro))
        flexible += [gsm8k.compute_score(t, batch[j // params.n].ground_truth, method="flexible")
                     if REWARDS.get(batch[j // params.n].data_source) is gsm8k.compute_score else 0.0
                     for j, t in enumerate(texts)]
        if progress is not None:
            progress(len(prompts[start:start + batch_size]))
    shape = (len(samples), params.n)
    return torch.tensor(strict).view(shape), torch.tensor(flexible).view(shape)


def rule_correct(tokenizer, ro, texts: Sequence[str], batch: Sequence[Sample], start: int, correct_fn,
                 n: int) -> list[float]:
    """1.0 where `correct_fn` counts a row's text right (its "acc", else a score >= 1), else 0.0, for the rollout
    `ro` of `batch` (`n` rows per sample, the first at `start` among the evaluated ones); a ScoreError names the row.
    The columns TRL's functions log of the rows (log_extra) stay with `ro`'s rows (`scoring.logged_columns`)."""
    read = prompt_texts(tokenizer, ro.prompt_ids, ro.prompt_mask) if reads_prompt_text(correct_fn) else None
    # verl's num_turns, turn_scores and tool_rewards in extra_info, as in training
    rows = with_reward_extras(ro, [batch[j // n] for j in range(len(texts))])
    ids = response_id_lists(ro) if reads_ids(correct_fn) else None
    with extra_columns() as columns:
        values = values_at_once(correct_fn, rows, texts, read, ids)  # None: scored row by row below
    keep_columns(ro, columns)
    out: list[float] = []
    for j, (t, s) in enumerate(zip(texts, rows)):
        try:
            value = (values[j] if values is not None else
                     score_row(correct_fn, s.data_source, t, s.ground_truth, s.extra, read[j] if read else None))
            if isinstance(value, ScoreError):
                raise value
            out.append(float(is_correct(value)))
        except ScoreError as e:  # name the row: in its data file, else among the evaluated samples
            raise e.at(s.source or start + j // n, "reward function") from e.__cause__
    return out


def has_last_number(samples: Sequence[Sample]) -> bool:
    """Whether the last-number reading means anything here: some samples are GSM8K-scored (a QA or math
    task's answers are not read that way, and a column of zeros beside them only misleads)."""
    return any(REWARDS.get(s.data_source) is gsm8k.compute_score for s in samples)


def _by_difficulty(samples: Sequence[Sample], solved: torch.Tensor) -> dict[str, float]:
    """Mean of `solved` (len(samples),) overall and per `extra["ops"]` value (when the samples have one)."""
    out = {"all": round(float(solved.mean()), 4) if len(samples) else 0.0}
    ops = [s.extra.get("ops") for s in samples]
    for v in sorted({o for o in ops if o is not None}):
        idx = torch.tensor([i for i, o in enumerate(ops) if o == v])
        out[f"ops={v}"] = round(float(solved[idx].mean()), 4)
    return out


def validation_params(max_new_tokens: int, stop: Sequence[str] = (), temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = -1, n: int = 1, seed: int = 0, min_p: float = 0.0,
                      repetition_penalty: float = 1.0) -> SamplingParams:
    """The held-out sampler: greedy (temperature 0, one answer), or `n` answers at `temperature` (verl's
    rollout.val_kwargs, our rollout.val_*). The rollouts' `repetition_penalty` applies to greedy decoding too (it
    changes which token is likeliest), their `min_p` to sampling (the likeliest token always passes it), as TRL's
    evaluation generates with its training settings."""
    if temperature <= 0.0:
        return SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens, stop=tuple(stop),
                              repetition_penalty=repetition_penalty)
    return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          stop=tuple(stop), seed=seed, min_p=min_p, repetition_penalty=repetition_penalty)


def heldout_eval(engine, tokenizer, samples: Sequence[Sample], prompts: Sequence[Sequence[int]], correct_fn,
                 max_new_tokens: int, batch_size: int = 500, subset: int | None = None, stop: Sequence[str] = (),
                 params: SamplingParams | None = None, progress: Callable[[int], None] | None = None,
                 answers: list | None = None, state: TrainerState | None = None
                 ) -> dict[str, float] | tuple[dict[str, float], dict[str, float]]:
    """Held-out accuracies over all `samples`, greedy unless `params` (`validation_params`) samples: then accuracy is
    the mean over each problem's n answers (verl's mean@n) and, with n > 1, `pass@n` the share of problems some
    answer solves. With `subset`, also those of the first `subset` samples (the periodic evaluation set) from the
    same decoding, as a second dict. `stop`: the training rollouts' stop strings (rollout.stop), so the held-out
    responses end where the policy's do in training. `progress`: told the problems of each batch as it is done
    (len(samples) in all). `answers`: see _scores. `state`: the run's, as TRL's reward functions read it
    (trainer_state); what they log (log_metric) is in both dicts, each name's mean over the evaluation."""
    params = params or validation_params(max_new_tokens, stop)
    with logging_rewards(state) as log:
        strict, flexible = _scores(engine, tokenizer, samples, prompts, correct_fn, params,
                                   max(1, batch_size // params.n), progress, answers)
    last_number, logged = has_last_number(samples), log.metric_means()

    def summary(n: int) -> dict[str, float]:
        answers = max(1, n * params.n)
        out = {**logged, "accuracy": float(strict[:n].sum()) / answers}
        if last_number:
            out["accuracy_flexible"] = float(flexible[:n].sum()) / answers
        if params.n > 1:
            out[f"pass@{params.n}"] = float(strict[:n].amax(1).sum()) / max(1, n)
        return out

    full = summary(len(samples))
    return full if subset is None else (full, summary(min(subset, len(samples))))


def room(engine, tokenizer, samples: Sequence[Sample], prompts: Sequence[Sequence[int]], correct_fn,
         max_new_tokens: int, k: int, temperature: float, seed: int = 0, batch_size: int = 128,
         stop: Sequence[str] = (), top_p: float = 1.0, top_k: int = -1,
         progress: Callable[[int], None] | None = None, min_p: float = 0.0, repetition_penalty: float = 1.0) -> dict:
    """Greedy pass@1 and pass@k (any of k samples at `temperature` correct, with the rollouts' `stop`, `top_p`,
    `top_k`, `min_p` and `repetition_penalty`, the penalty in the greedy decoding too), strict and last-number,
    overall and by difficulty: {"k": k, "pass@1": {"strict": {...}, "flexible": {...}}, "pass@k": {...}}.
    `progress`: told the problems of each batch as it is done, greedy then sampled (2 x len(samples) in all)."""
    greedy = _scores(engine, tokenizer, samples, prompts, correct_fn,
                     validation_params(max_new_tokens, stop, repetition_penalty=repetition_penalty),
                     batch_size * k, progress)
    sampled = _scores(engine, tokenizer, samples, prompts, correct_fn,
                      validation_params(max_new_tokens, stop, temperature, top_p, top_k, k, seed, min_p,
                                        repetition_penalty), batch_size, progress)
    out: dict = {"k": k, "temperature": temperature}
    last_number = has_last_number(samples)
    for label, (strict, flexible) in (("pass@1", greedy), ("pass@k", sampled)):
        out[label] = {"strict": _by_difficulty(samples, strict.amax(1))}
        if last_number:
            out[label]["flexible"] = _by_difficulty(samples, flexible.amax(1))
    return out


def format_room(r: dict) -> str:
    """One console line per extraction: greedy pass@1 -> pass@k, overall then by difficulty."""
    lines = []
    for kind in r["pass@1"]:
        one, many = r["pass@1"][kind], r["pass@k"][kind]
        cells = ", ".join(f"{key} {one[key]:.3f}/{many[key]:.3f}" for key in one)
        lines.append(f"  {kind:8s} pass@1/pass@{r['k']} (T={r['temperature']:g}): {cells}")
    return "\n".join(lines)
