"""R1-style rule reward: a format bonus for `<think>...</think><answer>...</answer>` plus math-verified accuracy of
the answer (LMM-R1's `math_verifier` rule: 0.5 × format + accuracy, so a correct answer in the right form scores
1.5, a correct one in another form 1.0, a well-formed wrong one 0.5).

The accuracy reads the last `<answer>...</answer>` span when there is one, else the whole response, and compares it
with the reference through `rewards.math.compute_score` (a `\\boxed{}` inside the span wins; "1/2", "0.5" and
"\\frac{1}{2}" agree). Pure functions of text: the loop's reward stage and `alignrl serve reward --protocol
openrlhf` score alike.
"""

from __future__ import annotations

import re
from typing import Any

from alignrl.rewards import math as math_reward

DATA_SOURCE = "think_answer"  # the data_source that selects this reward in the loop
FORMAT_WEIGHT = 0.5  # LMM-R1's weight of the format term

# Whitespace may surround the two blocks (a tokenizer may detokenize a space there); nothing else may.
_FORMAT_RE = re.compile(r"\s*<think>(?:(?!</think>).)*</think>\s*<answer>(?:(?!</answer>).)*</answer>\s*", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_ok(response: str) -> bool:
    """One think block then one answer block and nothing else: a response that repeats a tag (two answers to pick
    from) does not get the bonus."""
    return (_FORMAT_RE.fullmatch(response) is not None and response.count("<think>") == 1
            and response.count("<answer>") == 1)


def answer_span(response: str) -> str:
    """The text the accuracy reads: the last `<answer>` block's content, else the whole response."""
    spans = _ANSWER_RE.findall(response)
    return spans[-1].strip() if spans else response


def accuracy(response: str, ground_truth: str) -> float:
    return math_reward.compute_score(answer_span(response), str(ground_truth))


def score(response: str, ground_truth: Any, format_weight: float = FORMAT_WEIGHT) -> float:
    """format_weight × format + accuracy (each 0 or 1)."""
    return format_weight * float(format_ok(response)) + accuracy(response, ground_truth)


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """The registry's signature (`REWARDS[DATA_SOURCE]`)."""
    return score(solution_str, ground_truth)
