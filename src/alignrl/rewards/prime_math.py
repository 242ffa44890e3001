"""verl's PRIME math reward, as verl scores the NuminaMath sets of PRIME's data (`numina_aops_forum`,
`numina_synthetic_math`, `numina_amc_aime`, `numina_synthetic_amc`, `numina_cn_k12`, `numina_olympiads`):
`verl.utils.reward_score.prime_math.compute_score`, of which verl's `default_compute_score` keeps the correctness,
1.0 for a right answer and 0.0 otherwise.

The answer is picked from the response as prime_math picks it (`match_answer`): what follows the last "answer:",
"answer is" or "answers are", cut before an "is the answer"-like phrase, then the last `\\boxed{...}`'s content
when there is one, cut at its last ". ", and finally what follows the last "is ", "=", ": ", ... It is right when
mathruler's grader (the PRM800K grader prime_math also starts with: `ruler`) says so, else when math_verify finds it
equal to the reference. prime_math's own second grader (sympy with timeouts run in a subprocess, and pi taken as
3.14 too) is not reproduced: math_verify is the symbolic check alignrl already trusts, and its timeouts, signal
based, cannot run in the reward's worker threads.
"""

from __future__ import annotations

import re
from typing import Any

from alignrl.rewards import ruler
from alignrl.rewards import math as math_reward
from alignrl.rewards.huge_numbers import huge
from alignrl.rewards.math_dapo import reference_text

DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                "numina_cn_k12", "numina_olympiads")
# Each phrase is looked for, case-insensitively and in this order, in what the previous ones left of the response.
ANSWER_LEADS = ("answer:", "answer is", "answers are")  # the answer follows the last one
ANSWER_TAILS = ("is answer", "is the answer", "are answers", "are the answers")  # the answer precedes the last one
VALUE_LEADS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")  # then a value
SENTENCE_END = ". "  # a boxed or led answer is cut before its last one: "5. So we are done" is 5
# math_verify parses a whole answer as LaTeX, at one to three seconds per thousand characters; a response marking no
# answer is graded whole (a cut-off one, often, thousands of characters) and would cost seconds to learn it is wrong.
# Longer "answers" are left to mathruler's grader: the longest MATH-500 answer has 159 characters.
FALLBACK_MAX_CHARS = 200
# prime_math's format flag: a step-by-step solution ("Step 2:") that boxes its answer (any "\box": \boxed, \boxtimes)
STEP_MARK, BOX_MARK = "Step 2:", "\\box"


def last_index(text: str, phrase: str) -> int:
    """Where the last case-insensitive `phrase` starts in `text` (-1: nowhere); the phrases are lowercase ASCII."""
    return max((m.start() for m in re.finditer(re.escape(phrase), text, re.IGNORECASE)), default=-1)


def last_boxed_content(text: str) -> str | None:
    """The stripped content of the first brace group after the last `\\boxed` (after the last `\\fbox` when no
    `\\boxed` is written), braces balanced; None when that box is not closed."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    opened, depth = -1, 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            opened = i if opened < 0 else opened
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[opened + 1:i].strip() if opened >= 0 else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(whether an answer was marked: a lead phrase, a box or a value lead, and the answer holds a digit; the answer
    as `compute_score` grades it, picked as the module docstring says: prime_math's `match_answer`)."""
    marked = False
    for phrase in ANSWER_LEADS:
        i = last_index(response, phrase)
        if i >= 0:
            marked, response = True, response[i + len(phrase):].strip()
    for phrase in ANSWER_TAILS:
        i = last_index(response, phrase)
        if i >= 0:
            marked, response = True, response[:i].strip()
    boxed = last_boxed_content(response)
    if boxed:
        marked, response = True, boxed
    cut = response.rfind(SENTENCE_END)
    if cut >= 0:
        response = response[:cut].strip()
    for phrase in VALUE_LEADS:
        i = last_index(response, phrase)
        if i >= 0:
            marked, response = True, response[i + len(phrase):].strip()
    return marked and any(c.isdigit() for c in response), response


def grade_answer(given_answer: str, ground_truth: str) -> bool:
    """Whether the picked answer equals the reference `ground_truth` (verl's argument names): mathruler's grader,
    else math_verify (module docstring). An answer sympy could not finish with (`huge_numbers.huge`), or longer than
    FALLBACK_MAX_CHARS, gets no second try."""
    if ruler.grade_answer(given_answer, ground_truth):
        return True
    return (len(given_answer) <= FALLBACK_MAX_CHARS and not huge(given_answer)
            and math_reward.answer_equals(given_answer, ground_truth))


def compute_score(model_output: str, ground_truth: Any) -> tuple[bool, bool, str]:
    """(right, well formatted, the answer as graded): verl's prime_math result. A right answer counts as well
    formatted, as in prime_math. `ground_truth` is the reference's text or a number."""
    model_output = str(model_output)
    reference = reference_text(ground_truth)
    _, answer = match_answer(model_output)
    if grade_answer(answer, reference):
        return True, True, answer
    return False, STEP_MARK in model_output and BOX_MARK in model_output, answer


def score(solution_str: str, ground_truth: Any) -> float:
    """1.0 for a right answer, else 0.0: the registry's rule (verl's default_compute_score keeps `compute_score`'s
    first item)."""
    return 1.0 if compute_score(solution_str, ground_truth)[0] else 0.0
