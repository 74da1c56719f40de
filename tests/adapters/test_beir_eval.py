"""BEIR evaluation: the folder reader and its counts, the metrics against hand-computed values,
the chunked exact search against a full float64 argsort, and the end-to-end evaluation (in
process and through the command) against an independent materialized reference."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ds_infcl.adapters.beir_eval import (
    BeirData,
    TokenizingEmbedder,
    beir_metrics,
    evaluate_beir,
    exact_search,
    load_beir,
    load_encoder,
    main,
)
from ds_infcl.adapters.retrieval import RetrievalEncoders, load_sentence_transformer
from ds_infcl.adapters.retrieval_eval import retrieval_metrics
from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ----------------------------------------------------------------------------------------------
# A small BEIR folder written at test time
# ----------------------------------------------------------------------------------------------

NUM_DOCS = 30
TITLED = {0, 3, 7, 11, 20}            # documents with a non-empty title
NULL_TITLE = {5}                     # "title": null
NO_TITLE_KEY = {6}                   # no "title" key at all
# q0..q5 and "d4" (a query whose id is also a document id, as in ArguAna) are evaluated;
# q6 has only score-0 judgments (skipped); q7 is in queries.jsonl but not in the split.
QRELS = [
    ("q0", "d1", 2), ("q0", "d2", 1), ("q0", "d3", 0),
    ("q1", "d10", 1),
    ("q2", "d12", 2), ("q2", "d13", 2), ("q2", "d14", 1), ("q2", "d999", 1),  # d999: unknown document
    ("q3", "d15", 1), ("q3", "d16", 1),
    ("q4", "d20", 3),
    ("q5", "d25", 1), ("q5", "d26", 0),
    ("d4", "d8", 1),
    ("q6", "d9", 0), ("q6", "d17", 0),                                        # no relevant document
    ("qX", "d1", 1),                                                          # unknown query
]
QUERY_IDS = ["q0", "q1", "q2", "q3", "q4", "q5", "d4", "q6", "q7"]


def write_beir(folder, *, qrels=QRELS, header=True):
    texts = random_texts(NUM_DOCS + len(QUERY_IDS), seed=11, min_words=3, max_words=9)
    os.makedirs(os.path.join(folder, "qrels"), exist_ok=True)
    docs = []
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        for i in range(NUM_DOCS):
            row = {"_id": f"d{i}", "title": "", "text": texts[i]}
            if i in TITLED:
                row["title"] = f"title {i}"
            if i in NULL_TITLE:
                row["title"] = None
            if i in NO_TITLE_KEY:
                del row["title"]
            docs.append(row)
            f.write(json.dumps(row) + "\n")
        f.write("\n")  # a blank line is allowed
    queries = {}
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        for j, qid in enumerate(QUERY_IDS):
            queries[qid] = texts[NUM_DOCS + j]
            f.write(json.dumps({"_id": qid, "text": queries[qid], "metadata": {}}) + "\n")
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        if header:
            f.write("query-id\tcorpus-id\tscore\n")
        for q, d, s in qrels:
            f.write(f"{q}\t{d}\t{s}\n")
    return docs, queries


@pytest.fixture(scope="module")
def beir_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("beir") / "toy")
    write_beir(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("model") / "tiny"))


# ----------------------------------------------------------------------------------------------
# load_beir
# ----------------------------------------------------------------------------------------------


def test_load_beir_reads_and_counts(beir_dir):
    with pytest.warns(UserWarning, match="1 judgment lines name query ids.*1 name document ids"):
        data = load_beir(beir_dir)
    assert data.query_ids == ["q0", "q1", "q2", "q3", "q4", "q5", "d4"]
    assert data.counts == {
        "num_documents": 30, "num_queries": 7, "num_qrels": len(QRELS),
        "skipped_queries_without_relevant": 1, "unknown_query_qrels": 1, "unknown_document_qrels": 1,
        "queries_not_in_split": 1,
    }
    raw = [json.loads(line) for line in open(os.path.join(beir_dir, "corpus.jsonl")) if line.strip()]
    assert data.document_ids == [r["_id"] for r in raw]
    for i, r in enumerate(raw):
        expected = f"title {i} {r['text']}" if i in TITLED else r["text"]
        assert data.document_texts[i] == expected
    assert data.qrels["q2"] == {"d12": 2, "d13": 2, "d14": 1, "d999": 1}  # kept, as pytrec_eval keeps it
    assert "q6" not in data.qrels and "qX" not in data.qrels
    with pytest.warns(UserWarning, match="dropped"):
        dropped = load_beir(beir_dir, drop_unknown_documents=True)
    assert dropped.qrels["q2"] == {"d12": 2, "d13": 2, "d14": 1}
    assert dropped.counts["unknown_document_qrels"] == 1


def test_load_beir_header_optional_and_all_unknown_skipped(tmp_path):
    folder = str(tmp_path / "b")
    write_beir(folder, qrels=[("q0", "d1", 1), ("q1", "d999", 1)], header=False)
    with pytest.warns(UserWarning):
        data = load_beir(folder, drop_unknown_documents=True)
    # the first line is data when it is not the header; q1's only relevant document was dropped
    assert data.query_ids == ["q0"]
    assert data.counts["skipped_queries_without_relevant"] == 1
    assert data.counts["num_qrels"] == 2
    # a header with other column names is still a header (its score is not a number)
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        f.write("qid\tdocid\trelevance\nq0\td1\t1\n")
    assert load_beir(folder).counts["num_qrels"] == 1


def _corrupt(folder, name, line_no, text):
    path = os.path.join(folder, name)
    lines = open(path).read().splitlines(keepends=True)
    lines[line_no - 1] = text
    with open(path, "w") as f:
        f.writelines(lines)


@pytest.mark.parametrize("name,line_no,text,match", [
    ("corpus.jsonl", 3, "{bad json\n", r"corpus\.jsonl:3: not valid JSON"),
    ("corpus.jsonl", 4, '{"title": "t", "text": "no id"}\n', r"corpus\.jsonl:4: '_id' must be"),
    ("corpus.jsonl", 5, '{"_id": "d1", "text": "again"}\n', r"corpus\.jsonl:5: _id 'd1' repeats the one of line 2"),
    ("corpus.jsonl", 2, '{"_id": "d1", "text": 7}\n', r"corpus\.jsonl:2: 'text' must be a string"),
    ("corpus.jsonl", 2, '["d1", "text"]\n', r"corpus\.jsonl:2: expected a JSON object"),
    ("queries.jsonl", 2, '{"_id": "q1"}\n', r"queries\.jsonl:2: 'text' must be a string"),
    (os.path.join("qrels", "test.tsv"), 4, "q0\td2\n", r"test\.tsv:4: expected 3 tab-separated fields"),
    (os.path.join("qrels", "test.tsv"), 5, "q1\td10\thigh\n", r"test\.tsv:5: score must be an integer"),
    (os.path.join("qrels", "test.tsv"), 5, "q1\td10\t1.5\n", r"test\.tsv:5: score must be an integer"),
    (os.path.join("qrels", "test.tsv"), 5, "q0\td1\t1\n", r"test\.tsv:5: \('q0', 'd1'\) graded 1, but line 2"),
])
def test_load_beir_malformed_lines_name_file_and_line(tmp_path, name, line_no, text, match):
    folder = str(tmp_path / "b")
    write_beir(folder)
    _corrupt(folder, name, line_no, text)
    with pytest.raises(ValueError, match=match):
        load_beir(folder)


def test_load_beir_missing_files(tmp_path):
    folder = str(tmp_path / "b")
    write_beir(folder)
    with pytest.raises(ValueError, match=r"no qrels/dev\.tsv; splits found: test; pass split="):
        load_beir(folder, split="dev")
    os.remove(os.path.join(folder, "queries.jsonl"))
    with pytest.raises(ValueError, match=r"has no queries\.jsonl"):
        load_beir(folder)
    with pytest.raises(ValueError, match="is not a directory"):
        load_beir(str(tmp_path / "nowhere"))
    only_zero = str(tmp_path / "z")
    write_beir(only_zero, qrels=[("q0", "d1", 0)])
    with pytest.raises(ValueError, match="no query of split 'test' has a relevant document"):
        load_beir(only_zero)


# ----------------------------------------------------------------------------------------------
# beir_metrics against hand-computed values
# ----------------------------------------------------------------------------------------------


def test_beir_metrics_hand_computed():
    qrels = {
        "qa": {"d1": 2, "d2": 1, "d3": 0, "d9": 1},  # d9 is judged but never retrieved
        "qb": {"d5": 1},
        "qc": {"d7": 0},                             # no relevant document: left out of the means
    }
    ranked = {"qa": ["d3", "d1", "d4", "d2"], "qb": ["d4", "d6", "d8"], "qc": ["d7"], "qz": ["d1"]}
    got = beir_metrics(ranked, qrels, ks=(1, 3))
    assert sorted(got) == sorted(f"{m}@{k}" for m in ("ndcg", "mrr", "recall") for k in (1, 3, 10, 100))
    # qa: gains by rank [0, 2, 0, 1]; ideal grades [2, 1, 1]; discount 1/log2(rank + 1); qb: no hit
    idcg3 = 2 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    expected = {
        "ndcg@1": 0.0,
        "ndcg@3": (2 / math.log2(3)) / idcg3 / 2,
        "ndcg@10": (2 / math.log2(3) + 1 / math.log2(5)) / idcg3 / 2,
        "ndcg@100": (2 / math.log2(3) + 1 / math.log2(5)) / idcg3 / 2,
        "mrr@1": 0.0, "mrr@3": 0.5 / 2, "mrr@10": 0.5 / 2, "mrr@100": 0.5 / 2,
        "recall@1": 0.0, "recall@3": (1 / 3) / 2, "recall@10": (2 / 3) / 2, "recall@100": (2 / 3) / 2,
    }
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name


def test_beir_metrics_graded_ideal_and_cutoff_below_relevant_count():
    # 3 relevant documents, k = 1: recall's denominator stays 3 (pytrec_eval), the ideal at k = 1
    # is the highest grade (3), and gains are linear in the grade (not 2**grade - 1)
    qrels = {"q": {"a": 1, "b": 3, "c": 2}}
    got = beir_metrics({"q": ["c", "a", "b"]}, qrels, ks=(1, 2))
    assert got["recall@1"] == pytest.approx(1 / 3)
    assert got["ndcg@1"] == pytest.approx(2 / 3)
    assert got["ndcg@2"] == pytest.approx((2 + 1 / math.log2(3)) / (3 + 2 / math.log2(3)))
    assert got["mrr@1"] == 1.0
    assert got["ndcg@10"] == pytest.approx((2 + 1 / math.log2(3) + 3 / 2) / (3 + 2 / math.log2(3) + 1 / 2))


def test_beir_metrics_errors():
    with pytest.raises(ValueError, match="ranked lacks 1 of the 2 judged queries"):
        beir_metrics({"a": ["x"]}, {"a": {"x": 1}, "b": {"y": 1}})
    with pytest.raises(ValueError, match="lists a document more than once"):
        beir_metrics({"a": ["x", "x"]}, {"a": {"x": 1}})
    with pytest.raises(ValueError, match="no query with a relevant document"):
        beir_metrics({"a": ["x"]}, {"a": {"x": 0}})
    with pytest.raises(ValueError, match="every k in ks must be a positive integer"):
        beir_metrics({"a": ["x"]}, {"a": {"x": 1}}, ks=(0,))


def test_beir_metrics_binary_matches_retrieval_metrics():
    """With binary relevance both modules define the same NDCG/MRR/Recall (retrieval_metrics is
    checked number for number against sentence-transformers' evaluator)."""
    g = torch.Generator().manual_seed(3)
    q, d = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(41, 6, generator=g, dtype=torch.float64)
    relevant = [set(torch.randperm(41, generator=g)[: 1 + i % 4].tolist()) for i in range(9)]
    ref = retrieval_metrics(q, d, relevant, ndcg_at=(10,), mrr_at=(10,), recall_at=(1, 10, 100))
    _, idx = exact_search(q, d, 100, chunk_size=8)
    ranked = {f"q{i}": [f"d{j}" for j in row] for i, row in enumerate(idx.tolist())}
    qrels = {f"q{i}": {f"d{j}": 1 for j in rel} for i, rel in enumerate(relevant)}
    got = beir_metrics(ranked, qrels, ks=(1,))
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name


# ----------------------------------------------------------------------------------------------
# exact_search against a full float64 argsort
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_q,num_d,c,k,chunk,q_chunk", [
    (1, 1, 3, 5, 1, None),     # one query, one document, k > D
    (7, 30, 16, 40, 7, None),  # k > D, chunks of 7 do not divide 30
    (5, 31, 8, 4, 30, 2),      # last chunk of 1 document, query blocks of 2 (last of 1)
    (13, 50, 5, 10, 64, 4),    # one chunk larger than the corpus
    (4, 23, 72, 23, 5, None),  # k == D
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_exact_search_matches_full_argsort(num_q, num_d, c, k, chunk, q_chunk, dtype):
    g = torch.Generator().manual_seed(num_q * 100 + num_d)
    q = torch.randn(num_q, c, generator=g, dtype=torch.float64).to(dtype)
    d = torch.randn(num_d, c, generator=g, dtype=torch.float64).to(dtype)
    scores, idx = exact_search(q, d, k, chunk, query_chunk_size=q_chunk)
    full = q.double() @ d.double().T
    ref_idx = torch.argsort(full, dim=1, descending=True)[:, : min(k, num_d)]
    assert idx.shape == scores.shape == (num_q, min(k, num_d))
    assert scores.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(idx, ref_idx)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(scores.double(), full.gather(1, ref_idx), atol=tol, rtol=tol)


def test_exact_search_no_queries_and_errors():
    d = torch.randn(5, 4)
    scores, idx = exact_search(torch.randn(0, 4), d, 3, 2)
    assert scores.shape == idx.shape == (0, 3)
    with pytest.raises(ValueError, match="queries have 3 features but documents 4"):
        exact_search(torch.randn(2, 3), d, 3)
    with pytest.raises(ValueError, match="must be 2-D"):
        exact_search(torch.randn(3), d, 3)
    with pytest.raises(ValueError, match="corpus must not be empty"):
        exact_search(torch.randn(2, 4), torch.randn(0, 4), 3)
    bad = d.clone()
    bad[1, 2] = float("nan")
    bad[4, 0] = float("inf")
    with pytest.raises(ValueError, match="d_emb: 2 of 5 rows hold NaN or Inf"):
        exact_search(torch.randn(2, 4), bad, 3)
    with pytest.raises(ValueError, match="k must be a positive integer, got 0"):
        exact_search(torch.randn(2, 4), d, 0)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        exact_search(torch.randn(2, 4), d, 3, 0)
    with pytest.raises(ValueError, match="must be floating point"):
        exact_search(torch.ones(2, 4, dtype=torch.long), d, 3)


def test_exact_search_faiss_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError
    with pytest.raises(ImportError, match=r"use_faiss=True needs the faiss package \(pip install faiss-cpu"):
        exact_search(torch.randn(2, 4), torch.randn(5, 4), 3, use_faiss=True)


# ----------------------------------------------------------------------------------------------
# evaluate_beir end to end, against an independent reference
# ----------------------------------------------------------------------------------------------


def reference_metrics(model_dir, data: BeirData, query_prefix="", ignore_identical_ids=True, ks=(1, 10, 100)):
    """sentence-transformers' own ``encode`` (its batching, no ds_infcl code), a materialized
    float64 [Q, D] score matrix, a full argsort, then the hand-checked ``beir_metrics``."""
    model = load_sentence_transformer(model_dir)
    q = model.encode([query_prefix + t for t in data.query_texts], convert_to_tensor=True).double()
    d = model.encode(data.document_texts, convert_to_tensor=True).double()
    order = torch.argsort(q @ d.T, dim=1, descending=True).tolist()
    ranked = {}
    for qid, row in zip(data.query_ids, order):
        docs = [data.document_ids[j] for j in row]
        ranked[qid] = [x for x in docs if x != qid] if ignore_identical_ids else docs
    return beir_metrics(ranked, data.qrels, ks)


def _assert_metrics_close(got, ref):
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name


@pytest.fixture(scope="module")
def loaded(beir_dir):
    with pytest.warns(UserWarning):
        return load_beir(beir_dir)


class VectorEncoder:
    """Embeddings chosen by hand: one fixed random vector per text (64 features), so that
    scores between different texts are near 0 and a text scores ~64 with itself."""

    def __init__(self, overrides=None):
        self.overrides = overrides or {}
        self.calls = []

    def _vec(self, text):
        if text in self.overrides:
            return self.overrides[text]
        g = torch.Generator().manual_seed(sum(ord(ch) * 31 ** i for i, ch in enumerate(text)) % 2**31)
        return torch.randn(64, generator=g)

    def embed_queries(self, texts, batch_size):
        self.calls.append(("query", len(texts), batch_size))
        return torch.stack([self._vec(t) for t in texts])

    def embed_documents(self, texts, batch_size):
        self.calls.append(("document", len(texts), batch_size))
        return torch.stack([self._vec(t) for t in texts])


def test_evaluate_beir_ignores_identical_ids(tmp_path):
    """Query "d4" has the text of document d4 and its relevant document d8 is d4's vector plus a
    little noise: with identical ids kept, d4 ranks first and d8 second (reciprocal rank 1/2);
    ignored (BEIR's default), d8 ranks first. No other query changes."""
    folder = str(tmp_path / "b")
    docs, queries = write_beir(folder)
    rows = [json.loads(line) for line in open(os.path.join(folder, "queries.jsonl"))]
    for row in rows:
        if row["_id"] == "d4":
            row["text"] = docs[4]["text"]
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.warns(UserWarning):
        data = load_beir(folder)
    enc = VectorEncoder()
    d4 = enc._vec(docs[4]["text"])
    enc.overrides[data.document_texts[8]] = d4 + 0.01 * torch.randn(64, generator=torch.Generator().manual_seed(0))
    kept = evaluate_beir(enc, data, batch_size=4, ks=(1,), ignore_identical_ids=False, progress=False)
    ignored = evaluate_beir(enc, data, batch_size=4, ks=(1,), chunk_size=3, progress=False)
    n = data.counts["num_queries"]
    assert ignored["mrr@10"] - kept["mrr@10"] == pytest.approx((1 - 1 / 2) / n, abs=1e-12)
    assert ignored["recall@1"] - kept["recall@1"] == pytest.approx(1 / n, abs=1e-12)
    assert ignored["ndcg@10"] - kept["ndcg@10"] == pytest.approx((1 - 1 / math.log2(3)) / n, abs=1e-12)
    # batches of at most batch_size texts, every text once
    assert {c[2] for c in enc.calls} == {4} and max(c[1] for c in enc.calls) == 4
    assert sum(c[1] for c in enc.calls if c[0] == "document") == 2 * NUM_DOCS


def test_tokenizing_embedder_matches_retrieval_encoders(tiny_model, loaded):
    enc = RetrievalEncoders(tiny_model, query_prefix="how ")
    direct = evaluate_beir(enc, loaded, batch_size=6, progress=False)
    wrapped = evaluate_beir(TokenizingEmbedder(enc, enc), loaded, batch_size=6, progress=False)
    _assert_metrics_close(wrapped, direct)
    with pytest.raises(ValueError, match="encoder has no embed_queries"):
        evaluate_beir(object(), loaded, progress=False)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        evaluate_beir(enc, loaded, batch_size=0, progress=False)


def test_load_encoder_separate_towers_and_saved_prompts(tiny_model, loaded, tmp_path):
    enc = RetrievalEncoders(tiny_model, separate=True, query_prefix="what ", document_prefix="doc ")
    with torch.no_grad():  # make the towers differ
        next(enc.document_model.parameters()).mul_(0.5)
    enc.save(str(tmp_path / "export"))
    loaded_enc = load_encoder(str(tmp_path / "export"))
    assert (loaded_enc.query_prefix, loaded_enc.document_prefix) == ("what ", "doc ")
    texts = loaded.document_texts[:5]
    torch.testing.assert_close(loaded_enc.embed_documents(texts, 2), enc.embed_documents(texts, 2))
    torch.testing.assert_close(loaded_enc.embed_queries(texts, 2), enc.embed_queries(texts, 2))
    plain = load_encoder(tiny_model, query_prefix="x ")
    assert (plain.query_prefix, plain.document_prefix) == ("x ", "")


def test_command_writes_results(tiny_model, beir_dir, loaded, tmp_path):
    out = tmp_path / "res" / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "ds_infcl.adapters.beir_eval", "--model", tiny_model, "--data", beir_dir,
           "--split", "test", "--batch-size", "7", "--query-prefix", "what is ", "--out", str(out), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "NDCG@k" in proc.stdout and "skipped_queries_without_relevant 1" in proc.stdout
    report = json.loads(out.read_text())
    assert report["query_prefix"] == "what is " and report["split"] == "test"
    _assert_metrics_close(report["results"], reference_metrics(tiny_model, loaded, query_prefix="what is "))
    assert report["results"]["unknown_document_qrels"] == 1


def test_command_bad_split_exits_2(tiny_model, beir_dir, capsys):
    assert main(["--model", tiny_model, "--data", beir_dir, "--split", "dev", "--no-progress"]) == 2
    assert "splits found: test" in capsys.readouterr().err
