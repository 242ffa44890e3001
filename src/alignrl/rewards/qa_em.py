"""Exact-match rewards for open-domain QA with search (Search-R1).

Semantics follow Search-R1 (Jin et al. 2025, "Search-R1: Training LLMs to Reason and Leverage
Search Engines with Reinforcement Learning"; github.com/PeterGriffinJin/Search-R1,
`verl/utils/reward_score/qa_em.py` and `qa_em_format.py`), reimplemented here:

- `normalize_answer`: SQuAD-style normalisation (lowercase, drop punctuation, drop the articles
  a/an/the, collapse whitespace), applied to the prediction and to every target.
- `compute_score`: 1 if the last `<answer>...</answer>` equals any target after normalisation, else
  `format_score` (0 by default); 0 if there is no answer tag.
- `compute_score_tag_capped`: verl's Search-R1-like variant (`search_r1_like_qa_em`, data sources
  `searchR1_<set>`): the same exact match, but a response with more than 10 opening or closing answer
  tags earns a quarter of `score` (against answer-tag spraying).
- `compute_score_format`: the variant that also grades the trajectory's structure
  (`<think>`/`<search>`/`<information>`/`<answer>` in Search-R1's order), so a well-formed but wrong
  trajectory earns `structure_format_score` instead of 0.

One deliberate difference: Search-R1 scores the decoded prompt + response, whose prompt already
holds an example `<answer>` tag, so it ignores a text with fewer than two tags. alignrl passes the
response alone, so one tag is enough; the last one still wins.

Ground truth may be `{"target": [...]}` (Search-R1's parquet layout), a list/tuple/array of strings,
or one string. Pure Python, so it is cheap to call from any worker thread or process.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

MAX_ANSWER_TAGS = 10  # verl's Search-R1-like reward quarters a correct answer written among more tags
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION_RE = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_TAG_RE = re.compile(r"(</?(?:think|search|information|answer)>)")

# Search-R1's is_valid_sequence as a transition table: (state, tag) -> next state. A trajectory is
# think -> (search -> information -> think)* -> answer, with only whitespace between blocks.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_INSIDE = frozenset({"in_think", "in_search", "in_information", "in_answer"})


def normalize_answer(s: str) -> str:
    """Lowercase, remove punctuation, remove articles, collapse whitespace (Search-R1 / SQuAD order:
    punctuation goes before articles, so "the," loses its comma and then the article)."""
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES_RE.sub(" ", text).split())


def targets(ground_truth: Any) -> list[str]:
    """The reference answers as a list of strings, from `{"target": [...]}`, a sequence, or a string.
    Parquet loads a list column as a numpy array, hence any non-string iterable is accepted."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(f"ground_truth dict has no 'target' key (keys: {sorted(ground_truth)})")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, (str, bytes)):
        return [ground_truth.decode() if isinstance(ground_truth, bytes) else ground_truth]
    if isinstance(ground_truth, Iterable):
        return [str(t) for t in ground_truth]
    return [str(ground_truth)]  # a bare number such as a year


def em_check(prediction: str, golden_answers: Any) -> bool:
    """True when `prediction` equals any target after `normalize_answer`."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(t) == pred for t in targets(golden_answers))


def extract_answer(solution_str: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>`; None when there is none."""
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def is_valid_sequence(text: str) -> bool:
    """Search-R1's format check: balanced tags in the order think -> (search -> information ->
    think)* -> answer, nothing but whitespace outside the blocks, and nothing after `</answer>`."""
    for tag in ("think", "search", "information", "answer"):
        if text.count(f"<{tag}>") != text.count(f"</{tag}>"):
            return False
    state = "start"
    for part in _TAG_RE.split(text):
        if not part.strip():
            continue
        if _TAG_RE.fullmatch(part):
            state = _TRANSITIONS.get((state, part), "")
            if not state:
                return False
        elif state not in _INSIDE:  # free text between blocks or after the answer
            return False
    return state == "end"


def retrieval_correct(text: str, golden_answers: Any) -> bool:
    """True when some normalised target occurs inside a normalised `<information>` block."""
    blocks = [normalize_answer(b) for b in _INFORMATION_RE.findall(text)]
    return any(normalize_answer(t) in b for b in blocks for t in targets(golden_answers))


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """Search-R1's `compute_score_em`: `score` on an exact match, `format_score` on a wrong answer,
    0 without an answer tag."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return float(score) if em_check(answer, ground_truth) else float(format_score)


def compute_score_tag_capped(solution_str: str, ground_truth: Any, format_score: float = 0.0,
                             score: float = 1.0) -> float:
    """verl's `search_r1_like_qa_em.compute_score`: `compute_score`, with a correct answer among more than
    `MAX_ANSWER_TAGS` `<answer>` or `</answer>` tags earning `score / 4`."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, ground_truth):
        return float(format_score)
    sprayed = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > MAX_ANSWER_TAGS
    return float(score) / 4 if sprayed else float(score)


def compute_score_format(solution_str: str, ground_truth: Any, structure_format_score: float = 0.2,
                         final_format_score: float = 0.1, retrieval_score: float = 0.0,
                         score: float = 1.0) -> float:
    """Search-R1's `qa_em_format.compute_score_em`: EM with partial credit for form.

    correct + well-formed: `score`; correct, ill-formed: `score - structure_format_score`;
    wrong or no answer + well-formed: `structure_format_score` (+ `retrieval_score` when a retrieved
    passage contains a target); wrong answer, ill-formed: `final_format_score`; no answer, ill-formed: 0.
    The defaults for the three partial credits are this module's choice (Search-R1's function
    defaults them to 0, which makes it plain EM); pass 0 to get that back.
    """
    valid = is_valid_sequence(solution_str)
    answer = extract_answer(solution_str)
    if answer is not None and em_check(answer, ground_truth):
        return float(score) if valid else float(score - structure_format_score)
    if valid:
        bonus = retrieval_score if retrieval_score and retrieval_correct(solution_str, ground_truth) else 0.0
        return float(structure_format_score + bonus)
    return 0.0 if answer is None else float(final_format_score)
