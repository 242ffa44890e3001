"""DAPO's math reward, as verl scores `math_dapo` rows and every data_source starting with "aime"
(`verl.utils.reward_score.math_dapo.compute_score`): +1.0 for a right answer, -1.0 for anything else.

Only the response's last RESPONSE_TAIL characters are read. By default the answer is the text after the last
`Answer:` (any case), and it is right when it equals the reference once both are normalized by the Minerva rules
below. With `strict_box_verify` the answer is the last `\\boxed{...}` near the end, compared with the reference as
written. The result is verl's dict, {"score": ±1.0, "acc": bool, "pred": the answer as compared}: the registry and
the loop read its "score".
"""

from __future__ import annotations

import numbers
import re
from typing import Any

RESPONSE_TAIL = 300  # verl reads no more (the longest MATH-500 answer has 159 characters)
BOX_TAIL = 100  # strict mode looks for the box only this close to the end (or to the last pause token)
PAUSE_TOKENS = 4  # strict mode's pause_tokens_index, when given, has this many positions
INVALID = "[INVALID]"  # the answer of a response without one: it equals no normalized reference
BOX_OPEN = "\\boxed{"
ANSWER_RE = r"(?i)Answer\s*:\s*([^\n]+)"

# The normalization is the final-answer rules of the Minerva paper (Lewkowycz et al., 2022, "Solving quantitative
# reasoning problems with language models", appendix), as EleutherAI's lm-evaluation-harness implements them for
# its hendrycks_math task and verl's DAPO reward reuses them. Each step is a plain substring replacement, applied in
# this order, which matters: "\\text{}^2" must go before "\\text{}", and the articles before the spaces.
_REWRITES: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""),  # articles ("a 5" -> "5"), wherever they occur
    (".$", "$"),  # a sentence's full stop inside the math span
    ("\\$", ""),  # an escaped dollar sign is a currency, not math
    ("\\ ", ""), (" ", ""),  # every space, TeX's forced one too
    ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","),  # "1, \\text{and} 2" lists become "1,2"
    ("\\text{m}", "\\text{}"),  # metres: the unit, then its emptied \\text{}, are dropped below
)
_DROPPED: tuple[str, ...] = (
    # units and counted things that follow a number
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples",
    # what is left of text units once their words are gone
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    # ordinals, degrees, TeX spacing and thousands separators, quotes, ellipses
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_REPLACEMENTS: tuple[tuple[str, str], ...] = _REWRITES + tuple((text, "") for text in _DROPPED)

# Then TeX markup, in this order: keep only the first $...$ span (each line's), unwrap \\text{}, \\textbf{},
# \\overline{} (their first closing brace) and \\boxed{} (its last one), and spell the shorthand
# \\frac12 -> \\frac{1}{2} and \\sqrt2 -> \\sqrt{2} (a \\frac with three characters keeps the third after it).
_MARKUP: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), r) for p, r in (
    (r".*?\$(.*?)\$.*", r"$\1$"),
    (r"\\text\{(.*?)\}", r"\1"),
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),
    (r"frac([^{])(.)", r"frac{\1}{\2}"),
    (r"sqrt([^{])", r"sqrt{\1}"),
))


def normalize_final_answer(final_answer: str) -> str:
    """`final_answer` in the Minerva normal form: what follows its last "=", without units, spaces, dollar signs or
    text markup, shorthand fractions spelled out, and a whole number's thousands commas removed."""
    text = final_answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    for pattern, replacement in _MARKUP:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():  # "1,000" is the number 1000; "1,2" as a list is kept below
        text = text.replace(",", "")
    return text.strip()


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string`, braces balanced, markup included; None without one or when it is cut
    off before its closing brace."""
    start = string.rfind(BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(BOX_OPEN) - 1, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[start:i + 1]
    return None


def remove_boxed(s: str) -> str:
    """The content of `s`, a whole `\\boxed{...}`."""
    if not (s.startswith(BOX_OPEN) and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} expression: {s!r:.60}")
    return s[len(BOX_OPEN):-1]


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = ANSWER_RE) -> tuple[bool, str]:
    """(whether the last `answer_pattern` answer of `solution_str` equals `gt` once both are normalized, the
    normalized answer). `gt_need_extract`: the reference is a solution whose last \\boxed{} holds the answer."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else INVALID)
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        if boxed is None:
            raise ValueError(f"the reference has no \\boxed{{...}} answer: {gt!r:.60}")
        gt = remove_boxed(boxed)
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[bool, str]:
    """(whether the last \\boxed{} of the response's end equals `gt` exactly, its content or INVALID). The end is
    the last BOX_TAIL characters, or those from BOX_TAIL before the last of the PAUSE_TOKENS pause positions."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != PAUSE_TOKENS:
            raise ValueError(f"pause_tokens_index has {len(pause_tokens_index)} positions; give {PAUSE_TOKENS}")
        tail = pred[pause_tokens_index[-1] - BOX_TAIL:]
    else:
        tail = pred[-BOX_TAIL:]
    boxed = last_boxed_only_string(tail)
    extracted = remove_boxed(boxed) if boxed is not None else INVALID
    return extracted == gt, extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str]:
    """(correct, the answer as compared), by the strict box rule or the Minerva one."""
    if strict_box_verify:
        return is_correct_strict_box(solution_str, answer, pause_tokens_index)
    return is_correct_minerva(solution_str, answer)


def reference_text(ground_truth: Any) -> str:
    """The reference answer as text: a string, or a number (an AIME answer stored as an integer column)."""
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Real) and not isinstance(ground_truth, bool):
        return str(ground_truth)
    raise TypeError(f"the reference is a {type(ground_truth).__name__} ({ground_truth!r:.40}), not text or a number")


def text_reference_problem(ground_truth: Any) -> str | None:
    """Why `ground_truth` cannot be the reference of a rule that reads the answer's text (geo3k, PRIME math; None: it
    can): not text or a number, or blank (an empty answer would then be right)."""
    try:
        text = reference_text(ground_truth)
    except TypeError as e:
        return str(e)
    return None if text.strip() else "the reference is blank"


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """{"score": 1.0 when the answer at the end of `solution_str` is right else -1.0, "acc": right, "pred": the
    answer as compared} (verl's `math_dapo.compute_score`)."""
    correct, pred = verify(solution_str[-RESPONSE_TAIL:], reference_text(ground_truth), strict_box_verify,
                           pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def reference_problem(ground_truth: Any) -> str | None:
    """Why `ground_truth` cannot be a reference of this reward (None: it can): not text or a number, or nothing left
    of it once normalized (an empty "Answer:" would then be right)."""
    try:
        text = reference_text(ground_truth)
    except TypeError as e:
        return str(e)
    if not normalize_final_answer(text):
        return f"the reference {text!r:.40} is empty once normalized (units, spaces and markup removed)"
    return None
