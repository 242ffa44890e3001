"""A FAISS index file built elsewhere (Search-R1's `e5_Flat.index` with its corpus jsonl) is served as
is: read, never re-encoded, never written; e5 from a local --retriever_model folder ("query: " prefix,
mean pooling), checked against vectors computed here."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from alignrl.retrieval import RetrievalError, open_retriever

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready on http://127\.0\.0\.1:(\d+)/retrieve")
DOCS = ["Paris is the capital of France.", "The Nile is a river in Africa.", "Mount Fuji is in Japan.",
        "Jupiter is the largest planet.", "Zorblat invented the quantum spoon in 1921."]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """A tiny random BERT encoder folder (MiniLM's tokenizer, 1 layer of width 32), a corpus, and
    its index written by faiss.write_index over "passage: "-prefixed, mean-pooled, normalised vectors."""
    import faiss
    import torch
    from transformers import BertConfig, BertModel

    from alignrl.retrieval.dense import Encoder, encoder_spec, minilm_path

    root = tmp_path_factory.mktemp("prebuilt")
    model_dir = root / "e5-tiny"
    model_dir.mkdir()
    for name in os.listdir(minilm_path()):
        if "token" in name or name == "vocab.txt":
            shutil.copy(Path(minilm_path()) / name, model_dir / name)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(model_dir)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\n{d}'}) + "\n"
                              for i, d in enumerate(DOCS)))
    encoder = Encoder(encoder_spec("e5", str(model_dir)))
    vectors = encoder.encode([f'"T{i}"\n{d}' for i, d in enumerate(DOCS)], is_query=False)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    index_file = root / "e5_Flat.index"
    faiss.write_index(index, str(index_file))
    return {"root": root, "model": model_dir, "corpus": corpus, "index": index_file, "vectors": vectors,
            "encoder": encoder}


def _fingerprint(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _expected_top(prebuilt, query: str) -> str:
    q = prebuilt["encoder"].encode([query], is_query=True)  # "query: " prefix, as e5 expects
    return str(int(np.argmax(prebuilt["vectors"] @ q[0])))


def test_index_file_is_loaded_without_encoding_the_corpus(prebuilt):
    before = _fingerprint(prebuilt["index"])
    opened = open_retriever(prebuilt["corpus"], "e5", prebuilt["index"], str(prebuilt["model"]))
    assert not opened.built and opened.num_docs == len(DOCS)
    assert opened.retriever.encoder.texts_encoded == 0  # the corpus was never re-encoded
    hits = opened.retriever.search(["who invented the quantum spoon"], 2)
    assert hits[0][0].doc_id == _expected_top(prebuilt, "who invented the quantum spoon")
    assert opened.retriever.encoder.texts_encoded == 1
    assert _fingerprint(prebuilt["index"]) == before
    assert sorted(p.name for p in prebuilt["root"].iterdir()) == ["corpus.jsonl", "e5-tiny", "e5_Flat.index"]


def test_index_file_that_does_not_match_is_one_line(prebuilt, tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(prebuilt["corpus"].read_text().splitlines()[:3]) + "\n")
    with pytest.raises(RetrievalError, match="holds 5 vectors but the corpus has 3 documents"):
        open_retriever(short, "e5", prebuilt["index"], str(prebuilt["model"]))
    with pytest.raises(RetrievalError, match="needs a dense retriever"):
        open_retriever(prebuilt["corpus"], "bm25", prebuilt["index"])
    junk = tmp_path / "junk.index"
    junk.write_bytes(b"not a faiss file")
    with pytest.raises(RetrievalError, match="cannot read FAISS index") as e:
        open_retriever(prebuilt["corpus"], "e5", junk, str(prebuilt["model"]))
    assert "\n" not in str(e.value)


@pytest.mark.timeout(120)
def test_serve_retrieve_with_search_r1_flags_leaves_the_file_untouched(prebuilt, tmp_path):
    before = _fingerprint(prebuilt["index"])
    log = (tmp_path / "out.txt").open("w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", ALIGNRL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "alignrl", "serve", "retrieve", "--index_path",
                             str(prebuilt["index"]), "--corpus_path", str(prebuilt["corpus"]), "--retriever_name", "e5",
                             "--retriever_model", str(prebuilt["model"]), "--topk", "2", "--port", "0"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (m := READY.search((tmp_path / "out.txt").read_text())):
            assert proc.poll() is None, (tmp_path / "out.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, "server not ready in 90 s"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{m.group(1)}/retrieve", timeout=30,
                       json={"queries": ["which river is in Africa"], "topk": 2, "return_scores": True})
        assert r.status_code == 200
        top = r.json()["result"][0][0]["document"]
        assert top["id"] == _expected_top(prebuilt, "which river is in Africa")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert "index loaded" in (tmp_path / "out.txt").read_text()
    assert _fingerprint(prebuilt["index"]) == before  # bytes and mtime
    assert not (tmp_path / "cache").exists()  # nothing built into the cache folder
