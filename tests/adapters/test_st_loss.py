"""The sentence-transformers loss against sentence-transformers' own losses (one process)."""

import pytest
import torch

from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts


def _model(path):
    from ds_infcl.adapters.retrieval import load_sentence_transformer

    return load_sentence_transformer(path)


def _columns(model, b, num_neg, seed):
    texts = random_texts(b * (2 + num_neg), seed)
    cols = [texts[i * b : (i + 1) * b] for i in range(2 + num_neg)]
    return [model.tokenize(c) for c in cols]


def _loss_and_grads(loss_fn, model, features):
    model.zero_grad(set_to_none=True)
    loss = loss_fn([dict(f) for f in features], None)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_grads_close(got, want, rel=1e-4):
    """Every gradient within ``rel`` of the largest reference entry of that tensor (fp32 sums of
    many token terms differ in order: MNRL merges and pads the candidate columns)."""
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rel * want[name].abs().max().item() + 1e-7, (name, err, want[name].abs().max().item())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("num_neg", [0, 1, 3])
@pytest.mark.parametrize("mini_batch_size", [None, 3])
def test_equals_mnrl(tiny_dir, num_neg, mini_batch_size):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    features = _columns(model, 7, num_neg, seed=num_neg)
    ref_loss, ref_grads = _loss_and_grads(MultipleNegativesRankingLoss(model, scale=20.0), model, features)
    ours = InfCLMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini_batch_size)
    loss, grads = _loss_and_grads(ours, model, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    _assert_grads_close(grads, ref_grads)


def test_interleaved_keys_give_a_different_loss():
    """The P N N interleaving bug: labels that assume the column order on keys stored per query
    train toward negatives. Our labels follow the layout (``keys_and_labels``)."""
    from ds_infcl.adapters.retrieval import keys_and_labels, retrieval_loss

    torch.manual_seed(0)
    b, n, c = 5, 2, 8
    q = torch.nn.functional.normalize(torch.randn(b, c), dim=1)
    cols = [torch.nn.functional.normalize(torch.randn(b, c), dim=1) for _ in range(1 + n)]
    by_column = torch.cat(cols)                                  # P P P .. N1 N1 .. N2 N2 ..
    by_query = torch.stack(cols, 1).reshape(b * (1 + n), c)      # P N N P N N ..
    ref = retrieval_loss(q, by_column, 20.0, keys_and_labels(b, n, "grouped_by_column"))
    same = retrieval_loss(q, by_query, 20.0, keys_and_labels(b, n, "grouped_by_query"))
    wrong = retrieval_loss(q, by_query, 20.0, torch.arange(b))
    torch.testing.assert_close(same, ref)
    assert not torch.allclose(wrong, ref)


def test_cached_with_dropout_is_exact(tmp_path):
    """With dropout on, the checkpointed chunks replay each chunk's RNG state in the backward:
    loss and gradients equal those of the same chunked forward kept whole in memory."""
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(make_tiny_model_dir(str(tmp_path / "drop"), dropout=0.2))
    model.train()
    features = _columns(model, 8, 1, seed=11)
    ours = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=3)

    def uncached(feats, labels=None):  # the same chunks in the same RNG order, no checkpointing
        embs = []
        for f in feats:
            parts = [model({k: v[i : i + 3] if torch.is_tensor(v) else v for k, v in f.items()})["sentence_embedding"]
                     for i in range(0, f["input_ids"].shape[0], 3)]
            embs.append(torch.nn.functional.normalize(torch.cat(parts), dim=-1))
        return ours.compute_loss_from_embeddings(embs)

    torch.manual_seed(123)
    ref_loss, ref_grads = _loss_and_grads(uncached, model, features)
    torch.manual_seed(123)
    loss, grads = _loss_and_grads(ours, model, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    _assert_grads_close(grads, ref_grads, rel=1e-5)
    torch.manual_seed(124)  # a different dropout draw changes the loss: dropout is really on
    other, _ = _loss_and_grads(ours, model, features)
    assert abs(float(other) - float(loss)) > 1e-4


def test_false_negative_masking_in_st_loss(tiny_dir):
    """A positive repeated in the batch is not a negative of the other anchor."""
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    model.eval()
    anchors = random_texts(4, 1)
    positives = random_texts(4, 2)
    positives[3] = positives[1]  # anchors 1 and 3 share their positive
    features = [model.tokenize(anchors), model.tokenize(positives)]
    with torch.no_grad():
        q = torch.nn.functional.normalize(model(dict(features[0]))["sentence_embedding"], dim=1)
        k = torch.nn.functional.normalize(model(dict(features[1]))["sentence_embedding"], dim=1)
    x = 20.0 * q @ k.T
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[1, 3] = mask[3, 1] = True
    ref = (torch.logsumexp(x.masked_fill(mask, float("-inf")), 1) - x.diag()).mean()
    unmasked = (torch.logsumexp(x, 1) - x.diag()).mean()
    with torch.no_grad():
        got = InfCLMultipleNegativesRankingLoss(model)([dict(f) for f in features])
        plain = InfCLMultipleNegativesRankingLoss(model, mask_false_negatives=False)([dict(f) for f in features])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, unmasked, rtol=1e-5, atol=1e-6)


def test_bad_arguments(tiny_dir):
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    with pytest.raises(ValueError, match="cos_sim or dot_score"):
        InfCLMultipleNegativesRankingLoss(model, similarity_fct="euclid")
    with pytest.raises(ValueError, match="mini_batch_size"):
        InfCLMultipleNegativesRankingLoss(model, mini_batch_size=0)
    with pytest.raises(ValueError, match="columns"):
        InfCLMultipleNegativesRankingLoss(model)([model.tokenize(["a"])])


def test_under_autocast_the_loss_runs_in_autocast_dtype(tiny_dir, monkeypatch):
    """Under bf16 autocast the fused loss gets bf16 embeddings, as autocast gives MNRL's score
    matmul (the float32 embeddings made the loss's kernels run in float32 on the GPU: 0.85 s per
    step at 65,536 pairs); the value stays within bf16 error of MNRL under the same autocast."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    import ds_infcl.adapters.st_loss as st_loss

    seen = []
    real = st_loss.retrieval_loss

    def spy(query, key, *args, **kwargs):
        seen.append((query.dtype, key.dtype))
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(st_loss, "retrieval_loss", spy)
    model = _model(tiny_dir)
    features = _columns(model, 8, 1, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = MultipleNegativesRankingLoss(model, scale=20.0)([dict(f) for f in features], None)
        loss = st_loss.InfCLMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=3)(
            [dict(f) for f in features], None)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    loss.backward()  # the gradient flows back through the cast into the float32 parameters
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    seen.clear()
    st_loss.InfCLMultipleNegativesRankingLoss(model, scale=20.0)([dict(f) for f in features], None)
    assert seen == [(torch.float32, torch.float32)]  # no autocast: unchanged
