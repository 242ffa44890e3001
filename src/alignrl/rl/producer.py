"""The producer side of the RL loop: prompts -> rollout -> scores -> reference log-probs, one ScoredBatch.

`RolloutMaker` does that for the prompts it is given (dataset rows), in whatever process it runs: the
trainer's own (`InlineSource`, colocated or against HTTP services) or a sampler process that feeds a
trainer over ZeroMQ (`alignrl.placements.zmq.sampler`). Old-policy log-probs are the trainer's business
(`actor.recompute_old_logprobs`); the rollout engine's own log-probs travel with the batch.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

from alignrl.rl.rollout_ops import concat_rollouts, group_count, group_rows, kept_groups, select_groups
from alignrl.rl.scoring import RewardStage
from alignrl.config import RunConfig
from alignrl.data.collate import per_token_in_chunks
from alignrl.data.records import Rollout, Sample, ScoredBatch, Scores
from alignrl.data.sampler import BatchSampler
from alignrl.runtime.env import SINGLE, DistEnv, all_reduce_sum, gather_bytes, shard
from alignrl.interfaces import RefScorer, RolloutEngine, SamplingParams
from alignrl.rewards.errors import RewardError
from alignrl.rewards.timed_rules import late_rows, say_timeouts
from alignrl.rewards.reward_log import TrainerState, logging_rewards
from alignrl.rewards.trl_reward import is_trl_spec
from alignrl.models.folder import ModelError
from alignrl.models.logprobs import ForwardLayout, response_logprobs, response_logprobs_and_sum_pi_squared
from alignrl.rollout.env_agent import with_labels
from alignrl.runtime.lanes import lane_count
from alignrl.utils.tracking import console

# Dataset rows -> (samples, prompt token ids); the runner's `PromptData` is one.
Rows = Callable[[Sequence[int]], tuple[list[Sample], list[list[int]]]]


class RankAgreement:
    """What the data-parallel ranks of one step agree on while dynamic sampling refills their shares: whether any
    rank is still short (every rank then draws again, so their samplers stay in step) and the fewest groups a rank
    kept (every rank trains that many, so all take the same updates). One process agrees with itself."""

    def __init__(self, env: DistEnv = SINGLE):
        self.env = env

    @property
    def ranks(self) -> int:
        return self.env.world_size if self.env.distributed else 1

    def any(self, flag: bool) -> bool:
        return all_reduce_sum(self.env, [float(flag)])[0] > 0

    def fewest(self, n: int) -> int:
        import torch.distributed as dist

        return int(all_reduce_sum(self.env, [float(n)], op=dist.ReduceOp.MIN)[0])


@contextmanager
def timed(timings: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    key = f"timing/{name}"  # accumulates: dynamic sampling generates and scores several times a step
    timings[key] = timings.get(key, 0.0) + (time.perf_counter() - t0)


def batched_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     response_mask: torch.Tensor, temperature: float, micro_batch: int,
                     layout: ForwardLayout = ForwardLayout(), images=None,
                     with_sum_pi_squared: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, R) of the responses under `model`, in length-grouped, trimmed chunks, each laid out by
    `layout` (models.logprobs). `images`: each row's prompt images (`data.images.ImageRows`), or None.
    `with_sum_pi_squared`: (log-probs, each token's sum of squared probabilities over the vocabulary) from the same
    forwards, for the optimal token baselines."""
    def logprobs(m, *tensors, images=None):
        return response_logprobs(m, *tensors, temperature, layout=layout, images=images)[0]

    def logprobs_and_sum_pi_squared(m, *tensors, images=None):
        return response_logprobs_and_sum_pi_squared(m, *tensors, temperature, layout=layout, images=images)

    device = next(model.parameters()).device
    fn, outputs = (logprobs_and_sum_pi_squared, 2) if with_sum_pi_squared else (logprobs, 1)
    return per_token_in_chunks(model, fn, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch,
                               by_prompt=layout.share_prompt, images=images, lanes=lane_count(layout.lanes, device),
                               outputs=outputs)


class LocalRefScorer:
    """Reference log-probs from an in-process frozen model (the HTTP one is `rollout.remote.RemoteRefScorer`)."""

    def __init__(self, model, temperature: float, micro_batch: int, layout: ForwardLayout = ForwardLayout()):
        self.model, self.temperature, self.micro_batch, self.layout = model, temperature, micro_batch, layout

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask, images=None) -> torch.Tensor:
        return batched_logprobs(self.model, prompt_ids, prompt_mask, response_ids, response_mask, self.temperature,
                                self.micro_batch, self.layout, images)


class RolloutMaker:
    """generate -> reward -> (DAPO dynamic sampling) -> reference log-probs, for given dataset rows."""

    def __init__(self, cfg: RunConfig, engine: RolloutEngine, rewards: RewardStage, ref: RefScorer | None,
                 rank: int = 0):
        """`ref` None: no KL term needs reference log-probs. `rank` decorrelates the ranks' samples."""
        self.cfg, self.engine, self.rewards, self.ref, self.rank = cfg, engine, rewards, ref, rank
        self.logged: dict[str, float] = {}  # what TRL's reward functions logged (log_metric) of the last batch

    def sampling_params(self, step: int, gen_round: int = 0) -> SamplingParams:
        """Round 0 is the step's first generation; dynamic sampling's extra rounds get their own seeds
        (offset far past any step count), so a resumed run draws the same samples."""
        r = self.cfg.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                              repetition_penalty=r.repetition_penalty,
                              max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                              seed=self.cfg.trainer.seed * 1_000_003 + step + gen_round * 1_000_000_007
                              + self.rank * 7_919_000_003)  # ranks draw different samples

    def make(self, step: int, index: Sequence[int], rows: Rows, version: int = 0,
             more: Callable[[], Sequence[int]] | None = None, ref_groups: int | None = None,
             agree: RankAgreement = RankAgreement()) -> ScoredBatch:
        """The scored batch of RL step `step` for dataset rows `index` (`rows` turns them into samples and
        prompt ids). `more` (dynamic sampling only) returns the next rows to draw when groups run short;
        `agree`: the data-parallel ranks drawing them together. `ref_groups`: reference log-probs of only the
        first this many prompt groups (a ZeroMQ trainer computes the rest); None: all of them. The batch's
        metrics describe the first draw, whatever dynamic sampling keeps.

        TRL's reward functions read the run's state as it was when weights `version` generated the batch (the
        steps done then, in every placement: the trainer's own step, a ZeroMQ sampler's, a Ray engine's), and
        what they log (log_metric) joins the batch's metrics: each name's mean over the step's scoring."""
        with logging_rewards(trainer_state(self.cfg, version, len(getattr(rows, "samples", ())))) as log:
            batch = self._make(step, index, rows, version, more, ref_groups, agree)
        self.logged = log.metric_means()
        clash = next((k for k in self.logged if k in batch.metrics or k == "step" or k.startswith("val/")), None)
        if clash is not None:  # merged over ranks or trimmed on resume as alignrl's own, it would corrupt the logs
            raise RewardError(f"a reward function logged {clash!r} (log_metric), a name of alignrl's own metrics; "
                              "log it under another name")
        batch.metrics = {**self.logged, **batch.metrics}
        return batch

    def _make(self, step: int, index: Sequence[int], rows: Rows, version: int,
              more: Callable[[], Sequence[int]] | None, ref_groups: int | None, agree: RankAgreement) -> ScoredBatch:
        t: dict[str, float] = {}
        samples, prompts = rows(index)
        with timed(t, "gen"):
            ro = self.engine.generate(with_labels(self.engine, samples, prompts), self.sampling_params(step))
        with timed(t, "reward"):
            scores = self.score(ro, samples, prompts)
        metrics = first_draw_metrics(ro, scores)
        index = torch.as_tensor(list(index), dtype=torch.long)
        if self.cfg.algorithm.dynamic_sampling:
            ro, scores, index, dapo = self.dynamic_sample(step, ro, scores, index, rows, more, t, agree)
            metrics.update(dapo)
        late = late_rows([self.rewards.reward_fn, self.rewards.correct_fn, self.rewards.cost_fn])
        if late is not None:  # rule rewards under algorithm.reward_timeout_s: summed over ranks
            metrics["reward/timeouts"] = float(late)
            say_timeouts(f"step {step}" + (f" (rank {self.rank})" if self.rank else ""), late,
                         self.cfg.algorithm.reward_timeout_s)
        with timed(t, "ref"):
            ref_lp = self.ref_logprobs(ro, ref_groups) if self.ref is not None and len(ro.group) else None
        # state masking: tool observations are attended (response_mask) but never trained on
        loss_mask = ro.generated_mask if self.cfg.actor.state_masking else ro.response_mask
        return ScoredBatch(ro, scores, loss_mask.clone(), ref_lp, index[ro.group], version, metrics={**metrics, **t})

    def ref_logprobs(self, ro: Rollout, groups: int | None) -> torch.Tensor:
        """Reference log-probs (K, R) of the rows of the first `groups` prompt groups (all rows if None)."""
        k = len(ro.group) if groups is None else int((ro.group < groups).sum())
        if k == 0:
            return ro.logprobs.new_zeros((0, ro.logprobs.shape[1]))
        # a scorer of prompts with images takes them as `images` (the in-process one); one that cannot is one line
        extra = {} if ro.images is None else {"images": ro.images.select(range(k))}
        if extra and "images" not in inspect.signature(self.ref.logprobs).parameters:
            raise ModelError(f"the reference ({type(self.ref).__name__}) cannot read prompts with images: run the "
                             "reference in the trainer's process, or train without a KL term (actor.use_kl_loss=false, "
                             "algorithm.use_kl_in_reward=false)")
        return self.ref.logprobs(ro.prompt_ids[:k], ro.prompt_mask[:k], ro.response_ids[:k], ro.response_mask[:k],
                                 **extra)

    def score(self, ro: Rollout, samples: Sequence[Sample], prompts: Sequence[Sequence[int]]) -> Scores:
        """The rewards of `ro`, generated from `prompts` (the encoded `samples`, in order)."""
        scores = self.rewards.score(ro, samples)
        if self.cfg.algorithm.adv_estimator == "remax":
            scores.baseline = self.greedy_baseline(ro, samples, prompts)
        return scores

    def greedy_baseline(self, ro: Rollout, samples: Sequence[Sample], prompts: Sequence[Sequence[int]]
                        ) -> torch.Tensor:
        """ReMax's baseline: the reward of each prompt's greedy response, per row (B,), scored by the same
        reward stage as the samples (a reward model, the overlong penalty): the rule reward alone put the
        baseline on another scale than the rewards it is taken from. Each greedy response is generated from the
        prompt as the samples were (`prompts`, images included: a rollout row's images may also hold its tool
        observations'), under the rollouts' repetition penalty (which changes the likeliest token)."""
        first = torch.unique_consecutive(ro.group, return_counts=True)[1].cumsum(0) - 1  # a row of each group
        groups = ro.group[first].tolist()
        rows = [samples[g] for g in groups]  # greedy row (group) j is the prompt of rows[j]
        greedy = self.engine.generate(with_labels(self.engine, rows, [prompts[g] for g in groups]),
                                      SamplingParams(n=1, temperature=0.0, stop=tuple(self.cfg.rollout.stop),
                                                     max_new_tokens=self.cfg.rollout.max_new_tokens,
                                                     repetition_penalty=self.cfg.rollout.repetition_penalty))
        return self.rewards.score(greedy, rows).rewards[ro.group]

    def dynamic_sample(self, step: int, ro: Rollout, scores: Scores, index: torch.Tensor, rows: Rows,
                       more: Callable[[], Sequence[int]] | None, timings: dict[str, float],
                       agree: RankAgreement = RankAgreement()):
        """DAPO dynamic sampling (Yu et al. 2025): keep the groups whose rewards differ (or, with
        algorithm.dynamic_sampling_range, whose mean reward is strictly inside it), generate and
        score more prompts (up to algorithm.max_gen_rounds extra rounds of data.gen_batch_size prompts, only if
        `more` is given) until this rank's share of data.train_batch_size groups is kept, then keep exactly that
        many (the earliest) or, still short, all of them. Over several ranks a round runs while any rank is short
        (a rank already full draws and discards, keeping the samplers in step) and every rank keeps as many groups
        as the fewest kept.
        Returns (rollout, scores, dataset row per group, metrics)."""
        want, pad = self.cfg.data.train_batch_size // agree.ranks, self.rewards.tokenizer.pad_token_id
        band = self.cfg.algorithm.dynamic_sampling_range
        ro, scores, index = _keep_groups(ro, scores, index, kept_groups(scores.for_filtering, ro.group, band))
        rounds = 1
        while rounds <= self.cfg.algorithm.max_gen_rounds and more is not None and agree.any(group_count(ro.group) < want):
            new_index = torch.as_tensor(list(more()), dtype=torch.long)
            rounds += 1
            if group_count(ro.group) >= want:
                continue
            samples, prompts = rows(new_index.tolist())
            with timed(timings, "gen"):
                new = self.engine.generate(with_labels(self.engine, samples, prompts),
                                           self.sampling_params(step, rounds - 1))
            with timed(timings, "reward"):
                new_scores = self.score(new, samples, prompts)
            new, new_scores, new_index = _keep_groups(new, new_scores, new_index,
                                                      kept_groups(new_scores.for_filtering, new.group, band))
            ro, scores = concat_rollouts(ro, new, pad), scores.cat(new_scores)
            index = torch.cat([index, new_index])
        kept = agree.fewest(min(group_count(ro.group), want))
        if kept < want and more is not None:  # without `more` the caller refills (a Ray engine's share)
            share = " per rank" if agree.ranks > 1 else ""
            console.print(f"step {step}: dynamic sampling kept {kept} of {want} groups{share} after {rounds} "
                          "generation round(s); training on those")
        ro, scores, index = _keep_groups(ro, scores, index, torch.arange(kept))
        return ro, scores, index, {"dapo/kept_groups": float(kept * agree.ranks), "dapo/gen_rounds": float(rounds)}


def trainer_state(cfg: RunConfig, global_step: int, train_rows: int = 0) -> TrainerState:
    """What TRL's reward functions read of the run after `global_step` RL steps (TRL's TrainerState): its steps
    (trainer.total_training_steps) and the passes over `train_rows` training rows done, a step drawing
    data.draw_size of them (the last partial draw of an epoch dropped, as the steps are counted); 0 unknown."""
    per_epoch = train_rows // cfg.data.draw_size
    return TrainerState(global_step, cfg.trainer.total_training_steps, global_step / per_epoch if per_epoch else 0.0)


def agent_metrics(ro: Rollout) -> dict[str, float]:
    """Multi-turn episodes: turns and the generated share of the response; the search agent's tool use, or an
    environment's own extra logs (NaN where an episode did not write one). Empty for single-turn rollouts, which
    carry no stats."""
    if not ro.stats:
        return {}
    st = ro.stats
    out = {"agent/turns": float(st["turns"].mean()),
           "agent/generated_token_frac": float(ro.generated_mask.sum() / ro.response_mask.sum().clamp(min=1))}
    if "searches" in st:
        out.update({"agent/searches_per_episode": float(st["searches"].mean()),
                    "agent/valid_action_rate": float(st["valid_actions"].sum() / st["actions"].sum().clamp(min=1))})
    for name in (k for k in st if k.startswith("env/")):
        out[f"agent/{name[4:]}"] = float(st[name].nanmean())
    return out


def first_draw_metrics(ro: Rollout, scores: Scores) -> dict[str, float]:
    lengths, shown = ro.response_lengths.float(), scores.rewards if scores.shown is None else scores.shown
    return {**agent_metrics(ro),
        "reward/mean": float(shown.mean()),
        "reward/std": float(shown.std()) if len(shown) > 1 else 0.0,
        "reward/accuracy": float(scores.correct.float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(ro.truncated.float().mean()),
    }


def moments(mean: float, std: float, n: int) -> list[float]:
    """n, Σx and Σx² of `n` values with this mean and sample standard deviation: what adds up over parts."""
    return [float(n), n * mean, (n - 1) * std * std + n * mean * mean]


def from_moments(n: float, total: float, squares: float) -> tuple[float, float]:
    """The mean and sample standard deviation of values whose count, sum and sum of squares these are."""
    mean = total / n if n else 0.0
    return mean, (math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0)


def pooled_std(env: DistEnv, mean: float, std: float, n: int) -> float:
    """The sample standard deviation of all ranks' values together, from each rank's mean and sample standard
    deviation of its `n` values."""
    return from_moments(*all_reduce_sum(env, moments(mean, std, n)))[1]


def logged_over_ranks(env: DistEnv, logged: dict[str, float]) -> dict[str, float]:
    """What TRL's reward functions logged on each rank (log_metric), each name the mean over the ranks that logged
    it (TRL's mean of the ranks' means), the same on every rank. The ranks agree on the names first: a name only
    some ranks logged (a function that logs as it finds cause) would leave their metrics' names apart, and the
    step's metrics then go unreduced (`runtime.env.mean_metrics`)."""
    names = sorted({name for part in gather_bytes(env, json.dumps(sorted(logged)).encode())
                    for name in json.loads(part)})
    if not names:
        return {}
    sums = all_reduce_sum(env, [x for name in names for x in ((logged[name], 1.0) if name in logged else (0.0, 0.0))])
    return {name: sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names)}


def merged_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of batches made apart (the Ray engines' shares, of `n` sequences each) as those of one batch:
    a `*_max` the largest, a `*_min` the smallest, reward/std pooled, the others the mean weighted by size."""
    # a key some parts lack (a reward function's log_metric where it logged) is the mean of the parts that have it
    keys = dict.fromkeys(k for m, _ in parts for k in m)
    out = {k: sum(m[k] * size for m, size in parts if k in m) / (sum(size for m, size in parts if k in m) or 1)
           for k in keys}
    for k in out:
        if k.endswith(("_max", "_min")):
            out[k] = (max if k.endswith("_max") else min)(m[k] for m, _ in parts if k in m)
    if all("reward/std" in m and "reward/mean" in m for m, _ in parts):
        sums = [sum(x) for x in zip(*(moments(m["reward/mean"], m["reward/std"], size) for m, size in parts))]
        out["reward/mean"], out["reward/std"] = from_moments(*sums)
    return out


def _keep_groups(ro: Rollout, scores: Scores, index: torch.Tensor, keep: torch.Tensor):
    """The kept groups of the rollout, their scores, and their dataset rows (one per group)."""
    keep = torch.as_tensor(keep, dtype=torch.long)
    return select_groups(ro, keep), scores.rows(group_rows(ro.group, keep)), index[torch.sort(keep).values]


class InlineSource:
    """The BatchSource of one process (or each torchrun rank): draws the step's rows from the
    checkpointed sampler, keeps this rank's share, and makes the batch here."""

    def __init__(self, maker: RolloutMaker, sampler: BatchSampler, rows: Rows, version: Callable[[], int],
                 env: DistEnv = SINGLE):
        """`version`: the trainer's current weight version (generation here always uses the newest)."""
        self.maker, self.sampler, self.rows, self.version, self.env = maker, sampler, rows, version, env

    def next_batch(self, step: int) -> ScoredBatch:
        def draw() -> list[int]:  # the sampler's position is checkpointed, so extra DAPO rounds resume exactly
            return shard(self.sampler.next(), self.env)  # every rank draws the same batch and keeps its share

        first = draw()
        batch = self.maker.make(step, first, self.rows, self.version(), more=draw, agree=RankAgreement(self.env))
        if self.env.distributed:  # the reward spread of the whole batch, not the mean of each share's
            batch.metrics["reward/std"] = pooled_std(self.env, batch.metrics["reward/mean"],
                                                     batch.metrics["reward/std"], len(first) * self.maker.cfg.rollout.n)
            if is_trl_spec(self.maker.cfg.algorithm.reward_fn):  # only TRL's functions log (the same on every rank)
                batch.metrics.update(logged_over_ranks(self.env, self.maker.logged))
        return batch

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def close(self, finished: bool) -> None:
        pass
