"""Build a retriever's index once, save it to a folder, and load it on later starts.

The folder is keyed by a hash of the corpus bytes and the retriever settings
(`<root>/<retriever>-<key>/`), so a changed corpus, retriever, encoder or tokeniser builds a new index
while an unchanged one is only loaded. Builds go to a temporary folder renamed into place, so several
servers starting together on one node never read a half-written index. Deliberately left out: garbage
collection of stale keyed folders and incremental updates (any corpus change is a full rebuild).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from alignrl.retrieval.corpus import SHIPPED_CORPUS, Document, RetrievalError, Retriever, file_digest, load_corpus
from alignrl.utils.progress import Phase

FORMAT_VERSION = 1
DENSE = ("minilm", "e5")
ALIASES = {"dense": "minilm"}
RETRIEVERS = ("bm25",) + DENSE
MANIFEST = "manifest.json"


def default_index_root() -> Path:
    base = os.environ.get("ALIGNRL_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "alignrl") / "retrieval"


def canonical_name(name: str) -> str:
    name = ALIASES.get(name.lower(), name.lower())
    if name not in RETRIEVERS:
        raise RetrievalError(f"unknown retriever {name!r}; choose one of {', '.join(RETRIEVERS)} (or 'dense' = minilm)")
    return name


@dataclass(frozen=True)
class IndexSettings:
    """Everything that changes the saved index; its JSON (plus the corpus hash) is the key."""
    retriever: str
    model: str = ""              # dense: encoder folder/id; bm25: ''
    model_fingerprint: str = ""  # dense: names and sizes of the weight files, so new weights rebuild
    params: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


@dataclass
class OpenedIndex:
    retriever: Retriever
    folder: Path
    built: bool       # False when loaded from an earlier build
    seconds: float    # build or load time, corpus read included
    num_docs: int


def _model_fingerprint(model: str) -> str:
    folder = Path(model)
    if not folder.is_dir():
        return model  # a cache id: the name is all we can key on without resolving the cache
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    return ";".join(f"{p.relative_to(folder)}:{p.stat().st_size}" for p in files)


def settings_for(name: str, model: str | None = None) -> IndexSettings:
    name = canonical_name(name)
    if name == "bm25":
        from alignrl.retrieval.bm25 import TOKENIZER_VERSION

        return IndexSettings("bm25", params={"k1": 1.2, "b": 0.75, "tokenizer": TOKENIZER_VERSION})
    from alignrl.retrieval.dense import encoder_spec

    spec = encoder_spec(name, model)
    return IndexSettings(name, spec.model, _model_fingerprint(spec.model),
                         params={"query_prefix": spec.query_prefix, "passage_prefix": spec.passage_prefix,
                                 "max_length": spec.max_length, "pooling": "mean", "normalize": True,
                                 "index": "IndexFlatIP"})


def index_key(corpus_digest: str, settings: IndexSettings) -> str:
    blob = json.dumps({"corpus_sha256": corpus_digest, "settings": asdict(settings)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _build(settings: IndexSettings, docs: list[Document], folder: Path, faiss_gpu: bool) -> Retriever:
    # a bar over the documents on a terminal (a dense index encodes them chunk by chunk: minutes on a large
    # corpus); the caller logs the build's seconds
    with Phase(f"{settings.retriever} index", len(docs), "documents", say=False) as progress:
        if settings.retriever == "bm25":
            from alignrl.retrieval.bm25 import BM25Retriever

            r = BM25Retriever.build(docs, k1=settings.params["k1"], b=settings.params["b"])
            progress.advance(len(docs))
        else:
            from alignrl.retrieval.dense import DenseRetriever, Encoder, encoder_spec

            r = DenseRetriever.build(docs, Encoder(encoder_spec(settings.retriever, settings.model)), faiss_gpu,
                                     progress=progress.advance)
    r.save(folder)
    return r


def _load(settings: IndexSettings, docs: list[Document], folder: Path, faiss_gpu: bool) -> Retriever:
    if settings.retriever == "bm25":
        from alignrl.retrieval.bm25 import BM25Retriever

        return BM25Retriever.load(folder, docs)
    from alignrl.retrieval.dense import DenseRetriever, Encoder, encoder_spec

    return DenseRetriever.load(folder, docs, Encoder(encoder_spec(settings.retriever, settings.model)), faiss_gpu)


def _is_complete(folder: Path, key: str) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def open_retriever(corpus_path: str | Path | None = None, retriever_name: str = "minilm",
                   index_root: str | Path | None = None, model: str | None = None, faiss_gpu: bool = False,
                   log: Callable[[str], None] = lambda _: None) -> OpenedIndex:
    """Load the saved index for (corpus, settings) if there is one, else build and save it. An
    `index_root` that is a file is a FAISS index built elsewhere (Search-R1's `e5_Flat.index`): it is
    loaded as is, never rebuilt and never written."""
    start = time.perf_counter()
    corpus_path = Path(corpus_path) if corpus_path else SHIPPED_CORPUS
    settings = settings_for(retriever_name, model)
    docs = load_corpus(corpus_path)
    if index_root is not None and Path(index_root).is_file():
        if settings.retriever not in DENSE:
            raise RetrievalError(f"--index_path {index_root} is a FAISS index file, which needs a dense retriever "
                                 f"(--retriever_name {' or '.join(DENSE)}), not {settings.retriever}")
        from alignrl.retrieval.dense import DenseRetriever, Encoder, encoder_spec

        encoder = Encoder(encoder_spec(settings.retriever, settings.model))
        retriever = DenseRetriever.from_index_file(Path(index_root), docs, encoder, faiss_gpu)
        log(f"loaded FAISS index {index_root} ({len(docs)} documents; read only)")
        return OpenedIndex(retriever, Path(index_root), False, time.perf_counter() - start, len(docs))
    if index_root is not None and Path(index_root).suffix == ".index" and not Path(index_root).exists():
        # a mistyped FAISS file: building a folder of that name would encode the whole corpus (hours on wiki-18)
        raise RetrievalError(f"--index_path {index_root}: no such FAISS index file; give the path of the one "
                             "built for this corpus (Search-R1's e5_Flat.index), or a folder for indexes built here")
    key = index_key(file_digest(corpus_path), settings)
    root = Path(index_root) if index_root else default_index_root()
    folder = root / f"{settings.retriever}-{key}"
    if _is_complete(folder, key):
        retriever = _load(settings, docs, folder, faiss_gpu)
        log(f"loaded {settings.retriever} index of {len(docs)} documents from {folder}")
        return OpenedIndex(retriever, folder, False, time.perf_counter() - start, len(docs))

    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise RetrievalError(f"cannot write the index under {root} ({e.strerror}); "
                             "pass --index_path to a writable folder") from None
    log(f"building {settings.retriever} index of {len(docs)} documents from {corpus_path} (once; saved to {folder})")
    try:
        retriever = _build(settings, docs, tmp, faiss_gpu)
        manifest = {"key": key, "corpus": str(corpus_path), "num_docs": len(docs), "settings": asdict(settings)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if folder.exists() and not _is_complete(folder, key):
            shutil.rmtree(folder, ignore_errors=True)  # a broken earlier build: replace it
        try:
            os.rename(tmp, folder)
        except OSError:
            pass  # another process finished the same build first; its index is identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return OpenedIndex(retriever, folder, True, time.perf_counter() - start, len(docs))
