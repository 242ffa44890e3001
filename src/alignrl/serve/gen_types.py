"""What the generation server's two front ends share: the token-level endpoint (`serve.generate`) and
the OpenAI endpoints (`serve.openai_format`) accept the same sampling limits, build the same engine
sampling parameters and read the same sampled rows. Kept apart from both so that imports run one
way: `generate` imports `openai_format` for its routes, and both import this.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_N = 64
MAX_STOPS, MAX_STOP_LEN = 8, 128


@dataclass
class GenRow:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or stop string) or "length"
    top: list[list[tuple[int, float]]] | None = None  # per position: (token id, log-prob), best first


@dataclass
class GenResult:
    rows: list[GenRow]  # n rows per prompt, rows of one prompt contiguous
    version: int  # the weights every row was sampled with


def sampling(n: int, temperature: float, top_p: float, top_k: int, max_tokens: int, stop, seed,
             min_p: float = 0.0, repetition_penalty: float = 1.0):
    # imported here: the interfaces pull in torch, which request validation alone does not need
    from alignrl.interfaces import SamplingParams

    return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_tokens,
                          stop=tuple(stop or ()), seed=seed, min_p=min_p, repetition_penalty=repetition_penalty)
