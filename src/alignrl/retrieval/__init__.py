"""Retrieval for search-augmented rollouts (Search-R1): a jsonl corpus, BM25 or dense search, saved indexes.

The HTTP service lives in `alignrl.serve.retrieve`; this package has no web code. Heavy libraries
(torch, transformers, faiss, bm25s) are imported only when an index is built or loaded.
"""

from alignrl.retrieval.corpus import (SHIPPED_CORPUS, CorpusError, Document, Hit, RetrievalError, Retriever,
                                      load_corpus, title_of)
from alignrl.retrieval.index import RETRIEVERS, OpenedIndex, default_index_root, open_retriever

__all__ = ["SHIPPED_CORPUS", "CorpusError", "Document", "Hit", "RetrievalError", "Retriever", "load_corpus", "title_of",
           "RETRIEVERS", "OpenedIndex", "default_index_root", "open_retriever"]
