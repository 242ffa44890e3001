"""Seeded generator of GSM8K-style arithmetic word problems.

Each problem is a short story with one to three operations; the reference solution writes one
equation per line and ends in `#### <number>`, the GSM8K convention that the rewards parse.
Splits are disjoint by construction: a problem's text is hashed and assigned to train or held-out,
so the same generator can produce any number of either without overlap.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator

from alignrl.data.records import Sample

DATA_SOURCE = "synthetic_arith"

_NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jill", "Kai", "Lena",
          "Max", "Nia", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "coins", "books", "shells",
          "cards", "stamps", "beads", "eggs"]
_BOXES = ["box", "bag", "jar", "pack", "basket", "crate"]


# A step is drawn as (sentence, op) and computed apart from its wording, so a solution can also be rendered
# with a slip (see `solve`). op: ("+", b) | ("-", b) | ("-", b, "gives") | ("*", k) | ("+*", k, m) (k groups
# of m added).
Op = tuple


def _add(r: random.Random, who: str, item: str, a: int) -> tuple[str, Op]:
    b = r.randint(2, 20)
    return f"{who} buys {b} more {item}.", ("+", b)


def _sub(r: random.Random, who: str, item: str, a: int) -> tuple[str, Op]:
    b = r.randint(1, max(1, a - 1))
    if r.random() < 0.5:
        return f"{who} loses {b} {item}.", ("-", b)
    return f"{who} gives {b} {item} to a friend.", ("-", b, "gives")


def _add_groups(r: random.Random, who: str, item: str, a: int) -> tuple[str, Op]:
    k, m = r.randint(2, 5), r.randint(2, 5)
    box = r.choice(_BOXES)
    return f"{who} gets {k} {box}s with {m} {item} in each {box}.", ("+*", k, m)


def _double(r: random.Random, who: str, item: str, a: int) -> tuple[str, Op]:
    k = r.choice([2, 3])
    word = {2: "doubles", 3: "triples"}[k]
    return f"{who} {word} the number of {item}.", ("*", k)


# subtraction twice as likely as the others: a "gives away" step (half of them) is what a slip gets wrong
_STEPS = [_add, _sub, _sub, _add_groups, _double]


def _apply(op: Op, a: int) -> tuple[list[str], int]:
    """The equation lines of one step from running value `a`, and the new value."""
    kind = op[0]
    if kind == "+*":
        k, m = op[1], op[2]
        return [f"{k}*{m}={k * m}", f"{a}+{k * m}={a + k * m}"], a + k * m
    b = op[1]
    value = {"+": a + b, "-": a - b, "*": a * b}[kind]
    return [f"{a}{kind}{b}={value}"], value


def solve(start: int, ops: list[Op], slip: Callable[[], bool] | None = None) -> tuple[str, int]:
    """The worked solution (one equation per line, then `#### N`) and its final value. With `slip`, each
    "gives away" step for which `slip()` is true is added instead of subtracted: the systematic mistake of
    a sloppy annotator, carried through the later lines (used for a base model's SFT data, never for the
    problems' answers)."""
    value, lines = start, []
    for op in ops:
        if op[-1] == "gives" and slip is not None and slip():
            op = ("+", op[1])
        more, value = _apply(op, value)
        lines += more
    return "\n".join(lines + [f"#### {value}"]), value


def make_problem(r: random.Random) -> tuple[str, int, list[Op]]:
    """Returns (question, starting value, ops): `solve(start, ops)` gives the solution and answer."""
    who, item = r.choice(_NAMES), r.choice(_ITEMS)
    start = value = r.randint(3, 20)
    sentences = [f"{who} has {value} {item}."]
    ops = []
    for _ in range(r.choice([1, 2])):
        step = r.choice(_STEPS[:3] if value > 50 else _STEPS)
        text, op = step(r, who, item, value)
        sentences.append(text)
        ops.append(op)
        value = _apply(op, value)[1]
    sentences.append(f"How many {item} does {who} have now?")
    return " ".join(sentences), start, ops


def _split_of(question: str, heldout_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "test" if h < heldout_fraction else "train"


def _unique(split: str, seed: int, heldout_fraction: float) -> Iterator[tuple[str, int, list[Op]]]:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    r = random.Random(f"{seed}")
    seen: set[str] = set()
    while True:
        q, start, ops = make_problem(r)
        if q in seen or _split_of(q, heldout_fraction) != split:
            continue
        seen.add(q)
        yield q, start, ops


def iter_problems(split: str, seed: int, heldout_fraction: float = 0.2) -> Iterator[tuple[str, str, str]]:
    """Unique problems of one split ('train' or 'test') as (question, solution, answer), deterministic in
    `seed`."""
    for q, start, ops in _unique(split, seed, heldout_fraction):
        sol, value = solve(start, ops)
        yield q, sol, str(value)


def generate(split: str, size: int, seed: int = 0, system_prompt: str | None = None,
             slip: float = 0.0) -> list[Sample]:
    """`size` problems of `split` as Samples; `extra["answer"]` holds the worked solution (for SFT) and
    `extra["ops"]` its number of operations (one equation line each), the problem's difficulty. With `slip`
    > 0, that share of the "gives away" steps in the worked solutions are added instead (seeded by `seed`):
    SFT data with a systematic mistake. The questions and ground truths are the same either way."""
    out = []
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    slipper = random.Random(f"slip-{seed}")
    for i, (q, start, ops) in zip(range(size), _unique(split, seed, 0.2)):
        sol, answer = solve(start, ops)
        if slip:  # the SFT target only: the ground truth stays `answer`
            sol = solve(start, ops, lambda: slipper.random() < slip)[0]
        out.append(Sample(messages=system + [{"role": "user", "content": q}], ground_truth=str(answer),
                          data_source=DATA_SOURCE, extra={"answer": sol, "index": i, "ops": sol.count("\n")}))
    return out
