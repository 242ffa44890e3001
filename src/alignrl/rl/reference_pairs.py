"""The rollouts of XPO (Xie et al. 2024, "Exploratory Preference Optimization"; TRL's XPOTrainer), Nash-MD (Munos
et al. 2024, "Nash Learning from Human Feedback"; TRL's NashMDTrainer) and SPIN (`rl.spin_targets`): each prompt's pair
holds the policy's answer (SPIN: the row's target) and one of the reference model (XPO, SPIN) or of the geometric
mixture of policy and reference (Nash-MD), sampled in the producer's process from the reference it already holds for
the log-probs (`RolloutMaker.ref`). The losses (`core.online_dpo`, `core.nash_md`) read the second answer of each pair
as that other one: the rows of a prompt are the first answer's first.

Only an in-process reference can answer: a reference service (`services.reference_url`) returns log-probs, not text,
and a reference sharded over the ranks runs its forwards as collectives, which a sampling loop of its own per rank
cannot; both are one line at start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch

from alignrl.config import RunConfig
from alignrl.config.schema import REFERENCE_ANSWERS
from alignrl.data.records import Rollout
from alignrl.errors import ConfigError
from alignrl.interfaces import RefScorer, RolloutEngine, SamplingParams, derived_seed
from alignrl.models.lora import AdaptersOffScorer, adapters_off
from alignrl.rl.producer import LocalRefScorer
from alignrl.rl.rollout_ops import interleave_pairs
from alignrl.rl.spin_targets import TargetPairEngine
from alignrl.rollout.hf_engine import HFRolloutEngine


class AdaptersOffEngine:
    """Generation from the base of a model trained with LoRA adapters (the reference), on the same module."""

    def __init__(self, engine: HFRolloutEngine, model: torch.nn.Module):
        self.engine, self.model, self.pad_id, self.eos = engine, model, engine.pad_id, engine.eos

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        with adapters_off(self.model):
            return self.engine.generate(prompts, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("the reference's answers come from frozen weights: nothing loads into them")


class MixtureEngine(HFRolloutEngine):
    """Sampling from the geometric mixture of the policy and the reference, π^(1-c) · π_ref^c renormalized
    (c = algorithm.mixture_coef), as TRL's GeometricMixtureWrapper mixes the two models' logits: each step's
    log-probabilities are (1-c) · log π + c · log π_ref, both models decoding the same tokens on caches of their own.
    `reference_on`: what makes `reference` compute as the reference (the base's adapters switched off when it is
    the policy's own module)."""

    def __init__(self, policy: HFRolloutEngine, reference: torch.nn.Module, coef: float,
                 reference_on: Callable = nullcontext):
        super().__init__(policy.model, policy.tokenizer, policy.eos.tolist())
        self.reference, self.coef, self.reference_on = HFRolloutEngine(reference, policy.tokenizer), coef, reference_on

    def _stepper(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, dev: torch.device):
        mine = super()._stepper(prompts, max_new_tokens, dev)
        with self.reference_on():  # a decoder takes its weights when it is made: the base's here
            theirs = self.reference._stepper(prompts, max_new_tokens, dev)
        return _MixedStepper(mine, theirs, self.coef, self.reference_on)


class _MixedStepper:
    """Two decoders over the same rows, their next-token log-probabilities mixed (HFRolloutEngine's stepper)."""

    def __init__(self, mine, theirs, coef: float, reference_on: Callable):
        self.mine, self.theirs, self.coef, self.reference_on = mine, theirs, coef, reference_on
        self.logits = self._mixed(mine.logits, theirs.logits)

    def _mixed(self, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        if self.coef in (0.0, 1.0):  # one model alone: 0 x a token's -inf log-prob would be nan
            return (theirs if self.coef else mine).float().log_softmax(-1)
        width = min(mine.shape[-1], theirs.shape[-1])  # a padded vocabulary's extra rows are no tokens
        mixed = (1.0 - self.coef) * mine[..., :width].float().log_softmax(-1) + \
            self.coef * theirs[..., :width].float().log_softmax(-1)
        return mixed.log_softmax(-1)  # renormalized, as the repetition penalty scales log-probabilities

    def keep(self, idx: torch.Tensor) -> None:
        self.mine.keep(idx)
        self.theirs.keep(idx)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = self.mine.step(tokens)
        with self.reference_on():
            theirs = self.theirs.step(tokens)
        return self._mixed(mine, theirs)


class ReferencePairEngine:
    """A RolloutEngine of two answers per prompt: `policy`'s first, `reference`'s second. Weights published to it
    go to the policy's engine; the reference is frozen."""

    def __init__(self, policy: RolloutEngine, reference: HFRolloutEngine | AdaptersOffEngine | MixtureEngine):
        self.policy, self.reference = policy, reference

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        if params.n != 2:
            raise ValueError(f"the policy's answer is paired with the reference's: rollout.n=2 (got {params.n})")
        one = replace(params, n=1)
        mine = self.policy.generate(prompts, one)
        # the reference draws its own random numbers: at the start both models are the same, and the same draws
        # would give each prompt two identical answers, a pair that teaches nothing
        theirs = self.reference.generate(prompts, replace(one, seed=derived_seed(params.seed, 1)))
        return interleave_pairs(mine, theirs, self.reference.pad_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.policy.load_weights(named_tensors)


def refuse_sharded_base(cfg: RunConfig) -> None:
    """Under LoRA the reference is the policy's module with its adapters off; beside a policy whose engine shards
    it (fsdp2, ZeRO-3) that module cannot generate on one rank alone: one line at start."""
    if cfg.algorithm.adv_estimator in REFERENCE_ANSWERS and not cfg.model.ref_path:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} samples with the reference model, "
                          "which under LoRA is the sharded policy's own module with its adapters off: use "
                          "trainer.strategy=ddp, or give the base as model.ref_path")


def reference_answers(cfg: RunConfig, engine: RolloutEngine, ref: RefScorer | None, tokenizer) -> RolloutEngine:
    """`engine` itself, or under algorithm.adv_estimator=xpo, nash_md or spin the pair engine of it and the reference
    `ref` holds (nash_md: the mixture of the policy and that reference; spin: the rows' targets and that reference)."""
    estimator = cfg.algorithm.adv_estimator
    if estimator not in REFERENCE_ANSWERS:
        return engine
    adapters = isinstance(ref, AdaptersOffScorer)  # the reference is the policy's own module with its adapters off
    if not adapters and not isinstance(ref, LocalRefScorer):
        raise ConfigError(f"algorithm.adv_estimator={estimator} samples each prompt's second answer from the "
                          "reference model, which must be loaded where the rollouts are made; this run's is "
                          f"{'not there' if ref is None else type(ref).__name__} (a reference service, a reference "
                          "sharded over the ranks, or pipeline.ref_logprobs=trainer): drop services.reference_url, "
                          "use a strategy that keeps whole copies (ddp), or set pipeline.ref_logprobs=sampler")
    if estimator != "nash_md":  # the answers end where the policy's do (its engine's stop tokens), as TRL's one config
        reference = HFRolloutEngine(ref.model, tokenizer, engine.eos.tolist() if hasattr(engine, "eos") else None)
        reference = AdaptersOffEngine(reference, ref.model) if adapters else reference
        if estimator == "spin":
            eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else int(reference.eos[0])
            return TargetPairEngine(reference, tokenizer, eos)
        return ReferencePairEngine(engine, reference)
    if not isinstance(engine, HFRolloutEngine):  # the mixture decodes with the policy's own weights, token by token
        raise ConfigError("algorithm.adv_estimator=nash_md samples from the mixture of the policy and the reference "
                          f"in this process, and this run generates with {type(engine).__name__} (a generation "
                          "service, vLLM, or an agent loop): run with the embedded engine")
    reference_on = (lambda: adapters_off(ref.model)) if adapters else nullcontext
    return ReferencePairEngine(engine, MixtureEngine(engine, ref.model, cfg.algorithm.mixture_coef, reference_on))
