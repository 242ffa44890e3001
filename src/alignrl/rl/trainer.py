"""The trainer side of the RL loop: a ScoredBatch -> old log-probs -> (KL in the reward) -> (the Lagrange
multiplier) -> advantages -> critic and policy updates -> new weights published.

Whatever produced the batch (this process, torchrun ranks, HTTP services, ZeroMQ samplers), this is
the one place the learning happens. Orchestration only: the math lives in `alignrl.core`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from alignrl.rl.producer import batched_logprobs, timed
from alignrl.config import RunConfig
from alignrl.config.schema import PAIR_ESTIMATORS
from alignrl.config.checks import response_cap
from alignrl.core.advantages import ADVANTAGES, OutcomeInputs, gae_advantages, outcome_token_rewards, whiten_by
from alignrl.core.kl import AdaptiveKLController, FixedKLController, kl_penalty_rewards
from alignrl.core.lagrangian import LagrangeMultiplier, safe_gae_advantages
from alignrl.core.losses import masked_mean
from alignrl.core.nash_md import MixtureInputs, nash_md_advantages
from alignrl.core.online_dpo import PairInputs, online_dpo_advantages, pair_rows
from alignrl.core.rollout_correction import rollout_kl, truncated_is_weights
from alignrl.config.rollout_rs import rs_options
from alignrl.core.rollout_rejection import (batch_normalized, divergence_rejection_mask, rejection_mask, token_veto,
                                            weight_sums)
from alignrl.core.sequence_weights import sampling_gap
from alignrl.core.shaping import clip_outcome
from alignrl.data.records import Experience, Rollout, ScoredBatch
from alignrl.runtime.env import SINGLE, DistEnv, all_reduce_sum, gather_values, sum_over_ranks
from alignrl.interfaces import WeightSink
from alignrl.train.actor import Actor, PolicyLossSpec
from alignrl.train.critic import Critic
from alignrl.train.engines.base import TrainingDiverged
from alignrl.train.minibatch import SKIPPED, TokenBudget, optimizer_steps
from alignrl.utils.tracking import console


@dataclass
class CriticParts:
    """PPO's value model, and for PPO-Lagrangian a cost critic and the multiplier."""

    critic: Critic
    cost_critic: Critic | None = None
    lagrangian: LagrangeMultiplier | None = None


def behaviour_logprobs(ro: Rollout, old_lp: torch.Tensor) -> torch.Tensor:
    """The rollout's log-probs (B, R), with the trainer's own on tokens no policy sampled (tool
    observations): those weigh 1 in rollout correction and add nothing to the mismatch KL."""
    return ro.logprobs if ro.loss_mask is None else torch.where(ro.loss_mask, ro.logprobs, old_lp)


def estimator_mask(mask: torch.Tensor, given: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The mask (B, R) float a critic-free estimator reads: `mask` less the tokens rollout correction rejected (`given`:
    the bool mask it decided on; `kept`: what it left). verl rejects before its estimators, on the response mask they
    all read, so OPO's length weights and the whitening estimators' statistics count the kept tokens alone; a truncated
    response (taken out of the loss by algorithm.mask_truncated, not rejected) keeps its length."""
    return mask * ~(given & ~kept)


# the estimators that read each response token's sum of squared probabilities from the trainer's forward
TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")


# the policy terms whose objective fixes how they aggregate: GSPO's and SAPO's average sequences (Zheng et al., Gao
# et al. 2025; verl too), LUSPO's weighs each sequence by its length
FIXED_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "luspo": "seq-mean-token-sum"}


def policy_loss_spec(cfg: RunConfig) -> PolicyLossSpec:
    a = cfg.actor
    agg = FIXED_AGG.get(a.policy_loss, "token-mean") if a.loss_agg_mode == "auto" else a.loss_agg_mode
    spec = PolicyLossSpec(clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high,
                          kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0,
                          kl_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
                          temperature=cfg.logprob_temperature, name=a.policy_loss, clip_c=a.clip_ratio_c or None,
                          loss_agg=agg, max_len=float(response_cap(cfg)),
                          # these aggregate as their objective says whatever loss_agg_mode says, which then
                          # aggregates the KL and entropy terms only (verl's GSPO and SAPO losses do so)
                          policy_agg=FIXED_AGG.get(a.policy_loss),
                          clip_cov=(a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub),
                          kl_cov=(a.kl_cov_ratio, a.ppo_kl_coef), sapo=(a.tau_pos, a.tau_neg),
                          delta=a.clip_ratio_delta, kl_ratio_weighted=a.kl_loss_ratio_weighted,
                          top_entropy=a.top_entropy_quantile, off_policy=a.off_policy_mask_threshold,
                          vespo=(a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg))
    if cfg.algorithm.adv_estimator in PAIR_ESTIMATORS:  # -A log pi summed per answer: the DPO gradient (online_dpo)
        return replace(spec, name="gpg", loss_agg="seq-mean-token-sum", policy_agg=None)
    return spec


class PolicyTrainer:
    """Learns from scored batches; `version` counts the weight publishes (the updates done)."""

    def __init__(self, cfg: RunConfig, actor: Actor, sink: WeightSink, critics: CriticParts | None = None,
                 env: DistEnv = SINGLE):
        self.cfg, self.actor, self.sink, self.critics, self.env = cfg, actor, sink, critics, env
        alg = cfg.algorithm
        self.kl_ctrl = None
        if alg.use_kl_in_reward:
            self.kl_ctrl = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
                            if alg.kl_ctrl_type == "adaptive" else FixedKLController(alg.kl_coef))
        self.spec = policy_loss_spec(cfg)
        self.rs_options = rs_options(alg.rollout_rs, alg.rollout_rs_threshold)  # verl's divergence filters, or None
        self.version = 0
        self.nonfinite_streak = 0  # RL steps in a row whose every optimizer step was skipped as non-finite

    def state_dict(self) -> dict:
        return {"version": self.version, "nonfinite_streak": self.nonfinite_streak,
                "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl else None,
                "lagrangian": self.critics.lagrangian.state_dict() if self.critics and self.critics.lagrangian
                else None}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        self.nonfinite_streak = int(state["nonfinite_streak"])  # a resumed run keeps counting
        if self.kl_ctrl is not None:
            self.kl_ctrl.load_state_dict(state.get("kl_ctrl"))  # None: the penalty is new at this resume
        if self.critics is not None and self.critics.lagrangian is not None and state.get("lagrangian") is not None:
            self.critics.lagrangian.load_state_dict(state["lagrangian"])

    def train(self, step: int, batch: ScoredBatch) -> dict[str, float]:
        """One update on `batch` (this rank's share under data parallelism), then the new weights go to
        the sink. An empty batch (dynamic sampling kept nothing) trains nothing and publishes nothing."""
        if len(batch) == 0:
            return {}
        cfg, t, metrics = self.cfg, {}, {}
        ro, scores, micro = batch.rollout, batch.scores, cfg.actor.forward_micro_batch
        with timed(t, "old_logprob"):
            old_lp, policy = self.old_logprobs(ro, micro)
        mask = batch.loss_mask.float()
        # --reward_clip_range as OpenRLHF: the reward clamped before the KL penalty; a group-shaped one (its rloo,
        # group_norm, ...) after the shaping, inside the estimator
        clip, shaped = cfg.algorithm.reward_clip, cfg.algorithm.outcome_baseline != "none" and self.critics is None
        outcome, baseline = clip_outcome(scores.rewards, scores.baseline, None if shaped else clip)
        token_rewards = outcome_token_rewards(outcome, mask)
        rewards, kl_tokens = outcome, None
        if self.kl_ctrl is not None:  # KL in the reward: per-token penalty, then the estimators see it
            penalized, kl_metrics = self.kl_in_reward(token_rewards, old_lp, batch.ref_logprobs, mask)
            token_rewards, kl_tokens = penalized, penalized - token_rewards
            rewards = token_rewards.sum(-1)
            metrics.update(kl_metrics)
        if scores.costs is not None:  # lambda from this batch's costs first, as Safe RLHF's step does
            costs = gather_values(self.env, scores.costs.tolist())
            metrics["safety/lambda"] = self.critics.lagrangian.update(step, costs)
        # truncated responses keep their place in the group baseline below, but get no gradient
        given = batch.loss_mask & ~ro.truncated[:, None] if cfg.algorithm.mask_truncated else batch.loss_mask
        rollout_lp = behaviour_logprobs(ro, old_lp)
        # ahead of the advantages, as verl's: the estimators count the tokens rejection sampling keeps
        is_weight, loss_mask, is_metrics = self.rollout_correction(old_lp, rollout_lp, given)
        value_targets: list = []
        kept = estimator_mask(mask, given, loss_mask)  # the outcome stays where `mask` put it (reward_mask)
        if cfg.algorithm.adv_estimator in PAIR_ESTIMATORS:
            adv, pair_metrics = self.pair_advantages(outcome, ro.group, old_lp, batch.ref_logprobs, kept)
            metrics.update(pair_metrics)
        elif self.critics is None:
            a = cfg.algorithm
            adv = ADVANTAGES[a.adv_estimator](OutcomeInputs(
                rewards, token_rewards, kept, ro.group, baseline,
                a.norm_adv_by_std_in_grpo, a.gamma, sum_over_ranks(self.env), outcome, a.outcome_baseline,
                a.whiten_advantages, tuple(clip) if shaped else (), a.grpo_std_scope, is_weights=is_weight,
                reward_mask=mask, **policy))
        else:
            with timed(t, "values"):
                adv, value_targets, critic_metrics = self.critic_advantages(batch, token_rewards, kl_tokens, micro,
                                                                            kept)
            metrics.update(critic_metrics)
        # the forward attends to tool observations that the loss leaves out (state masking)
        attention = None if torch.equal(batch.loss_mask, ro.response_mask) else ro.response_mask
        exp = Experience(ro.prompt_ids, ro.prompt_mask, ro.response_ids, loss_mask, old_lp, batch.ref_logprobs, adv,
                         is_weight, attention, images=ro.images)
        # the off-policy mask reads the rollout engine's log-probs, as TRL reads vLLM's: their gap to old_lp per row
        gap = None if self.spec.off_policy is None else sampling_gap(rollout_lp, old_lp, loss_mask)
        metrics.update(self.update(step, exp, value_targets, t, gap))  # raises TrainingDiverged: nothing is published
        with timed(t, "sync"):
            self.version += 1
            self.sink.publish(self.version)
        # KL(rollout || trainer) per token (k1 under rollout samples): engine/trainer mismatch
        sampled = ro.generated_mask  # the policy's own answers: under xpo and nash_md each pair's first only
        if cfg.algorithm.adv_estimator in ("xpo", "nash_md"):
            own = torch.zeros(len(ro.group), dtype=torch.bool)
            own[pair_rows(ro.group)[0]] = True
            sampled = sampled & own[:, None].to(sampled.device)
        if cfg.algorithm.adv_estimator != "spin":  # SPIN's answers are targets and the opponent's: none the policy's
            metrics["rollout/kl_vs_trainer"] = float(rollout_kl(rollout_lp, old_lp, sampled, "k1"))
        return {**metrics, **is_metrics, **t}

    def old_logprobs(self, ro: Rollout, micro: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The old log-probs the policy loss reads (B, R): the trainer's forward, or the rollout's own with
        actor.recompute_old_logprobs=false; and for the optimal token baselines (log-probs, sums of squared
        probabilities) of the trainer's forward, which then runs either way (verl's actor computes both in its
        old-log-prob pass), as OutcomeInputs fields; else none."""
        cfg = self.cfg
        args = (self.actor.model, ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask,
                cfg.logprob_temperature, micro, self.actor.layout, ro.images)
        if cfg.algorithm.adv_estimator in TOKEN_BASELINES:
            own, sum_pi_squared = batched_logprobs(*args, with_sum_pi_squared=True)
            policy = {"logprobs": own, "sum_pi_squared": sum_pi_squared}
            return own if cfg.actor.recompute_old_logprobs else ro.logprobs, policy
        return batched_logprobs(*args) if cfg.actor.recompute_old_logprobs else ro.logprobs, {}

    def update(self, step: int, exp: Experience, value_targets: list, t: dict[str, float],
               gap: torch.Tensor | None = None) -> dict[str, float]:
        cfg = self.cfg
        # this rank's share of each mini-batch (the batch sizes are checked to divide by the world size)
        mini = cfg.mini_batch_sequences // self.env.world_size
        a = cfg.actor
        micro = TokenBudget(a.ppo_max_token_len) if a.use_dynamic_bsz else a.ppo_micro_batch_size
        epochs, out = a.ppo_epochs, {}
        with timed(t, "critic"):
            for critic, old_values, returns in value_targets:
                gen = torch.Generator().manual_seed(cfg.trainer.seed * 7907 + step)
                out.update(critic.update(exp, old_values, returns, mini, micro, epochs, gen))
        actor_trains = step > cfg.critic.warmup_steps  # PPO critic warm-up: the actor waits for useful values
        with timed(t, "train"):
            if actor_trains:
                gen = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + step)
                out.update(self.actor.update(exp, self.spec, mini, micro, epochs, gen, step=step, gap=gap))
        taken = (len(value_targets) + actor_trains) * optimizer_steps(len(exp), mini, epochs)
        self.check_finite(step, sum(v for k, v in out.items() if k.endswith("/" + SKIPPED)), taken)
        return out

    def check_finite(self, step: int, skipped: float, taken: int) -> None:
        """Counts the RL steps in a row whose `taken` optimizer steps were all skipped as non-finite, and
        stops the run after trainer.max_nonfinite_updates of them: the weights no longer change, and the
        cause (NaN advantages, a diverged model) does not go away by itself. Every rank skips the same
        steps, so every rank stops together."""
        if taken == 0:
            return
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped >= taken else 0
        limit = self.cfg.trainer.max_nonfinite_updates
        if skipped and self.env.is_main and self.nonfinite_streak < limit:  # else only a metric said so
            console.print(f"step {step}: {skipped:g} of {taken} optimizer step(s) skipped: a non-finite loss or "
                          f"gradient norm ({self.nonfinite_streak} RL step(s) in a row wholly skipped; the run "
                          f"stops at trainer.max_nonfinite_updates={limit})", markup=False, highlight=False)
        if skipped >= taken and self.nonfinite_streak >= limit:
            raise TrainingDiverged(
                f"training stopped at step {step}: every update of the last {self.nonfinite_streak} RL step(s) "
                "had a non-finite loss or gradient norm and was skipped; check the rewards and the metrics in "
                "logs/metrics.jsonl, lower actor.lr, or raise trainer.max_nonfinite_updates")

    def kl_in_reward(self, token_rewards: torch.Tensor, old_lp: torch.Tensor, ref_lp: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        token_rewards, kl_metrics = kl_penalty_rewards(token_rewards, old_lp, ref_lp, mask, self.kl_ctrl.value,
                                                       self.cfg.algorithm.kl_penalty)
        # every rank must hold the same coefficient: update it from the global mean KL
        rows = float(len(token_rewards))
        kl_sum, n_rows = all_reduce_sum(self.env, [kl_metrics["actor/reward_kl_penalty"] * rows, rows])
        self.kl_ctrl.update(kl_sum / n_rows, int(n_rows))
        return token_rewards, kl_metrics

    def rollout_correction(self, old_lp: torch.Tensor, rollout_lp: torch.Tensor, loss_mask: torch.Tensor
                           ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """Truncated-IS weights pi_trainer / pi_rollout for the policy loss (None when disabled), normalised to mean
        1 over the global batch if asked; and the loss mask left once mode=mask, rejection sampling (rollout_rs) and
        the veto have taken out what they reject, in verl's order (IS, its normalisation, RS, veto)."""
        a, weights, metrics, given = self.cfg.algorithm, None, {}, loss_mask  # each decides on the mask given, as verl
        if a.rollout_is != "none":
            weights, loss_mask, metrics = truncated_is_weights(old_lp, rollout_lp, loss_mask, a.rollout_is,
                                                               a.rollout_is_threshold, a.rollout_is_mode,
                                                               a.rollout_is_threshold_lower)
            if a.rollout_is_batch_normalize:  # the global batch's mean, as verl's driver takes it over the whole batch
                total, count = all_reduce_sum(self.env, list(weight_sums(weights, loss_mask, a.rollout_is)))
                weights, norm = batch_normalized(weights, total, count)
                metrics |= norm
        if self.rs_options is not None:  # current verl's divergence filters
            keep, rs = divergence_rejection_mask(old_lp, rollout_lp, given, self.rs_options)
            loss_mask, metrics = loss_mask & keep, metrics | rs
        elif a.rollout_rs != "none":
            upper = a.rollout_is_threshold if a.rollout_rs_threshold is None else a.rollout_rs_threshold
            keep, rs = rejection_mask(old_lp, rollout_lp, given, a.rollout_rs, upper, a.rollout_rs_threshold_lower)
            loss_mask, metrics = loss_mask & keep, metrics | rs
        if a.rollout_token_veto_threshold is not None:
            keep, veto = token_veto(old_lp, rollout_lp, given, a.rollout_token_veto_threshold)
            loss_mask, metrics = loss_mask & keep, metrics | veto
        if weights is not None:
            weights = weights * loss_mask  # 0 where rejected, as truncated_is_weights leaves them
        return weights, loss_mask, metrics

    def pair_advantages(self, rewards: torch.Tensor, group: torch.Tensor, old_lp: torch.Tensor,
                        ref_lp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Online DPO's (XPO's) advantages (B,): each prompt's two answers a pair, weighed by the DPO loss's gradient
        at the trainer's log-probs summed over the trained tokens; Nash-MD's (B, R), the policy's answers only."""
        a = self.cfg.algorithm
        if a.adv_estimator == "nash_md":  # token advantages on the policy's answers, from the pairs' rewards
            adv, metrics = nash_md_advantages(MixtureInputs(rewards, group, old_lp, ref_lp, mask), a.dpo_beta)
        else:
            pairs = PairInputs(rewards, group, (old_lp * mask).sum(-1), (ref_lp.to(old_lp.device) * mask).sum(-1))
            adv, metrics = online_dpo_advantages(pairs, a.dpo_beta, a.dpo_loss_type,
                                                 a.xpo_alpha if a.adv_estimator == "xpo" else None,
                                                 first_chosen=a.adv_estimator == "spin")
        # the loss averages over the answers with a trained token (over every rank); the advantages assume all 2P
        counts, total = torch.tensor([float((mask.sum(-1) > 0).sum()), float(len(mask))]), sum_over_ranks(self.env)
        trained, rows = counts if total is None else total(counts)
        return adv * (trained / rows).to(adv.dtype), metrics

    def critic_advantages(self, batch: ScoredBatch, token_rewards: torch.Tensor, kl_tokens: torch.Tensor | None,
                          micro: int, mask: torch.Tensor) -> tuple[torch.Tensor, list, dict[str, float]]:
        """GAE advantages (B, R) from the critic's values (PPO); with a cost critic, the PPO-Lagrangian
        combination (A_r - lambda A_c) / (1 + lambda). Also returns (critic, old values, returns) to train.
        `kl_tokens`: the KL penalty in `token_rewards`, which PPO-Lagrangian also takes out of the cost. `mask`: the
        tokens rejection kept (estimator_mask), which GAE runs over and whitens on, as verl's; the costs sit where the
        rewards do, on each response's last token."""
        c, a, ro = self.critics, self.cfg.algorithm, batch.rollout
        values = c.critic.values(ro, micro)
        total = sum_over_ranks(self.env)
        if c.cost_critic is None:
            adv, returns = gae_advantages(token_rewards, values, mask, a.gamma, a.lam)
            targets, metrics = [(c.critic, values, returns)], {}
        else:
            costs, cost_values = batch.scores.costs, c.cost_critic.values(ro, micro)
            cost_tokens = outcome_token_rewards(costs, batch.loss_mask.float())
            adv, returns, cost_returns = safe_gae_advantages(
                token_rewards, cost_tokens, kl_tokens, values, cost_values, mask, c.lagrangian.value, a.gamma, a.lam,
                whiten=False)
            targets = [(c.critic, values, returns), (c.cost_critic, cost_values, cost_returns)]
            metrics = {"safety/cost_mean": float(costs.mean())}
        metrics |= {"critic/values_mean": float(masked_mean(values, mask)),
                    "critic/returns_mean": float(masked_mean(returns, mask))}
        return whiten_by(adv, mask, a.whiten_advantages, total), targets, metrics

