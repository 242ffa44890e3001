"""The policy loss and the actor: the trainable policy on a training engine, updated with the PPO
mini-batch loop of `train.minibatch` (token-mean over the whole mini-batch, so accumulation gives
exactly the mini-batch gradient whatever the micro-batch size)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch

from alignrl.config.schema import CLIP_C_LOSSES
from alignrl.core.entropy import high_entropy_mask
from alignrl.core.losses import KL_ESTIMATORS, POLICY_LOSSES, aggregate_loss, ratio_weighted_kl
from alignrl.core.sequence_weights import masked_share, off_policy_keep
from alignrl.data.records import Experience
from alignrl.models.logprobs import ForwardLayout, response_logprobs
from alignrl.models.vision import encoder_in_every_forward
from alignrl.runtime.env import DistEnv, gather_tensor
from alignrl.runtime.lanes import lane_count
from alignrl.train.minibatch import TokenBudget, minibatch_updates
from alignrl.train.ema import PolicyAverage
from alignrl.train.ptx import PretrainMix, language_model_loss
from alignrl.interfaces import TrainEngine


@dataclass(frozen=True)
class PolicyLossSpec:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # 0 disables the KL term
    kl_type: str = "k3"
    entropy_coeff: float = 0.0
    temperature: float = 1.0
    name: str = "ppo_clip"  # a key of POLICY_LOSSES
    clip_c: float | None = None  # dual-clip constant (> 1), PPO only
    loss_agg: str = "token-mean"  # a key of LOSS_AGGREGATIONS
    policy_agg: str | None = None  # the policy term's own, where its loss fixes it (GSPO, SAPO); None: loss_agg
    max_len: float | None = None  # the constant of seq-mean-token-sum-norm (max response length)
    clip_cov: tuple[float, float, float] = (2e-4, 1.0, 5.0)  # clip_cov's share of tokens and covariance bounds
    kl_cov: tuple[float, float] = (2e-4, 1.0)  # kl_cov's share of tokens and penalty weight
    sapo: tuple[float, float] = (1.0, 1.05)  # sapo's temperatures (positive advantages, the others)
    delta: float | None = None  # two-sided clipping's cap on the unclipped ratio (ppo_clip, gspo); None: off
    kl_ratio_weighted: bool = False  # the KL term's estimate times pi / pi_old (TRL's use_bias_correction_kl)
    top_entropy: float = 1.0  # the policy term on the top share of each micro-batch's token entropies; 1: every token
    off_policy: float | None = None  # the off-policy sequence mask's threshold (DeepSeek-V3.2's); None: off
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # vespo's k, lambda (A >= 0), k, lambda (A < 0)


def loss_options(spec: PolicyLossSpec, generator: torch.Generator | None) -> dict:
    """The keywords of `spec.name`'s loss beyond the common call (`core.losses`)."""
    if spec.delta is not None:  # the config allows it with ppo_clip, gspo and luspo only
        return {"delta": spec.delta} | ({"clip_c": spec.clip_c} if spec.name in CLIP_C_LOSSES else {})
    if spec.name in CLIP_C_LOSSES:
        return {"clip_c": spec.clip_c}
    if spec.name == "clip_cov":
        ratio, low, high = spec.clip_cov
        return {"cov_ratio": ratio, "cov_lb": low, "cov_ub": high, "generator": generator}
    if spec.name == "kl_cov":
        return {"cov_ratio": spec.kl_cov[0], "kl_coef": spec.kl_cov[1]}
    if spec.name == "sapo":
        return {"tau_pos": spec.sapo[0], "tau_neg": spec.sapo[1]}
    if spec.name == "vespo":
        return {"shape_rate": spec.vespo}
    return {}


def token_draws(generator: torch.Generator):
    """clip_cov's draws of tokens: a generator per micro-batch, seeded by one draw of the update's generator, the
    micro-batch's rows and how often these rows were drawn before in this update, so micro-batches run side by side
    (lanes) draw as one after the other, and the same rows in a later PPO epoch draw afresh (as verl's global
    generator does)."""
    base = int(torch.randint(2**31, (1,), generator=generator))
    seen: Counter = Counter()
    lock = threading.Lock()  # lanes draw from threads

    def draw(rows: torch.Tensor) -> torch.Generator:
        key = tuple(rows.tolist())
        with lock:
            again, seen[key] = seen[key], seen[key] + 1
        return torch.Generator().manual_seed((base * 1_000_003 + hash(key) % 2**31 + again * 7_919) % 2**62)

    return draw


def entropy_kept(entropy: torch.Tensor | None, mask: torch.Tensor, spec: PolicyLossSpec, env: DistEnv | None
                 ) -> torch.Tensor | None:
    """With spec.top_entropy < 1: 1 on the tokens whose entropy is in the top share of the micro-batch's, the
    threshold taken over every rank's micro-batch (as TRL gathers it), 0 elsewhere; None: every token trains."""
    if spec.top_entropy >= 1.0 or entropy is None:
        return None
    # every rank runs as many micro-batches (train.minibatch), so each gathers with the others
    gather = partial(gather_tensor, env) if env is not None and env.distributed else None
    return high_entropy_mask(entropy, mask, spec.top_entropy, gather).to(mask.dtype)


def _times(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else b if a is None else a * b


def policy_weights(logp, entropy, exp: Experience, spec: PolicyLossSpec, env: DistEnv | None,
                   gap: torch.Tensor | None) -> tuple[torch.Tensor | None, dict, dict[str, float]]:
    """The per-token weight of the policy term (rollout correction, the high-entropy tokens, the off-policy sequence
    mask; None: all 1), the loss's own keywords for them, and their metrics. The masks multiply the per-token loss,
    their left-out tokens still counting in its denominator, as TRL's; vespo takes the rollout-correction weights
    into its sequence weight instead (TRL's vLLM IS ratio). `gap` (B,): `sequence_weights.sampling_gap`'s rows."""
    mask = exp.response_mask.to(logp.dtype)
    kept, keep, metrics = entropy_kept(entropy, mask, spec, env), None, {}
    if kept is not None:
        metrics["actor/entropy_kept_frac"] = float(kept.sum()) / max(1.0, float(mask.sum()))
    if spec.off_policy is not None:
        keep = off_policy_keep(logp, exp.old_logprobs, exp.advantages, mask, spec.off_policy, gap)
        metrics["actor/off_policy_masked_frac"] = masked_share(keep, mask)
        keep = keep.expand_as(mask)
    masks = _times(kept, keep)
    if spec.name == "vespo":
        return masks, {"sampling_weight": exp.is_weight}, metrics
    return _times(exp.is_weight, masks), {}, metrics


def policy_loss(logp, entropy, exp: Experience, spec: PolicyLossSpec, global_tokens: float, global_seqs: float,
                generator: torch.Generator | None = None, env: DistEnv | None = None, gap: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss + KL to the reference - entropy bonus, each aggregated by `spec.loss_agg` (the policy term by
    `spec.policy_agg` where its loss fixes it) over the mini-batch's global counts (as verl's agg_loss and TRL's
    per-token loss do). The KL and entropy metrics are token means whatever the mode. `generator`: clip_cov's draws
    of tokens; `env`: the ranks the high-entropy threshold is taken over; `gap`: the rows' mean log-prob gap of the
    rollout engine to old_logprobs, for the off-policy mask (None: 0)."""
    mask = exp.response_mask.to(logp.dtype)
    is_weight, extra, weight_metrics = policy_weights(logp, entropy, exp, spec, env, gap)
    loss, metrics = POLICY_LOSSES[spec.name](logp, exp.old_logprobs, exp.advantages, mask, spec.clip_low,
                                             spec.clip_high, global_tokens, is_weight=is_weight,
                                             loss_agg=spec.policy_agg or spec.loss_agg, global_seqs=global_seqs,
                                             max_len=spec.max_len, **loss_options(spec, generator), **extra)
    metrics.update(weight_metrics)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, mask, spec.loss_agg, global_tokens, global_seqs, spec.max_len)

    def token_mean_value(per_token: torch.Tensor) -> float:  # this micro-batch's own mean, for the metric
        return float((per_token.detach() * mask).sum()) / max(1.0, float(mask.sum()))

    if spec.kl_coef > 0 and exp.ref_logprobs is not None:
        kl = KL_ESTIMATORS[spec.kl_type](logp, exp.ref_logprobs)
        if spec.kl_ratio_weighted:
            kl = ratio_weighted_kl(kl, logp, exp.old_logprobs)
        loss = loss + spec.kl_coef * agg(kl)
        metrics["actor/kl_loss"] = token_mean_value(kl)
    if entropy is not None:
        if spec.entropy_coeff > 0:
            loss = loss - spec.entropy_coeff * agg(entropy)
        metrics["actor/entropy"] = token_mean_value(entropy)
    return loss, metrics


class Actor:
    """The trainable policy on a TrainEngine; `update` runs PPO epochs over an Experience batch (this
    rank's share of it under data parallelism)."""

    def __init__(self, engine: TrainEngine, layout: ForwardLayout = ForwardLayout(), ptx: PretrainMix | None = None,
                 average: PolicyAverage | None = None):
        self.engine = engine
        self.model = engine.model  # unwrapped: generation, no-grad log-probs, save_pretrained
        self.layout = layout  # how a micro-batch goes through the model (models.logprobs)
        self.ptx = ptx  # pretraining texts mixed into the updates (PPO-ptx), or None
        self.average = average  # the moving average of the weights each optimizer step moves (actor.ema_beta)

    def update(self, exp: Experience, spec: PolicyLossSpec, mini_batch: int, micro_batch: int | TokenBudget,
               epochs: int, generator: torch.Generator, step: int = 0, gap: torch.Tensor | None = None
               ) -> dict[str, float]:
        """`mini_batch` (this rank's share) and `micro_batch` are in sequences. Mini-batches are shuffled
        each epoch. `step`: the RL step, which picks PPO-ptx's texts; `gap` (B,): each row's mean log-prob gap of
        the rollout engine to exp.old_logprobs, which the off-policy mask adds (None: 0)."""
        self.engine.module.train()
        draws = token_draws(generator) if spec.name == "clip_cov" else None

        def micro_loss(rows, micro: Experience, tokens: float, seqs: float):
            # forward through the engine's module: DDP / DeepSpeed hook gradient reduction there
            logp, ent = response_logprobs(self.engine.module, micro.prompt_ids, micro.prompt_mask, micro.response_ids,
                                          micro.attended, spec.temperature, with_entropy=True,
                                          entropy_grad=spec.entropy_coeff > 0, layout=self.layout, images=micro.images)
            return policy_loss(logp, ent, micro, spec, tokens, seqs, None if draws is None else draws(rows),
                               self.engine.env, None if gap is None else gap[rows].to(logp.device))

        engine = self.engine if self.average is None else self.average.stepping(self.engine)
        return minibatch_updates(exp, micro_loss, engine, mini_batch, micro_batch, epochs, generator, "actor",
                                 by_prompt=self.layout.share_prompt,
                                 lanes=lane_count(self.layout.lanes, self.engine.env.device),
                                 follow=None if self.ptx is None else self._ptx_loss(step))

    def _ptx_loss(self, step: int):
        """PPO-ptx's term after each micro-batch (`train.ptx`): coef x the next texts' language-model loss x the
        micro-batch's share of the mini-batch's tokens; `actor/ptx_loss` is the texts' loss itself."""
        draw, coef = self.ptx.for_step(step), self.ptx.coef

        def follow(share: float) -> tuple[torch.Tensor, dict[str, float]]:
            ids, mask = draw()
            with encoder_in_every_forward(self.engine.module, None):  # a vision-language policy's ranks agree
                loss = language_model_loss(self.engine.module, ids, mask)
            return coef * share * loss, {"actor/ptx_loss": float(loss.detach())}

        return follow
