"""Held-out evaluation: greedy decoding and the task's reward as accuracy."""

from __future__ import annotations

from collections.abc import Sequence

from alignrl.data.records import Sample
from alignrl.rollout.hf_engine import SamplingParams


def score_texts(reward_fn, samples: Sequence[Sample], texts: Sequence[str]) -> list[float]:
    return [float(reward_fn(s.data_source, t, s.ground_truth, s.extra)) for s, t in zip(samples, texts)]


def greedy_accuracy(engine, tokenizer, samples: Sequence[Sample], prompts: Sequence[Sequence[int]],
                    reward_fn, max_new_tokens: int, batch_size: int = 500) -> float:
    """Fraction of samples whose greedy response earns full reward (>= 1)."""
    correct = 0
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    for start in range(0, len(samples), batch_size):
        ro = engine.generate(prompts[start:start + batch_size], params)
        texts = tokenizer.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, tokenizer.pad_token_id),
                                       skip_special_tokens=True)
        correct += sum(r >= 1.0 for r in score_texts(reward_fn, samples[start:start + batch_size], texts))
    return correct / max(1, len(samples))
