"""One RL step as a pipeline of named stages:

    generate -> reward -> reference log-probs -> old log-probs -> advantages -> policy update -> sync

Orchestration only: the math lives in `alignrl.core`, the update loop in `alignrl.train.actor`.
Each stage talks to an interface (rollout engine, reward function, reference scorer, actor), so the
same step runs whichever implementation a placement plugs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from alignrl.algos.rollout_ops import concat_rollouts, group_rows, mixed_reward_groups, select_groups
from alignrl.config import RunConfig
from alignrl.core.advantages import ADVANTAGES
from alignrl.core.kl import AdaptiveKLController, FixedKLController, kl_penalty_rewards
from alignrl.core.lagrangian import LagrangeMultiplier, safe_advantages
from alignrl.core.losses import masked_mean
from alignrl.core.rollout_correction import truncated_is_weights
from alignrl.core.shaping import overlong_penalty
from alignrl.data.collate import per_token_in_chunks
from alignrl.data.records import Experience, Rollout, Sample
from alignrl.dist.env import SINGLE, DistEnv, all_reduce_sum, barrier, sum_over_ranks
from alignrl.models.logprobs import response_logprobs
from alignrl.models.value import ModelScorer
from alignrl.rollout.hf_engine import SamplingParams
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.critic import Critic
from alignrl.utils.tracking import console

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# Fraction of tokens (or sequences) whose rollout IS weight exceeded the threshold, named by what was done to it.
IS_OVER_THRESHOLD_KEY = {"truncate": "rollout/is_truncated_frac", "mask": "rollout/is_masked_frac"}

# Dynamic sampling's source of extra prompts: () -> (samples, prompt token ids), a fresh batch per call.
MorePrompts = Callable[[], tuple[Sequence[Sample], Sequence[Sequence[int]]]]


@dataclass
class Scored:
    rewards: torch.Tensor  # (B,) training reward (correctness + shaping)
    correct: torch.Tensor  # (B,) bool, full correctness reward earned
    costs: torch.Tensor | None = None  # (B,) safety cost (PPO-Lagrangian), None without one
    baseline: torch.Tensor | None = None  # (B,) reward of the row's prompt's greedy response (ReMax)
    token_rewards: torch.Tensor | None = None  # (B, R) with the KL penalty, when algorithm.use_kl_in_reward

    def token_level(self, mask: torch.Tensor) -> torch.Tensor:
        """Per-token rewards (B, R): the KL-penalised ones, or the outcome reward on the last token."""
        return self.token_rewards if self.token_rewards is not None else outcome_token_rewards(self.rewards, mask)

    def rows(self, idx: torch.Tensor) -> Scored:
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Scored(self.rewards[idx], self.correct[idx], pick(self.costs), pick(self.baseline))

    def cat(self, other: Scored) -> Scored:
        join = lambda a, b: None if a is None else torch.cat([a, b])  # noqa: E731
        return Scored(torch.cat([self.rewards, other.rewards]), torch.cat([self.correct, other.correct]),
                      join(self.costs, other.costs), join(self.baseline, other.baseline))


@dataclass
class CriticParts:
    """PPO's value model, and for PPO-Lagrangian a cost critic, cost function and multiplier."""

    critic: Critic
    cost_critic: Critic | None = None
    cost_fn: Callable | None = None  # a rule on the decoded response (reward-function signature)
    cost_model: ModelScorer | None = None  # or a cost model on the token ids
    lagrangian: LagrangeMultiplier | None = None


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards (B,) placed on each response's last real token -> (B, R)."""
    last = (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return last.to(rewards.dtype) * rewards[:, None]


# How each critic-free estimator is fed from one step's scores: (Scored, group (B,), response mask (B, R),
# algorithm config, sum over ranks) -> advantages (B,) or (B, R). Groups never span ranks (a prompt's n
# samples are drawn on one rank); batch-wide whitening sums its statistics over ranks.
OUTCOME_ESTIMATORS = {
    "grpo": lambda s, g, m, a, r: ADVANTAGES["grpo"](s.rewards, g, norm_by_std=a.norm_adv_by_std_in_grpo),
    "rloo": lambda s, g, m, a, r: ADVANTAGES["rloo"](s.rewards, g),
    "reinforce_plus_plus": lambda s, g, m, a, r: ADVANTAGES["reinforce_plus_plus"](s.token_level(m), m, sum_ranks=r),
    "reinforce_plus_plus_baseline": lambda s, g, m, a, r: ADVANTAGES["reinforce_plus_plus_baseline"](
        s.rewards, g, m, sum_ranks=r),
    # the per-row baseline already follows the row's prompt, so each row is its own "group" here
    "remax": lambda s, g, m, a, r: ADVANTAGES["remax"](s.rewards, torch.arange(len(g)), s.baseline),
}


@contextmanager
def _timed(timings: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    key = f"timing/{name}"  # accumulates: dynamic sampling generates and scores several times a step
    timings[key] = timings.get(key, 0.0) + (time.perf_counter() - t0)


def batched_logprobs(model, ro: Rollout, temperature: float, micro_batch: int) -> torch.Tensor:
    """Log-probs (B, R) of the rollout's responses under `model`, in length-grouped, trimmed chunks."""
    def logprobs(m, *tensors):
        return response_logprobs(m, *tensors, temperature)[0]

    return per_token_in_chunks(model, logprobs, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                               micro_batch)


class LocalRefScorer:
    """Reference log-probs from an in-process frozen model (the RefScorer interface; the HTTP one is
    `alignrl.rollout.remote.RemoteRefScorer`)."""

    def __init__(self, model, temperature: float, micro_batch: int):
        self.model, self.temperature, self.micro_batch = model, temperature, micro_batch

    def logprobs(self, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
        ro = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, response_mask.float(),
                     torch.zeros(len(prompt_ids), dtype=torch.bool), torch.arange(len(prompt_ids)))
        return batched_logprobs(self.model, ro, self.temperature, self.micro_batch)


class GRPOStep:
    """Holds the interfaces of one RL step; `run` executes the pipeline on a batch of prompts."""

    def __init__(self, cfg: RunConfig, engine, actor: Actor, ref, tokenizer, reward_fn, correct_fn,
                 critics: CriticParts | None = None, env: DistEnv = SINGLE, reward_model=None):
        """`ref`: a RefScorer (`.logprobs(prompt_ids, prompt_mask, response_ids, response_mask)`) or None;
        `reward_model`: a scorer (`.score(...)` -> (B,)) whose score replaces the rule reward, or None."""
        self.cfg, self.engine, self.actor, self.ref, self.env = cfg, engine, actor, ref, env
        self.reward_model = reward_model
        # colocated generation shares the actor's weights; anything else gets them pushed after each step
        self.colocated = getattr(engine, "model", None) is actor.model
        self.remote = hasattr(engine, "weight_version")  # a generation server: rank 0 pushes for everyone
        self.tokenizer, self.reward_fn, self.correct_fn, self.critics = tokenizer, reward_fn, correct_fn, critics
        a = cfg.actor
        alg = cfg.algorithm
        self.kl_ctrl = None
        if alg.use_kl_in_reward:
            self.kl_ctrl = (FixedKLController(alg.kl_coef) if alg.kl_ctrl_type == "fixed"
                            else AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon))
        self.spec = PolicyLossSpec(clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high,
                                   kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0,
                                   kl_type=KL_ALIASES.get(a.kl_loss_type, a.kl_loss_type),
                                   entropy_coeff=a.entropy_coeff, temperature=cfg.rollout.temperature,
                                   name=a.policy_loss, clip_c=a.clip_ratio_c or None, loss_agg=a.loss_agg_mode,
                                   max_len=float(cfg.rollout.max_new_tokens))

    def sampling_params(self, step: int, gen_round: int = 0) -> SamplingParams:
        """Round 0 is the step's first generation; dynamic sampling's extra rounds get their own seeds
        (offset far past any step count), so a resumed run draws the same samples."""
        r = self.cfg.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                              seed=self.cfg.trainer.seed * 1_000_003 + step + gen_round * 1_000_000_007
                              + self.env.rank * 7_919_000_003)  # ranks draw different samples

    def score(self, ro: Rollout, samples: Sequence[Sample]) -> Scored:
        """Task rewards plus the overlong penalty when configured; correctness is never shaped."""
        ids = ro.response_ids.masked_fill(~ro.response_mask, self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        rows = [samples[g] for g in ro.group.tolist()]
        rewards = [self.reward_fn(s.data_source, t, s.ground_truth, s.extra) for s, t in zip(rows, texts)]
        if self.correct_fn is self.reward_fn:  # no shaping: correctness is the reward itself
            correct = [r >= 1.0 for r in rewards]
        else:
            correct = [self.correct_fn(s.data_source, t, s.ground_truth, s.extra) >= 1.0 for s, t in zip(rows, texts)]
        out = (self.reward_model.score(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
               if self.reward_model is not None else torch.tensor(rewards, dtype=torch.float32))
        a = self.cfg.algorithm
        if a.overlong_buffer_len:
            out = out + overlong_penalty(ro.response_lengths, self.cfg.rollout.max_new_tokens,
                                         a.overlong_buffer_len, a.overlong_penalty_factor)
        costs, c = None, self.critics
        if c is not None and c.cost_fn is not None:
            costs = torch.tensor([float(c.cost_fn(s.data_source, t, s.ground_truth, s.extra))
                                  for s, t in zip(rows, texts)])
        elif c is not None and c.cost_model is not None:
            costs = c.cost_model.score(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
        baseline = self.greedy_baseline(ro, samples) if self.cfg.algorithm.adv_estimator == "remax" else None
        return Scored(out, torch.tensor(correct), costs, baseline)

    def greedy_baseline(self, ro: Rollout, samples: Sequence[Sample]) -> torch.Tensor:
        """ReMax's baseline: the task reward of each prompt's greedy response, per row (B,)."""
        first = torch.unique_consecutive(ro.group, return_counts=True)[1].cumsum(0) - 1  # a row of each group
        prompts = [ro.prompt_ids[i][ro.prompt_mask[i]].tolist() for i in first.tolist()]
        greedy = self.engine.generate(prompts, SamplingParams(n=1, temperature=0.0,
                                                              max_new_tokens=self.cfg.rollout.max_new_tokens))
        ids = greedy.response_ids.masked_fill(~greedy.response_mask, self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        per_group = torch.tensor([float(self.reward_fn(samples[g].data_source, t, samples[g].ground_truth,
                                                       samples[g].extra))
                                  for g, t in zip(ro.group[first].tolist(), texts)])
        return per_group[ro.group]

    def dynamic_sample(self, step: int, ro: Rollout, scored: Scored, more_prompts: MorePrompts | None,
                       timings: dict[str, float]) -> tuple[Rollout, Scored, dict[str, float]]:
        """DAPO dynamic sampling (Yu et al. 2025): keep the groups whose rewards differ, generate and
        score more prompts (up to algorithm.max_gen_rounds extra rounds, only if `more_prompts` is
        given) until data.train_batch_size groups are kept, then keep exactly that many (the earliest)
        or, still short, all of them."""
        want, pad = self.cfg.data.train_batch_size, self.tokenizer.pad_token_id
        ro, scored = _keep_groups(ro, scored, mixed_reward_groups(scored.rewards, ro.group))
        rounds = 1
        while (_n_groups(ro) < want and rounds <= self.cfg.algorithm.max_gen_rounds
               and more_prompts is not None):
            samples, prompts = more_prompts()
            with _timed(timings, "gen"):
                new = self.engine.generate(prompts, self.sampling_params(step, rounds))
            with _timed(timings, "reward"):
                new_scored = self.score(new, samples)
            new, new_scored = _keep_groups(new, new_scored, mixed_reward_groups(new_scored.rewards, new.group))
            ro, scored = concat_rollouts(ro, new, pad), scored.cat(new_scored)
            rounds += 1
        kept = min(_n_groups(ro), want)
        if kept < want:
            console.print(f"step {step}: dynamic sampling kept {kept} of {want} groups after {rounds} "
                          "generation round(s); training on those")
        ro, scored = _keep_groups(ro, scored, torch.arange(kept))
        return ro, scored, {"dapo/kept_groups": float(kept), "dapo/gen_rounds": float(rounds)}

    def rollout_correction(self, old_lp: torch.Tensor, ro: Rollout, loss_mask: torch.Tensor
                           ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Truncated-IS weights pi_trainer / pi_rollout for the policy loss (None when disabled)."""
        a = self.cfg.algorithm
        if a.rollout_is == "none":
            return None, {}
        w, m = truncated_is_weights(old_lp, ro.logprobs, loss_mask, a.rollout_is, a.rollout_is_threshold,
                                    a.rollout_is_mode)
        return w, {"rollout/is_weight_mean": m["rollout_corr/is_weight_mean"],
                   "rollout/is_raw_weight_max": m["rollout_corr/raw_is_weight_max"],
                   IS_OVER_THRESHOLD_KEY[a.rollout_is_mode]: m["rollout_corr/over_threshold_frac"]}

    def run(self, step: int, samples: Sequence[Sample], prompts: Sequence[Sequence[int]], *,
            more_prompts: MorePrompts | None = None) -> dict[str, float]:
        """One RL step on `prompts` (token ids, aligned with `samples`).

        `more_prompts`, used only with algorithm.dynamic_sampling, is called once per extra
        generation round and returns a fresh batch `(samples, prompts)` like the first: in the
        runner, `idx = sampler.next()` then `([train[i] for i in idx], [train_prompts[i] for i in idx])`.
        Drawing from the checkpointed sampler keeps resumed runs exact. Without it dynamic sampling
        only filters the first batch.

        Reward and length metrics describe the first batch, as drawn, whatever dynamic sampling keeps.
        """
        cfg, t = self.cfg, {}
        t_start = time.perf_counter()
        micro = cfg.actor.ppo_micro_batch_size
        with _timed(t, "gen"):
            ro = self.engine.generate(prompts, self.sampling_params(step))
        with _timed(t, "reward"):
            scored = self.score(ro, samples)
        metrics = self._metrics(ro, scored)
        if cfg.algorithm.dynamic_sampling:
            ro, scored, dapo = self.dynamic_sample(step, ro, scored, more_prompts, t)
            metrics.update(dapo)
            if len(ro.group) == 0:  # every group had equal rewards: nothing to learn from this step
                t["timing/step"] = time.perf_counter() - t_start
                return {**metrics, **t}
        with _timed(t, "ref"):
            ref_lp = (self.ref.logprobs(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)
                      if self.spec.kl_coef > 0 or self.kl_ctrl is not None else None)
        with _timed(t, "old_logprob"):
            old_lp = (batched_logprobs(self.actor.model, ro, cfg.rollout.temperature, micro)
                      if cfg.actor.recompute_old_logprobs else ro.logprobs)
        if self.kl_ctrl is not None:  # KL in the reward: per-token penalty, then the estimators see it
            mask = ro.response_mask.float()
            alias = KL_ALIASES.get(cfg.algorithm.kl_penalty, cfg.algorithm.kl_penalty)
            token_rewards, kl_metrics = kl_penalty_rewards(outcome_token_rewards(scored.rewards, mask), old_lp,
                                                           ref_lp, mask, self.kl_ctrl.value, alias)
            scored = Scored(token_rewards.sum(-1), scored.correct, scored.costs, scored.baseline, token_rewards)
            # every rank must hold the same coefficient: update it from the global mean KL
            kl_sum, n_rows = all_reduce_sum(self.env, [kl_metrics["actor/reward_kl_penalty"] * len(ro.group),
                                                       float(len(ro.group))])
            self.kl_ctrl.update(kl_sum / n_rows, int(n_rows))
            metrics.update(kl_metrics)
        value_targets: list = []
        if self.critics is None:
            adv = OUTCOME_ESTIMATORS[cfg.algorithm.adv_estimator](scored, ro.group, ro.response_mask.float(),
                                                                  cfg.algorithm, sum_over_ranks(self.env))
        else:
            with _timed(t, "values"):
                adv, value_targets, critic_metrics = self.critic_advantages(ro, scored, micro)
            metrics.update(critic_metrics)
        # truncated responses keep their place in the group baseline above, but get no gradient
        loss_mask = (ro.response_mask & ~ro.truncated[:, None] if cfg.algorithm.mask_truncated
                     else ro.response_mask)
        is_weight, is_metrics = self.rollout_correction(old_lp, ro, loss_mask)
        exp = Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, loss_mask, old_lp, ref_lp, adv, is_weight)
        # this rank's share of each mini-batch (the batch sizes are checked to divide by the world size)
        mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // self.env.world_size
        epochs = cfg.actor.ppo_epochs
        train_metrics = {}
        with _timed(t, "critic"):
            for critic, old_values, returns in value_targets:
                gen = torch.Generator().manual_seed(cfg.trainer.seed * 7907 + step)
                train_metrics.update(critic.update(exp, old_values, returns, mini, micro, epochs, gen))
        with _timed(t, "train"):
            if step > cfg.critic.warmup_steps:  # PPO critic warm-up: the actor waits for useful values
                gen = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + step)
                train_metrics.update(self.actor.update(exp, self.spec, mini, micro, epochs, gen))
        if scored.costs is not None:
            cost_sum, n_rows = all_reduce_sum(self.env, [float(scored.costs.sum()), float(len(scored.costs))])
            metrics["safety/lambda"] = self.critics.lagrangian.update(cost_sum / n_rows)
        with _timed(t, "sync"):
            if not self.colocated:  # generation holds its own copy (local full copy or a server): refresh it
                self.push_weights()
        t["timing/step"] = time.perf_counter() - t_start
        # KL(rollout || trainer) per token (k1 under rollout samples): engine/trainer mismatch
        metrics["rollout/kl_vs_trainer"] = float(masked_mean(ro.logprobs - old_lp, ro.response_mask.float()))
        return {**metrics, **is_metrics, **train_metrics, **t,
                "perf/tokens_per_s": float(ro.prompt_mask.sum() + ro.response_mask.sum()) / t["timing/step"]}

    def push_weights(self) -> None:
        """Collective. The actor's full weights to the rollout engine: every rank's local copy, or the
        generation server once (rank 0). Parameters only, by their unique names (no tied aliases)."""
        full = self.actor.engine.full_state_dict()
        names = {n for n, _ in self.actor.model.named_parameters()}
        if self.env.is_main or not self.remote:
            self.engine.load_weights([(k, v) for k, v in full.items() if k in names])
        barrier(self.env)

    def critic_advantages(self, ro: Rollout, scored: Scored, micro: int
                          ) -> tuple[torch.Tensor, list, dict[str, float]]:
        """GAE advantages (B, R) from the critic's values (PPO); with a cost critic, the PPO-Lagrangian
        combination (A_r - lambda A_c) / (1 + lambda). Also returns (critic, old values, returns) to train."""
        c, a = self.critics, self.cfg.algorithm
        mask = ro.response_mask.float()
        values = c.critic.values(ro, micro)
        total = sum_over_ranks(self.env)
        adv, returns = ADVANTAGES["gae"](scored.token_level(mask), values, mask, a.gamma, a.lam, whiten=True,
                                         sum_ranks=total)
        targets = [(c.critic, values, returns)]
        metrics = {"critic/values_mean": float(masked_mean(values, mask)),
                   "critic/returns_mean": float(masked_mean(returns, mask))}
        if c.cost_critic is not None:
            cost_values = c.cost_critic.values(ro, micro)
            cost_adv, cost_returns = ADVANTAGES["gae"](outcome_token_rewards(scored.costs, mask), cost_values, mask,
                                                       a.gamma, a.lam, whiten=True, sum_ranks=total)
            adv = safe_advantages(adv, cost_adv, c.lagrangian.value)
            targets.append((c.cost_critic, cost_values, cost_returns))
            metrics["safety/cost_mean"] = float(scored.costs.mean())
        return adv, targets, metrics

    @staticmethod
    def _metrics(ro: Rollout, scored: Scored) -> dict[str, float]:
        lengths = ro.response_lengths.float()
        return {
            "reward/mean": float(scored.rewards.mean()),
            "reward/std": float(scored.rewards.std()) if len(scored.rewards) > 1 else 0.0,
            "reward/accuracy": float(scored.correct.float().mean()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(ro.truncated.float().mean()),
        }


def _n_groups(ro: Rollout) -> int:
    return int(ro.group.max()) + 1 if len(ro.group) else 0


def _keep_groups(ro: Rollout, scored: Scored, keep: torch.Tensor) -> tuple[Rollout, Scored]:
    rows = group_rows(ro.group, keep)
    return select_groups(ro, keep), scored.rows(rows)
