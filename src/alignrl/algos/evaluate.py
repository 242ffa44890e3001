"""Held-out evaluation: greedy decoding, scored with the task's reward.

Besides `accuracy` (full reward, e.g. strict `#### N` for GSM8K-style sources), GSM8K-style sources
also get `accuracy_flexible` (last number in the text), which separates learning the answer format
from learning to compute the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from alignrl.data.records import Sample
from alignrl.rewards import gsm8k
from alignrl.rewards.registry import REWARDS
from alignrl.rollout.hf_engine import SamplingParams


def greedy_eval(engine, tokenizer, samples: Sequence[Sample], prompts: Sequence[Sequence[int]], correct_fn,
                max_new_tokens: int, batch_size: int = 500) -> dict[str, float]:
    strict = flexible = 0.0
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    for start in range(0, len(samples), batch_size):
        ro = engine.generate(prompts[start:start + batch_size], params)
        texts = tokenizer.batch_decode(ro.response_ids.masked_fill(~ro.response_mask, tokenizer.pad_token_id),
                                       skip_special_tokens=True)
        for s, t in zip(samples[start:start + batch_size], texts):
            strict += correct_fn(s.data_source, t, s.ground_truth, s.extra) >= 1.0
            if REWARDS.get(s.data_source) is gsm8k.compute_score:
                flexible += gsm8k.compute_score(t, s.ground_truth, method="flexible")
    n = max(1, len(samples))
    return {"accuracy": strict / n, "accuracy_flexible": flexible / n}
