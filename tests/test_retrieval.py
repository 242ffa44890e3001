"""Retrieval library: corpus errors, BM25 and dense relevance on the shipped corpus, index reuse."""

import json
import os
import shutil

import pytest

from alignrl.retrieval import SHIPPED_CORPUS, CorpusError, RetrievalError, load_corpus, open_retriever, title_of

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Queries sharing key words with their passage: both retrievers must rank it in the top 3.
KEYWORD_QUERIES = [
    ("which planet is called the red planet", "Mars"),
    ("who wrote the play hamlet", "Hamlet"),
    ("highest mountain in the world", "Mount Everest"),
    ("who invented the telephone", "Telephone"),
    ("what is the capital of australia", "Canberra"),
    ("fastest land animal", "Cheetah"),
    ("who painted the mona lisa", "Mona Lisa"),
    ("deaf composer of nine symphonies", "Ludwig van Beethoven"),
]
# Paraphrases with synonyms ('biggest sea' for 'largest ocean', 'generates energy' for 'powerhouse ...
# produces ATP'): only a model of meaning finds these reliably; BM25 misses several of them.
PARAPHRASE_QUERIES = [
    ("what is the biggest sea on our planet", "Pacific Ocean"),
    ("cellular structure that generates energy", "Mitochondrion"),
    ("the first person to travel into space", "Yuri Gagarin"),
    ("how do green plants make food from sunlight", "Photosynthesis"),
    ("ship that went down after hitting an iceberg", "Titanic"),
    ("small creatures that can live through outer space", "Tardigrade"),
    ("where did the cocoa drink originate", "Chocolate"),
    ("tallest skyscraper on earth", "Burj Khalifa"),
]


def _ranks(retriever, queries):
    """1-based rank of each expected title in the top 3 (0 when absent)."""
    results = retriever.search([q for q, _ in queries], 3)
    ranks = []
    for (_, title), hits in zip(queries, results):
        assert len(hits) == 3 and all(a.score >= b.score for a, b in zip(hits, hits[1:]))
        titles = [title_of(h.contents) for h in hits]
        ranks.append(titles.index(title) + 1 if title in titles else 0)
    return ranks


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    return tmp_path_factory.mktemp("indexes")


@pytest.fixture(scope="module")
def dense_built(index_root):
    return open_retriever(None, "minilm", index_root)


# ---------------------------------------------------------------- corpus

@pytest.mark.parametrize("lines,line_no,fragment", [
    (['{"id": "0", "contents": "a"}', '{"id": "1", "contents": '], 2, "not valid JSON"),
    (['["0", "a"]'], 1, "expected a JSON object"),
    (['{"contents": "a"}'], 1, "missing key 'id'"),
    (['{"id": "0", "text": "a"}'], 1, "missing key 'contents'"),
    (['{"id": "0", "contents": 5}'], 1, "'contents' must be a string"),
    (['{"id": [1], "contents": "a"}'], 1, "'id' must be a string or integer"),
    (['{"id": "0", "contents": "   "}'], 1, "'contents' is empty"),
    (['{"id": "7", "contents": "a"}', "", '{"id": 7, "contents": "b"}'], 3, "duplicate id '7'"),
])
def test_corpus_errors_name_file_and_line(tmp_path, lines, line_no, fragment):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError) as e:
        load_corpus(path)
    msg = str(e.value)
    assert f"{path}:{line_no}:" in msg and fragment in msg and "\n" not in msg


def test_corpus_file_level_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(CorpusError, match="no documents"):
        load_corpus(tmp_path / "empty.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"id": "0", "contents": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"latin1.jsonl:1: not UTF-8"):
        load_corpus(tmp_path / "latin1.jsonl")


def test_shipped_corpus_layout():
    docs = load_corpus(SHIPPED_CORPUS)
    assert 100 <= len(docs) <= 300
    assert len({d.id for d in docs}) == len(docs)
    titles = [title_of(d.contents) for d in docs]
    assert all(titles) and len(set(titles)) == len(titles)  # Search-R1 layout: "Title"\nText
    assert all(d.contents.startswith(f'"{t}"\n') for d, t in zip(docs, titles))
    wanted = {t for _, t in KEYWORD_QUERIES + PARAPHRASE_QUERIES}
    assert wanted <= set(titles)


# ---------------------------------------------------------------- relevance

def test_bm25_finds_keyword_queries(index_root):
    opened = open_retriever(None, "bm25", index_root)
    ranks = _ranks(opened.retriever, KEYWORD_QUERIES)
    assert all(ranks), dict(zip([q for q, _ in KEYWORD_QUERIES], ranks))


def test_dense_finds_keyword_and_paraphrased_queries(dense_built):
    ranks = _ranks(dense_built.retriever, KEYWORD_QUERIES + PARAPHRASE_QUERIES)
    assert all(ranks), ranks
    # Cosine scores of unit vectors: bounded, and the best hit is a clear match.
    hits = dense_built.retriever.search(["highest mountain in the world"], 3)[0]
    assert all(-1.0 <= h.score <= 1.0 + 1e-5 for h in hits) and hits[0].score > 0.5


def test_dense_batches_a_request_in_one_encoder_call(dense_built):
    encoder = dense_built.retriever.encoder
    calls, texts = encoder.calls, encoder.texts_encoded
    dense_built.retriever.search([q for q, _ in PARAPHRASE_QUERIES], 2)
    assert encoder.calls == calls + 1 and encoder.texts_encoded == texts + len(PARAPHRASE_QUERIES)


# ---------------------------------------------------------------- index reuse

def test_dense_index_is_built_once_and_reloaded(index_root, dense_built):
    num_docs = len(load_corpus(SHIPPED_CORPUS))
    assert dense_built.built and dense_built.retriever.encoder.texts_encoded >= num_docs
    index_file = dense_built.folder / "index.faiss"
    stamp = index_file.stat().st_mtime_ns

    again = open_retriever(None, "dense", index_root)  # alias of minilm: same key, same folder
    assert not again.built and again.folder == dense_built.folder
    assert again.retriever.encoder.texts_encoded == 0  # nothing re-encoded
    assert index_file.stat().st_mtime_ns == stamp
    queries = [q for q, _ in PARAPHRASE_QUERIES]
    before = dense_built.retriever.search(queries, 3)
    after = again.retriever.search(queries, 3)
    assert [[h.doc_id for h in r] for r in before] == [[h.doc_id for h in r] for r in after]


def test_index_key_follows_corpus_content_and_retriever(tmp_path):
    corpus = tmp_path / "c.jsonl"
    shutil.copy(SHIPPED_CORPUS, corpus)
    root = tmp_path / "idx"
    first = open_retriever(corpus, "bm25", root)
    assert first.built
    assert not open_retriever(corpus, "bm25", root).built
    with corpus.open("a") as f:  # a changed corpus must not reuse the old index
        f.write(json.dumps({"id": "new", "contents": '"Zanzibar"\nZanzibar is an archipelago off Tanzania.'}) + "\n")
    changed = open_retriever(corpus, "bm25", root)
    assert changed.built and changed.folder != first.folder
    assert title_of(changed.retriever.search(["zanzibar archipelago"], 1)[0][0].contents) == "Zanzibar"
    # A half-written folder (no manifest) is rebuilt, not trusted.
    (changed.folder / "manifest.json").unlink()
    assert open_retriever(corpus, "bm25", root).built


def test_default_index_root_follows_alignrl_cache(monkeypatch, tmp_path):
    from alignrl.retrieval import default_index_root

    monkeypatch.setenv("ALIGNRL_CACHE", str(tmp_path))
    assert default_index_root() == tmp_path / "retrieval"
    monkeypatch.delenv("ALIGNRL_CACHE")
    assert default_index_root().parts[-3:] == (".cache", "alignrl", "retrieval")


def test_topk_larger_than_corpus_is_clamped(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": f'"T{i}"\nword{i} shared'}) + "\n" for i in range(3)))
    hits = open_retriever(corpus, "bm25", tmp_path / "idx").retriever.search(["shared", "nothing matches", "word1"], 10)
    # only documents that match a word, as Lucene returns them (bm25s filled k with unrelated score-0 documents)
    assert [len(h) for h in hits] == [3, 0, 1] and hits[2][0].doc_id == "1"
    assert {h.doc_id for h in hits[0]} == {"0", "1", "2"}


def test_a_mistyped_faiss_file_is_one_line_not_a_build(tmp_path):
    with pytest.raises(RetrievalError, match="no such FAISS index file"):
        open_retriever(None, "e5", tmp_path / "e5_Flaat.index")
    assert not (tmp_path / "e5_Flaat.index").exists()


def test_bad_retriever_settings_are_one_line_errors(tmp_path):
    with pytest.raises(RetrievalError, match="unknown retriever 'colbert'"):
        open_retriever(None, "colbert", tmp_path)
    with pytest.raises(RetrievalError, match="cannot load the minilm encoder") as e:
        open_retriever(None, "minilm", tmp_path, model=str(tmp_path / "no-such-model"))
    assert "\n" not in str(e.value)
