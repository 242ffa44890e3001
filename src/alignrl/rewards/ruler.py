"""mathruler's `grade_answer`, the PRM800K answer grader verl's geo3k and prime_math rules compare answers with, made
safe to call on any model output.

The grader equates two answers when their MATH-style normal forms are equal, or when sympy simplifies their
difference to 0. It has no timeout, and it already declines `^{`, `^(` and two-digit exponents, but a Python power
(`9**9**9`) or a factorial of a large number (`9999999!`) still makes sympy compute a number of millions of digits:
a reward worker would hang on one sampled answer. Answers that could (`huge_numbers.huge`, the guard math_verify's
callers use too) are compared by their normal forms alone, without sympy.
"""

from __future__ import annotations

from alignrl.rewards.huge_numbers import huge


def grade_answer(given: str, reference: str) -> bool:
    """Whether `given` equals `reference` by mathruler's grader (False on anything it cannot read). Imported here:
    mathruler imports sympy, slow to import, and most runs never score the sets that use it."""
    from mathruler.grader import grade_answer as mathruler_grade
    from mathruler.math_normalize import normalize_answer

    if huge(given) or huge(reference):
        return given.strip() == reference.strip() or normalize_answer(given) == normalize_answer(reference)
    try:
        return bool(mathruler_grade(given, reference))
    except Exception:  # the grader catches sympy's errors; anything else on arbitrary output is a wrong answer
        return False
