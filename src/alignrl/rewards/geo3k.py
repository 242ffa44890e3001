"""verl's Geometry3K reward, as verl scores `hiyouga/geometry3k` rows (the data of verl's vision-language examples,
made by its examples/data_preprocess/geo3k.py): `verl.utils.reward_score.geo3k.compute_score`.

score = (1 - format_score) * accuracy + format_score * format, 0.9 * accuracy + 0.1 * format by default:
accuracy is 1.0 when the content of the response's last `\\boxed{...}` equals the reference by mathruler's grader
(normal forms, else sympy: `ruler`), format is 1.0 when the whole response is `<think>...</think>` then an answer
holding a `\\boxed{...}`. A right answer thus scores 0.9 without the thinking block and 1.0 with it; a wrong one
0.1 when well formed, else 0.
"""

from __future__ import annotations

from typing import Any

from alignrl.rewards import ruler
from alignrl.rewards.math_dapo import reference_text
from alignrl.rewards.values import RowScore

DATA_SOURCE = "hiyouga/geometry3k"
FORMAT_SCORE = 0.1  # verl's default weight of the format term
THINK_OPEN, THINK_CLOSE, BOX_OPEN = "<think>", "</think>", "\\boxed{"
# verl's format rule: the whole response matches this (DOTALL). format_reward decides it in one pass instead: the
# regex's nested greedy stars backtrack in cubic time, minutes on a degenerate 40k-character response repeating
# "</think>\\boxed{", and a policy in training does produce such loops.
FORMAT_PATTERN = r"<think>.*</think>.*\\boxed\{.*\}.*"


def format_reward(predict_str: str) -> float:
    """1.0 when the whole response is a <think> block, then text holding a \\boxed{...}, else 0.0: it starts with
    <think>, and a </think>, a \\boxed{ and a } follow in that order. Taking the first of each is never worse, so
    FORMAT_PATTERN matches exactly when these finds succeed."""
    if not predict_str.startswith(THINK_OPEN):
        return 0.0
    close = predict_str.find(THINK_CLOSE, len(THINK_OPEN))
    box = predict_str.find(BOX_OPEN, close + len(THINK_CLOSE)) if close >= 0 else -1
    return 1.0 if box >= 0 and predict_str.find("}", box + len(BOX_OPEN)) >= 0 else 0.0


def acc_reward(predict_str: str, ground_truth: Any, use_boxed: bool = True) -> float:
    """1.0 when the boxed answer (the whole response when not `use_boxed`) equals the reference, else 0.0. The boxed
    answer is mathruler's reading, verl's: the last `\\boxed{...}`'s content, or the text "None" without a closed
    box (graded as it is, as verl does). Imported here as in `ruler`: sympy is slow to import."""
    from mathruler.grader import extract_boxed_content

    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if ruler.grade_answer(answer, reference_text(ground_truth)) else 0.0


def compute_score(predict_str: str, ground_truth: Any, use_boxed: bool = True,
                  format_score: float = FORMAT_SCORE) -> float:
    """verl's geo3k score (module docstring); `ground_truth` is the reference's text or a number."""
    return weighted(acc_reward(predict_str, ground_truth, use_boxed), format_reward(predict_str), format_score)


def weighted(acc: float, form: float, format_score: float = FORMAT_SCORE) -> float:
    """verl's mix of the accuracy and format terms."""
    return (1.0 - format_score) * acc + format_score * form


def graded(predict_str: str, ground_truth: Any) -> RowScore:
    """verl's geo3k score, carrying whether the answer is right (a right answer without the thinking block scores
    0.9 and still counts as solved): the built-in reward of geo3k rows."""
    acc = acc_reward(predict_str, ground_truth)
    return RowScore(weighted(acc, format_reward(predict_str)), correct=acc == 1.0)
