"""Seeded generator of GSM8K-style arithmetic word problems.

Each problem is a short story with one to three operations; the reference solution writes one
equation per line and ends in `#### <number>`, the GSM8K convention that the rewards parse.
Splits are disjoint by construction: a problem's text is hashed and assigned to train or held-out,
so the same generator can produce any number of either without overlap.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from alignrl.data.records import Sample

DATA_SOURCE = "synthetic_arith"

_NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jill", "Kai", "Lena",
          "Max", "Nia", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "coins", "books", "shells",
          "cards", "stamps", "beads", "eggs"]
_BOXES = ["box", "bag", "jar", "pack", "basket", "crate"]


def _add(r: random.Random, who: str, item: str, a: int) -> tuple[str, str, int]:
    b = r.randint(2, 20)
    return f"{who} buys {b} more {item}.", f"{a}+{b}={a + b}", a + b


def _sub(r: random.Random, who: str, item: str, a: int) -> tuple[str, str, int]:
    b = r.randint(1, max(1, a - 1))
    return f"{who} gives {b} {item} to a friend.", f"{a}-{b}={a - b}", a - b


def _add_groups(r: random.Random, who: str, item: str, a: int) -> tuple[str, str, int]:
    k, m = r.randint(2, 5), r.randint(2, 5)
    box = r.choice(_BOXES)
    text = f"{who} gets {k} {box}s with {m} {item} in each {box}."
    return text, f"{k}*{m}={k * m}\n{a}+{k * m}={a + k * m}", a + k * m


def _double(r: random.Random, who: str, item: str, a: int) -> tuple[str, str, int]:
    k = r.choice([2, 3])
    word = {2: "doubles", 3: "triples"}[k]
    return f"{who} {word} the number of {item}.", f"{a}*{k}={a * k}", a * k


_STEPS = [_add, _sub, _add_groups, _double]


def make_problem(r: random.Random) -> tuple[str, str, str]:
    """Returns (question, solution ending in '#### N', answer)."""
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    value = r.randint(3, 20)
    sentences = [f"{who} has {value} {item}."]
    lines = []
    for _ in range(r.choice([1, 2])):
        step = r.choice(_STEPS[:2] if value > 50 else _STEPS)
        text, eq, value = step(r, who, item, value)
        sentences.append(text)
        lines.append(eq)
    sentences.append(f"How many {item} does {who} have now?")
    return " ".join(sentences), "\n".join(lines + [f"#### {value}"]), str(value)


def _split_of(question: str, heldout_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "test" if h < heldout_fraction else "train"


def iter_problems(split: str, seed: int, heldout_fraction: float = 0.2) -> Iterator[tuple[str, str, str]]:
    """Unique problems of one split ('train' or 'test'), deterministic in `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    r = random.Random(f"{seed}")
    seen: set[str] = set()
    while True:
        q, sol, ans = make_problem(r)
        if q in seen or _split_of(q, heldout_fraction) != split:
            continue
        seen.add(q)
        yield q, sol, ans


def generate(split: str, size: int, seed: int = 0, system_prompt: str | None = None) -> list[Sample]:
    """`size` problems of `split` as Samples; `extra["answer"]` holds the worked solution (for SFT) and
    `extra["ops"]` its number of operations (one equation line each), the problem's difficulty."""
    out = []
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for i, (q, sol, ans) in zip(range(size), iter_problems(split, seed)):
        out.append(Sample(messages=system + [{"role": "user", "content": q}], ground_truth=ans,
                          data_source=DATA_SOURCE, extra={"answer": sol, "index": i, "ops": sol.count("\n")}))
    return out
