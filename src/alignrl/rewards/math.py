"""Math answer reward: symbolic equivalence via `math_verify`, so "1/2", "0.5" and "\\frac{1}{2}" agree.

The answer span is picked here rather than by math_verify's own search, so the rule is predictable:
the last `\\boxed{...}`, else the last `#### ...` line, else whatever math_verify finds in the whole
text (typically the last number or expression). Timeouts are disabled because math_verify implements
them with SIGALRM, which raises off the main thread, and rewards are scored in worker threads.
"""

from __future__ import annotations

import logging
import re

from alignrl.rewards.huge_numbers import huge

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####[ \t]*([^\n]+)")
# A "$" that is not escaped ("\$18.90" is a price).
_MATH_DOLLAR_RE = re.compile(r"(?<!\\)\$")


class _TimeoutsOffOnPurpose(logging.Filter):
    """math_verify says once per process that its timeouts are off and the caller must interrupt stuck parses; here
    they are off on purpose (above) and huge numbers never reach sympy (`huge_numbers`), so every worker's copy of
    that line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutsOffOnPurpose())


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, if any."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the completion's final answer is mathematically equal to `ground_truth`, else 0.0."""
    from math_verify import parse, verify

    try:
        gold = _parse_gold(ground_truth)
        if not gold:
            return 0.0
        answer = last_boxed(solution_str)
        if answer is None:
            hashes = _HASH_RE.findall(solution_str)
            answer = hashes[-1].strip() if hashes else None
        if huge(answer if answer is not None else solution_str):
            return 1.0 if answer is not None and answer == ground_truth.strip() else 0.0
        pred = (
            parse(f"${answer}$", parsing_timeout=None)
            if answer
            else parse(solution_str, parsing_timeout=None)
        )
        if not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
    except Exception:  # math_verify/sympy can fail on arbitrary model output; that is a wrong answer
        return 0.0


def answer_equals(answer: str, ground_truth: str) -> bool:
    """Whether `answer`, a final answer already picked from a response (LaTeX without `$`), is mathematically equal
    to `ground_truth` under math_verify; other rules (verl's prime_math) pick the answer their own way and ask this.
    A huge number is compared as text, as above; anything math_verify cannot parse is unequal."""
    from math_verify import parse, verify

    if huge(answer) or huge(ground_truth):
        return answer.strip() == ground_truth.strip()
    try:
        gold = _parse_gold(ground_truth)
        pred = parse(f"${answer}$", parsing_timeout=None) if gold else []
        return bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
    except Exception:  # math_verify/sympy can fail on arbitrary model output; that is a wrong answer
        return False


def _parse_gold(ground_truth: str) -> list[object]:
    """Parse the reference, reading bare strings such as "\\sqrt{2}" as LaTeX math first."""
    from math_verify import parse

    text = ground_truth.strip()
    if not _MATH_DOLLAR_RE.search(text) and "\\boxed" not in text:
        gold = parse(f"${text}$", parsing_timeout=None)
        if gold:
            return gold
    return parse(text, parsing_timeout=None)
