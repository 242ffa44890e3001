"""Answers that would make sympy compute a number of millions or billions of digits.

Both symbolic graders the rewards use, math_verify and mathruler's `grade_answer`, hand an answer to sympy with no
timeout that could stop it (math_verify's are SIGALRM-based and off in worker threads), and sympy evaluates integer
powers, factorials, binomials and Gamma values in full. One sampled answer such as `\\boxed{9999999!}` would hang a
reward worker for good. Such answers are compared as text instead; no reference answer of a math set is written that
way, and small ones (`5!`, `2^{10}`, `\\binom{5}{2}`) are still worked out.
"""

from __future__ import annotations

import re

_HUGE_RE = re.compile("|".join((
    r"\^\s*\{[^{}]*\^",  # an exponent tower: 9^{9^{9}}
    r"\^\s*\{?\s*\d{6,}",  # a six-digit exponent
    r"\*\*\s*\(?\s*\d+\s*\)?\s*\*\*\s*\(?\s*\d",  # a Python tower: 9**9**9
    r"\*\*\s*\d{6,}",  # a six-digit Python exponent (not Markdown's bold, "**5**")
    r"\\[dt]?binom\s*\{[^{}]*\d{5,}", r"\d{5,}[^{}]*\\choose", r"\\choose\s*\{?\s*\d{5,}",  # a binomial of 10^4+
    r"\\Gamma\s*[({]\s*\d{5,}",  # a Gamma of 10^4 or more
    r"\d{5,}\s*!", r"[)}\]]\s*!(?!=)",  # a factorial of 10^4 or more, or of a bracket: (10^{100})! (TeX's \! aside)
)))


def huge(text: str) -> bool:
    """Whether a symbolic grader given `text` could be made to compute an unboundedly large number."""
    return _HUGE_RE.search(text) is not None
