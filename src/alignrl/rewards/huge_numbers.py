"""Answers that would make sympy compute a number of millions or billions of digits.

Both symbolic graders the rewards use, math_verify and mathruler's `grade_answer`, hand an answer to sympy with no
timeout that could stop it (math_verify's are SIGALRM-based and off in worker threads), and sympy evaluates integer
powers, factorials, binomials and Gamma values in full. One sampled answer such as `\\boxed{9999999!}` would hang a
reward worker for good. Such answers are compared as text instead; no reference answer of a math set is written that
way, and small ones (`5!`, `(n+1)!`, `2^{10}`, `\\binom{5}{2}`) are still worked out.
"""

from __future__ import annotations

import re

_BIG = r"(?:\d{5,}|\^|!)"  # what makes an argument of a binomial or Gamma unbounded
_HUGE_RE = re.compile("|".join((
    r"\^\s*[{(][^{}()]*\d\s*[\^!]",  # an exponent holding a power or factorial of a number: 9^{9^9}, 2^{13!}
    r"\^\s*[{(]?[^{}()]*?\d{6,}",  # an exponent holding a six-digit number: 2^{1000000}, 10^{2 \cdot 999999999}
    r"\^\s*[{(][^{}()]*\d{3,}\s*(?:\\cdot|\\times|\*)\s*\d{3,}",  # a product of big numbers: 10^{99999 \times 99999}
    r"\d\s*\^\s*\{?\s*\d{2,}\s*\}?\s*[)}\]]*\s*!",  # a factorial of a number's power: 10^{100}!, {10^{10}}!
    r"\*\*\s*\(?\s*\d+\s*\)?\s*\*\*\s*\(?\s*\d",  # a Python tower: 9**9**9
    r"\*\*\s*\(?\s*\d{6,}",  # a six-digit Python exponent (not Markdown's bold, "**5**")
    rf"\\[dt]?binom\s*\{{[^{{}}]*{_BIG}", rf"\\[dt]?binom\s*\{{[^{{}}]*\}}\s*\{{[^{{}}]*{_BIG}",  # a binomial
    r"\d{5,}[^{}]*\\choose", r"\\choose\s*\{?\s*\d{5,}",
    rf"\\Gamma\s*[({{][^(){{}}]*{_BIG}",  # a Gamma of 10^4 or more, of a power or of a factorial
    r"\d{5,}\s*!",  # a factorial of 10^4 or more
    r"\([^()]*(?:\d{5,}|\d!)[^()]*\)\s*!", r"\{[^{}]*(?:\d{5,}|\d!)[^{}]*\}\s*!",  # of a bracket holding one
)))
# TeX's sizing of brackets (\left( ... \right)) changes nothing of the value: read without it
_SIZING_RE = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)\b")


def huge(text: str) -> bool:
    """Whether a symbolic grader given `text` could be made to compute an unboundedly large number."""
    return _HUGE_RE.search(_SIZING_RE.sub("", text)) is not None
