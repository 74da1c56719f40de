"""Retrieval adapter: the masked loss against a materialized reference, the encoders, the saved
sentence-transformers folder, and the metrics against sentence-transformers' evaluator."""

import json
import os

import pytest
import torch

from ds_infcl.adapters.retrieval import (
    RetrievalEncoders,
    RetrievalLoss,
    false_negative_pairs,
    load_sentence_transformer,
    retrieval_loss,
    text_ids,
)
from ds_infcl.adapters.retrieval_eval import retrieval_metrics
from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts


def masked_reference(q, k, scale, labels, key_ids, positive_ids, symmetric):
    """fp64 materialized loss: masked pairs get -inf logits in both directions."""
    q, k = q.double(), k.double()
    x = scale * q @ k.T
    b = q.shape[0]
    mask = (key_ids[None, :, None] == positive_ids[:, None, :]).any(-1)
    mask[torch.arange(b), labels] = False
    xm = x.masked_fill(mask, float("-inf"))
    pos = x[torch.arange(b), labels]
    loss = (torch.logsumexp(xm, 1) - pos).mean()
    if symmetric:
        loss = (loss + (torch.logsumexp(xm, 0)[labels] - pos).mean()) / 2
    return loss


def _case(b, num_neg, c, seed, dup_pairs):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(b * (1 + num_neg), c, generator=g), dim=1)
    ids = torch.arange(k.shape[0]) * 7919
    for dst, src in dup_pairs:  # key dst gets the text (id) of key src
        ids[dst] = ids[src]
    return q, k, ids


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("b,num_neg,dups", [
    (1, 0, []),
    (5, 0, [(3, 1)]),                 # two queries share a positive
    (6, 1, [(8, 2), (0, 4)]),         # a hard negative equals another query's positive
    (7, 3, [(20, 6), (9, 9), (14, 2), (27, 2)]),
])
def test_masked_loss_matches_reference(symmetric, b, num_neg, dups):
    q, k, ids = _case(b, num_neg, 12, seed=b + num_neg, dup_pairs=dups)
    labels = torch.arange(b)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss = retrieval_loss(qr, kr, 20.0, labels, key_ids=ids, symmetric=symmetric)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    ref = masked_reference(q64, k64, 20.0, labels, ids, ids[labels][:, None], symmetric)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad(loss, (qr, kr))
    gr = torch.autograd.grad(ref, (q64, k64))
    for a, r in zip(g, gr):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=2e-6)


def test_multiple_positive_ids_and_interleaved_layout():
    """Every known positive of a query is masked; keys stored per query (P N N) with labels
    ``arange(b) * 3`` work the same."""
    b, num_neg = 4, 2
    q, k, ids = _case(b, num_neg, 8, seed=3, dup_pairs=[])
    labels = torch.arange(b) * (1 + num_neg)
    positive_ids = torch.stack([ids[labels], ids[(labels + 4) % k.shape[0]]], 1)  # a second positive text
    loss = retrieval_loss(q, k, 20.0, labels, key_ids=ids, positive_ids=positive_ids)
    ref = masked_reference(q, k, 20.0, labels, ids, positive_ids, False)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    plain = retrieval_loss(q, k, 20.0, labels)
    assert float(plain) > float(loss)


def test_no_duplicates_equals_plain_loss():
    q, k, ids = _case(6, 1, 8, seed=5, dup_pairs=[])
    torch.testing.assert_close(retrieval_loss(q, k, 20.0, key_ids=ids), retrieval_loss(q, k, 20.0))


def test_false_negative_pairs():
    ids = torch.tensor([10, 11, 10, 12, 11, 10])
    rows, cols = false_negative_pairs(ids, torch.tensor([[10], [11], [12]]), torch.tensor([0, 1, 3]))
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 2), (0, 5), (1, 4)]
    rows, _ = false_negative_pairs(ids, torch.tensor([[13]]), torch.tensor([0]))
    assert rows.numel() == 0


def test_feature_ids():
    from ds_infcl.adapters.retrieval import feature_ids

    ids = torch.tensor([[2, 7, 9, 3, 0], [2, 7, 9, 3, 11], [2, 7, 3, 0, 0], [2, 9, 7, 3, 0], [2, 7, 9, 3, 5]])
    mask = (ids != 0).long()
    mask[1, 4] = 0  # a padded position holding another token id
    out = feature_ids({"input_ids": ids, "attention_mask": mask})
    assert out[0] == out[1]  # padding does not count
    assert len(set(out.tolist())) == 4  # order, length and content do
    big = torch.randint(5, 30000, (4096, 12))
    assert len(set(feature_ids({"input_ids": big}).tolist())) == 4096


def test_text_ids():
    a = text_ids(["a cat", "a dog", "a cat", ""])
    assert a.dtype == torch.long and a[0] == a[2] and a[0] != a[1]


def test_loss_module_options():
    assert float(RetrievalLoss().scale) == pytest.approx(20.0)
    assert float(RetrievalLoss(temperature=0.05).scale) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="either scale or temperature"):
        RetrievalLoss(scale=10.0, temperature=0.1)
    with pytest.raises(ValueError, match="temperature"):
        RetrievalLoss(temperature=0.0)
    q, k, ids = _case(3, 0, 8, seed=1, dup_pairs=[(2, 0)])
    on = RetrievalLoss()(q, k, None, key_ids=ids)
    off = RetrievalLoss(mask_false_negatives=False)(q, k, None, key_ids=ids)
    assert float(off) > float(on)
    learn = RetrievalLoss(learnable_scale=True)
    learn(q, k).backward()
    assert learn.logit_scale.grad is not None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooling_and_normalize(tiny_dir, pooling):
    enc = RetrievalEncoders(tiny_dir, pooling=pooling, normalize=False)
    e = enc.embed_queries(["the cat", "a red car is fast"])
    assert e.shape == (2, 32)
    assert not torch.allclose(e.norm(dim=1), torch.ones(2))
    with pytest.raises(ValueError, match="pooling must be one of"):
        RetrievalEncoders(tiny_dir, pooling="max_sum")


def test_save_loads_in_sentence_transformers(tiny_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    enc = RetrievalEncoders(tiny_dir, pooling="cls", query_prefix="query: ", document_prefix="passage: ")
    out = str(tmp_path / "saved")
    enc.save(out, loss_name="RetrievalLoss(scale=20)", batch_size=4096)
    loaded = SentenceTransformer(out, device="cpu")
    texts = ["what is the cat", "the dog can run"]
    torch.testing.assert_close(
        loaded.encode(texts, prompt_name="query", convert_to_tensor=True), enc.embed_queries(texts), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        loaded.encode(texts, prompt_name="document", convert_to_tensor=True), enc.embed_documents(texts),
        atol=1e-5, rtol=1e-5,
    )
    card = open(os.path.join(out, "README.md")).read()
    assert "RetrievalLoss(scale=20)" in card and "4096" in card
    assert json.load(open(os.path.join(out, "ds_infcl_training.json")))["global_batch_size"] == 4096
    assert any("Normalize" in type(m).__name__ for m in loaded)
    # a sentence-transformers folder reloads through the adapter, with pooling/normalize overrides
    again = RetrievalEncoders(out, query_prefix="query: ")
    torch.testing.assert_close(again.embed_queries(texts), enc.embed_queries(texts), atol=1e-5, rtol=1e-5)
    mean_pooled = load_sentence_transformer(out, pooling="mean", normalize=False)
    assert not any("Normalize" in type(m).__name__ for m in mean_pooled)
    assert mean_pooled.encode(texts, convert_to_tensor=True).shape == (2, 32)


def test_separate_towers_save_two_folders(tiny_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    enc = RetrievalEncoders(tiny_dir, separate=True)
    with torch.no_grad():
        for p in enc.document_model.parameters():
            p.add_(0.01)
    paths = enc.save(str(tmp_path / "two"), batch_size=8)
    assert [os.path.basename(p) for p in paths] == ["query", "document"]
    texts = ["a cat"]
    d = SentenceTransformer(paths[1], device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(d, enc.embed_documents(texts), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(enc.embed_queries(texts), enc.embed_documents(texts))


def test_encoders_train_with_chunks(tiny_dir):
    """encode_query/encode_key with chunks give the same loss and gradients as without."""
    texts_q, texts_d = random_texts(7, 1), random_texts(14, 2)
    results = []
    for chunk in (None, 3):
        enc = RetrievalEncoders(tiny_dir, chunk_size=chunk)
        q = enc.encode_query(enc.tokenize_queries(texts_q))
        k = enc.encode_key(enc.tokenize_documents(texts_d))
        loss = RetrievalLoss()(q, k, torch.arange(7) * 2, key_ids=text_ids(texts_d))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in enc.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_metrics_match_sentence_transformers_evaluator(tiny_dir):
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    model = load_sentence_transformer(tiny_dir)
    queries = random_texts(25, 7)
    corpus = random_texts(150, 8)
    g = torch.Generator().manual_seed(0)
    relevant = [set(torch.randint(0, 150, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist())
                for _ in queries]
    ev = InformationRetrievalEvaluator(
        {f"q{i}": t for i, t in enumerate(queries)}, {f"d{j}": t for j, t in enumerate(corpus)},
        {f"q{i}": {f"d{j}" for j in rel} for i, rel in enumerate(relevant)},
        mrr_at_k=[10], ndcg_at_k=[10], precision_recall_at_k=[1, 10, 100], accuracy_at_k=[1], map_at_k=[10],
        name="t", show_progress_bar=False,
    )
    theirs = ev(model)
    ours = retrieval_metrics(model.encode(queries, convert_to_tensor=True), model.encode(corpus, convert_to_tensor=True),
                             relevant)
    for k_ours, k_theirs in [("ndcg@10", "t_cosine_ndcg@10"), ("mrr@10", "t_cosine_mrr@10"),
                             ("recall@1", "t_cosine_recall@1"), ("recall@10", "t_cosine_recall@10"),
                             ("recall@100", "t_cosine_recall@100")]:
        assert ours[k_ours] == pytest.approx(theirs[k_theirs], abs=1e-6), k_ours


def test_metrics_small_cases():
    q = torch.eye(3)
    corpus = torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1], [0.5, 0.5, 0]])
    m = retrieval_metrics(q, corpus, [{1}, {3}, {2}], ndcg_at=[2], mrr_at=[2], recall_at=[1, 2])
    # query 0: ranking 1,3 -> hit at 1; query 1: ranking 0,3 -> hit at 2; query 2: hit at 1
    assert m["mrr@2"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m["recall@1"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no relevant"):
        retrieval_metrics(q, corpus, [{1}, set(), {2}])
