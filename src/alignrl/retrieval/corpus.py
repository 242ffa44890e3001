"""Loading a retrieval corpus: one JSON object per line with `id` and `contents` (Search-R1's layout).

`contents` is conventionally `"Title"\\nText...`; nothing here depends on that, the title split is only a
convenience for display. Deliberately left out: sharded corpora, compressed files, other field names
(`text`, `title` as separate keys) and streaming; a corpus is read whole into memory, which suits the
sizes a per-node retrieval server for RL rollouts holds on CPU.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SHIPPED_CORPUS = Path(__file__).parent / "data" / "wiki_small.jsonl"


class RetrievalError(ValueError):
    """A user-fixable retrieval problem (corpus, model, index, flags); the message is one line."""


class CorpusError(RetrievalError):
    """Bad corpus file; the message is one line naming file:line and the fix."""


@dataclass(frozen=True)
class Document:
    id: str        # unique within the corpus; ints in the file are kept as their decimal string
    contents: str  # returned verbatim to the client


@dataclass(frozen=True)
class Hit:
    doc_id: str
    contents: str
    score: float   # higher is better; inner product (dense, normalised: cosine) or BM25 score


class Retriever(Protocol):
    """What the server needs from a retriever. One call per request: queries are batched together."""

    name: str

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Per query, at most `topk` hits, best first (fewer only when the corpus is smaller)."""
        ...


def title_of(contents: str) -> str:
    """The `"Title"` part of a Search-R1 passage (first line without quotes), or '' when absent."""
    first = contents.split("\n", 1)[0].strip()
    return first[1:-1] if len(first) >= 2 and first[0] == first[-1] == '"' else ""


def _document(path: Path, lineno: int, line: str) -> Document:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                          "each line must be one object like {\"id\": \"0\", \"contents\": \"...\"}") from None
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object with 'id' and 'contents', got {type(obj).__name__}")
    missing = [k for k in ("id", "contents") if k not in obj]
    if missing:
        raise CorpusError(f"{where}: missing key {missing[0]!r}; each line needs 'id' and 'contents'")
    doc_id, contents = obj["id"], obj["contents"]
    # bool is an int subclass; an id of `true` is almost certainly a mistake in the file.
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise CorpusError(f"{where}: 'id' must be a string or integer, got {type(doc_id).__name__}")
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: 'contents' must be a string, got {type(contents).__name__}")
    if not contents.strip():
        raise CorpusError(f"{where}: 'contents' is empty; remove the line or give the passage text")
    return Document(id=str(doc_id), contents=contents)


def load_corpus(path: str | Path) -> list[Document]:
    """Read every document of a jsonl corpus, in file order. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist; pass --corpus_path to a jsonl file "
                          "with one {\"id\", \"contents\"} object per line")
    docs: list[Document] = []
    seen: dict[str, int] = {}
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            doc = _document(path, lineno, line)
            if doc.id in seen:
                raise CorpusError(f"{path}:{lineno}: duplicate id {doc.id!r} (first on line {seen[doc.id]}); "
                                  "ids must be unique")
            seen[doc.id] = lineno
            docs.append(doc)
    if not docs:
        raise CorpusError(f"{path}: no documents; the corpus needs at least one {{\"id\", \"contents\"}} line")
    return docs


def file_digest(path: str | Path) -> str:
    """sha256 of the file's bytes: the corpus part of an index key (content, not path or mtime)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
