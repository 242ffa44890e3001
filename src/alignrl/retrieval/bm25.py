"""BM25 retrieval over a corpus with `bm25s` (sparse, CPU, no model).

Tokenisation is ours so that the index and the queries are guaranteed to go through the same
function: lowercase word tokens, English stop words removed, and a light plural/suffix stripper
(no Snowball dependency). Deliberately left out: other languages, phrase or field boosts, and the
numba/JAX backends of bm25s; a per-node RL retrieval server over a modest corpus does not need them.
"""

from __future__ import annotations

import re
from pathlib import Path

from alignrl.retrieval.corpus import CorpusError, Document, Hit

_WORD = re.compile(r"(?u)\b\w\w+\b")
TOKENIZER_VERSION = "words-en-light1"  # part of the index key: changing tokenisation must rebuild


def _stopwords() -> frozenset[str]:
    from bm25s.tokenization import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def light_stem(word: str) -> str:
    """Strip common English inflections so 'rivers'/'river', 'invented'/'invent' meet.

    Conservative on purpose: short words and '-ss' words are left alone, so it rarely merges
    unrelated words; recall gains on paraphrased queries matter more than linguistic accuracy.
    """
    if len(word) <= 3 or word.isdigit():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            return word[: -len(suffix)]
    if word.endswith(("sses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def tokenize(text: str, stopwords: frozenset[str]) -> list[str]:
    return [light_stem(w) for w in _WORD.findall(text.lower()) if w not in stopwords]


class BM25Retriever:
    """`bm25s.BM25` plus the corpus it was built from (ids and contents are returned with each hit)."""

    name = "bm25"

    def __init__(self, docs: list[Document], model) -> None:
        self.docs = docs
        self._model = model
        self._stop = _stopwords()

    @classmethod
    def build(cls, docs: list[Document], k1: float = 1.2, b: float = 0.75) -> "BM25Retriever":
        import bm25s

        stop = _stopwords()
        tokens = [tokenize(d.contents, stop) for d in docs]
        if not any(tokens):  # bm25s fails on an empty vocabulary with a bare "max() arg is an empty sequence"
            raise CorpusError(f"the corpus's {len(docs)} document(s) hold no indexable word (every word is a stop "
                              "word or one character long): give it real text, or use a dense retriever")
        model = bm25s.BM25(k1=k1, b=b)
        model.index(tokens, show_progress=False)
        return cls(docs, model)

    def save(self, folder: Path) -> None:
        # bm25s writes numpy arrays and JSON only (allow_pickle=False): safe to load back.
        self._model.save(str(folder), show_progress=False)

    @classmethod
    def load(cls, folder: Path, docs: list[Document]) -> "BM25Retriever":
        import bm25s

        model = bm25s.BM25.load(str(folder), allow_pickle=False, mmap=False, load_corpus=False)
        return cls(docs, model)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        k = min(topk, len(self.docs))  # bm25s refuses k larger than the corpus
        tokens = [tokenize(q, self._stop) for q in queries]
        # Unknown query words are dropped by bm25s; a query with none left scores every document 0.
        idx, scores = self._model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        # only documents that match a query word, as Lucene (Search-R1's BM25) returns: bm25s fills k with
        # score-0 documents, which would show the policy unrelated passages for "the" or an empty query
        return [[Hit(self.docs[int(i)].id, self.docs[int(i)].contents, float(s)) for i, s in zip(row_i, row_s) if s > 0]
                for row_i, row_s in zip(idx, scores)]
