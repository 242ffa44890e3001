"""GSM8K-style rule rewards: extract a final number from a completion and compare it to the answer.

Semantics follow verl's `gsm8k.compute_score` (strict `#### N` or flexible last-number extraction,
`score` if right, `format_score` if an answer was found but wrong, 0 otherwise), with one change:
numbers are normalised before comparison, so "1,234", "$1234" and "1234.00" all equal "1234".
Pure Python, so it is cheap to call from any worker thread or process.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A signed number with an optional "$", thousands separators in groups of three, and decimals.
_NUMBER = r"[-+]?\$?[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_FLEXIBLE_RE = re.compile(_NUMBER)
_FORMAT_RE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*(?:" + _NUMBER + r")\s*\Z")


def normalize_number(s: str) -> str:
    """Canonical text for a numeric string ("5.0" -> "5", "3.50" -> "3.5", "$1,234" -> "1234").

    Non-numeric strings come back stripped but otherwise unchanged, so they still compare exactly.
    """
    text = s.strip()
    cleaned = re.sub(r"[\s,$]", "", text)
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    if value == value.to_integral_value():
        try:
            return str(int(value))
        except ValueError:  # past Python's int-to-text digit limit (a model repeating digits): compare as text
            return cleaned
    return format(value.normalize(), "f")


def extract_strict(text: str) -> str | None:
    """The number in the last `#### <number>` of `text`, normalised; None if there is none."""
    matches = _STRICT_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def extract_flexible(text: str) -> str | None:
    """The last number anywhere in `text`, normalised; None if the text has no digits."""
    matches = _FLEXIBLE_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if wrong, 0 if absent.

    `method` is "strict" (requires `#### N`, rewarding the output format GSM8K teaches) or
    "flexible" (last number in the text, for models not trained on that format).
    """
    if method == "strict":
        answer = extract_strict(solution_str)
    elif method == "flexible":
        answer = extract_flexible(solution_str)
    else:
        raise ValueError(f"unknown gsm8k extraction method {method!r} (use 'strict' or 'flexible')")
    if answer is None:
        return 0.0
    return score if answer == normalize_number(ground_truth) else format_score


def format_reward(text: str) -> float:
    """1.0 if `text` ends with its own `#### <number>` line (trailing whitespace allowed), else 0.0."""
    return 1.0 if _FORMAT_RE.search(text) else 0.0
