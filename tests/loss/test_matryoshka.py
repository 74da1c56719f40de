"""Matryoshka retrieval loss: ``sum_i w_i * InfoNCE(prefix_i(q), prefix_i(k))``, each prefix
re-normalized for cosine, each term exact over the global batch and false-negative masked.

Checked against: a case worked by hand (plain Python floats); the materialized float64 reference
(``retrieval_loss_reference``: full logits, log-softmax, per dim) on b = 1, sizes that the tile
does not divide, hard negatives, repeated texts, a learnable scale, bf16 inputs; 2 gloo ranks with
unequal sizes (loss on every rank, gradients after the data-parallel mean); and
sentence-transformers' ``MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), ...)`` on a
tiny model (values and parameter gradients, one process and the gathered batch of 2 ranks).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds_infcl.loss.retrieval import (
    RetrievalLoss,
    check_matryoshka,
    keys_and_labels,
    matryoshka_retrieval_loss,
    retrieval_loss,
)
from ds_infcl.loss.retrieval_reference import retrieval_loss_reference
from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts
from tests.ops.accuracy import error_bound, rel_err
from tests.ring.ring_harness import spawn


def _close(got, want, rel, what):
    """Max abs error within ``rel`` of the largest reference magnitude."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    scale = max(want.abs().max().item(), 1e-3)
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:.1e} * {scale:.3g}"


# ----------------------------------------------------------------------------------------------
# The reference, by hand
# ----------------------------------------------------------------------------------------------


def test_reference_by_hand():
    """Two queries, two keys, c = 2, dims (2, 1), weights (1, 0.5), scale 2, cosine."""
    q = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    k = torch.tensor([[-2.0, 1.0], [1.0, 1.0]])

    def unit(v):
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v]

    def infonce(qs, ks, s):
        total = 0.0
        for i, qi in enumerate(qs):
            logits = [s * sum(a * b for a, b in zip(qi, kj)) for kj in ks]
            total += math.log(sum(math.exp(x) for x in logits)) - logits[i]
        return total / len(qs)

    full = infonce([unit(r) for r in q.tolist()], [unit(r) for r in k.tolist()], 2.0)
    # prefixes of length 1 normalize to signs: q -> [1], [1]; k -> [-1], [1]
    first = infonce([[1.0], [1.0]], [[-1.0], [1.0]], 2.0)
    want = full + 0.5 * first
    got = retrieval_loss_reference(q, k, 2.0, matryoshka_dims=[2, 1], matryoshka_weights=[1, 0.5])
    assert abs(got.item() - want) < 1e-12
    ours = matryoshka_retrieval_loss(q, k, 2.0, matryoshka_dims=[2, 1], matryoshka_weights=[1, 0.5])
    assert abs(ours.item() - want) < 1e-5
    # without normalization the prefixes are scored by their dot products
    raw = infonce(q.tolist(), k.tolist(), 2.0) + 0.5 * infonce([[3.0], [1.0]], [[-2.0], [1.0]], 2.0)
    got = retrieval_loss_reference(q, k, 2.0, matryoshka_dims=[2, 1], matryoshka_weights=[1, 0.5], normalize=False)
    assert abs(got.item() - raw) < 1e-12


# ----------------------------------------------------------------------------------------------
# One process, against the float64 reference
# ----------------------------------------------------------------------------------------------

# b, num_neg, c, dims, weights, tile_size, symmetric, duplicate ids (key dst gets key src's id),
# normalize, layout
CASES = [
    (1, 0, 8, (8, 3), None, 4, False, [], True, "grouped_by_column"),
    (1, 2, 8, (8, 5, 1), (1.0, 2.0, 0.5), 2, True, [(2, 0)], True, "grouped_by_column"),
    (7, 2, 24, (24, 16, 5), (1.0, 0.5, 2.0), 4, False, [(20, 6), (9, 2), (14, 2)], True, "grouped_by_column"),
    (7, 2, 24, (24, 16, 5), (1.0, 0.5, 2.0), 4, True, [(20, 6), (9, 2), (14, 2)], True, "grouped_by_column"),
    (5, 1, 72, (64, 32, 8), None, 3, True, [], True, "grouped_by_column"),          # full dim left out
    (6, 3, 20, (20, 7), (0.25, 1.0), 5, False, [(0, 8), (23, 4)], True, "grouped_by_query"),
    (6, 1, 16, (16, 9, 2), (1.0, 1.0, 3.0), 4, True, [(11, 3)], False, "grouped_by_column"),  # dot product
]


def _case(b, num_neg, c, dups, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, c, generator=g) * 1.5       # not unit rows: the prefixes' norms matter
    k = torch.randn(b * (1 + num_neg), c, generator=g) * 1.5
    ids = torch.arange(k.shape[0]) * 7919 + 13
    for dst, src in dups:
        ids[dst] = ids[src]
    return q, k, ids


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}n{c[1]}c{c[2]}{'s' if c[6] else ''}" for c in CASES])
def test_matches_reference(case):
    b, num_neg, c, dims, weights, tile, symmetric, dups, normalize, layout = case
    q, k, ids = _case(b, num_neg, c, dups, seed=b * 100 + c)
    labels = keys_and_labels(b, num_neg, layout)
    if layout == "grouped_by_query":  # the same keys stored per query: P N N N P N N N ..
        k = k.reshape(1 + num_neg, b, c).transpose(0, 1).reshape(-1, c)
        ids = ids.reshape(1 + num_neg, b).T.reshape(-1)
    log_scale = torch.tensor(math.log(20.0), requires_grad=True)
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss = matryoshka_retrieval_loss(
        qr, kr, log_scale.exp(), labels, matryoshka_dims=dims, matryoshka_weights=weights, normalize=normalize,
        key_ids=ids, symmetric=symmetric, tile_size=tile,
    )
    upstream = 0.7  # an upstream gradient other than 1
    gq, gk, gs = torch.autograd.grad(loss * upstream, (qr, kr, log_scale))

    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    ls64 = torch.tensor(math.log(20.0), dtype=torch.float64, requires_grad=True)
    ref = retrieval_loss_reference(
        q64, k64, ls64.exp(), labels, key_ids=ids, symmetric=symmetric, matryoshka_dims=dims,
        matryoshka_weights=weights, normalize=normalize,
    )
    rq, rk, rs = torch.autograd.grad(ref * upstream, (q64, k64, ls64))
    _close(loss, ref, 1e-5, "loss")
    _close(gq, rq, 2e-5, "dq")
    _close(gk, rk, 2e-5, "dk")
    _close(gs, rs, 2e-5, "d log_scale")

    # the same as the weighted sum of retrieval_loss on prefixes taken by hand
    w = weights or (1.0,) * len(dims)
    prep = (lambda x, d: F.normalize(x[:, :d], dim=-1)) if normalize else (lambda x, d: x[:, :d])
    parts = sum(wi * retrieval_loss(prep(q, d), prep(k, d), 20.0, labels, key_ids=ids, symmetric=symmetric)
                for d, wi in zip(dims, w))
    _close(loss, parts, 1e-6, "sum of retrieval_loss")


def test_masking_applies_to_every_dim():
    """A repeated positive changes every term: masked != unmasked at each dim, and each dim's
    masked loss is the reference's."""
    q, k, ids = _case(4, 0, 12, [(3, 1)], seed=5)
    masked = [matryoshka_retrieval_loss(q, k, 20.0, matryoshka_dims=[d], key_ids=ids) for d in (12, 6)]
    plain = [matryoshka_retrieval_loss(q, k, 20.0, matryoshka_dims=[d]) for d in (12, 6)]
    for d, m, p in zip((12, 6), masked, plain):
        _close(m, retrieval_loss_reference(q, k, 20.0, key_ids=ids, matryoshka_dims=[d]), 1e-5, f"dim {d}")
        assert abs(m.item() - p.item()) > 1e-3, d


def test_bf16_within_twice_plain_error():
    """bf16 features: error against float64 at most twice that of the same loss materialized in
    bf16 (logits in bf16, softmax in float32)."""
    b, num_neg, c, dims, weights = 9, 1, 48, (48, 20, 6), (1.0, 0.5, 0.25)
    q, k, ids = _case(b, num_neg, c, [(12, 3)], seed=3)
    q, k = q.bfloat16(), k.bfloat16()
    labels = torch.arange(b)

    def grads(fn, dtype):
        qq, kk = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
        loss = fn(qq, kk)
        return [loss.detach().double(), *(g.double() for g in torch.autograd.grad(loss, (qq, kk)))]

    def plain(qq, kk):
        mask = (ids[None, :] == ids[labels][:, None])
        mask[torch.arange(b), labels] = False
        total = 0.0
        for d, w in zip(dims, weights):
            x = (20.0 * F.normalize(qq[:, :d], dim=-1) @ F.normalize(kk[:, :d], dim=-1).T).float()
            total = total + w * F.cross_entropy(x.masked_fill(mask, float("-inf")), labels)
        return total

    ours = grads(lambda qq, kk: matryoshka_retrieval_loss(
        qq, kk, 20.0, labels, matryoshka_dims=dims, matryoshka_weights=weights, key_ids=ids, tile_size=4),
        torch.bfloat16)
    ref = grads(lambda qq, kk: retrieval_loss_reference(
        qq, kk, 20.0, labels, key_ids=ids, matryoshka_dims=dims, matryoshka_weights=weights), torch.float64)
    base = grads(plain, torch.bfloat16)
    for name, o, r, p in zip(("loss", "dq", "dk"), ours, ref, base):
        assert rel_err(o, r) <= error_bound(torch.bfloat16, rel_err(p, r)), name


def test_module_and_learnable_scale():
    """``RetrievalLoss(matryoshka_dims=...)`` equals the functional; its learnable scale gets the
    reference gradient; without dims it is the plain loss; a partial dims list warns once."""
    q, k, ids = _case(5, 1, 16, [(7, 2)], seed=9)
    mod = RetrievalLoss(scale=10.0, learnable_scale=True, matryoshka_dims=[16, 4], matryoshka_weights=[1, 2])
    loss = mod(q, k, torch.arange(5), key_ids=ids)
    loss.backward()
    ls = torch.tensor(math.log(10.0), dtype=torch.float64, requires_grad=True)
    ref = retrieval_loss_reference(q, k, ls.exp(), key_ids=ids, matryoshka_dims=[16, 4], matryoshka_weights=[1, 2])
    ref.backward()
    _close(loss, ref, 1e-5, "loss")
    _close(mod.logit_scale.grad, ls.grad, 2e-5, "d logit_scale")
    assert "matryoshka_dims=[16, 4]" in repr(mod)
    plain = RetrievalLoss(scale=10.0)(q, k, key_ids=ids)
    _close(plain, retrieval_loss_reference(q, k, 10.0, key_ids=ids), 1e-5, "plain")
    partial = RetrievalLoss(matryoshka_dims=[8, 4])
    with pytest.warns(UserWarning, match="full embedding"):
        partial(q, k)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partial(q, k)  # once only


def test_bad_dims_and_weights():
    q, k, _ = _case(3, 0, 8, [], seed=0)
    bad = [
        (dict(matryoshka_dims=[4, 8]), "descending order.*\\[8, 4\\]"),
        (dict(matryoshka_dims=[8, 4, 4]), "duplicates \\[4\\]"),
        (dict(matryoshka_dims=[16, 4]), "\\[16\\] exceed the embedding dimension c=8"),
        (dict(matryoshka_dims=[8, 4], matryoshka_weights=[1.0]), "1 entries.*one weight per dimension"),
        (dict(matryoshka_dims=[8, 4], matryoshka_weights=[1.0, -1.0]), "finite numbers >= 0"),
        (dict(matryoshka_dims=[8, 4], matryoshka_weights=[1.0, float("nan")]), "finite numbers >= 0"),
        (dict(matryoshka_dims=[]), "empty"),
        (dict(matryoshka_dims=[8, 0]), "positive integers"),
        (dict(matryoshka_dims=[8, 2.5]), "positive integers"),
        (dict(matryoshka_dims=8), "list of positive integers"),
    ]
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            matryoshka_retrieval_loss(q, k, 20.0, **kwargs)
    with pytest.raises(ValueError, match="descending"):
        RetrievalLoss(matryoshka_dims=[64, 128])
    with pytest.raises(ValueError, match="matryoshka_dims is None"):
        RetrievalLoss(matryoshka_weights=[1.0])
    assert check_matryoshka([768, 64]) == ((768, 64), (1.0, 1.0))


# ----------------------------------------------------------------------------------------------
# sentence-transformers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_mrl")))


def _model(path):
    from ds_infcl.adapters.retrieval import load_sentence_transformer

    return load_sentence_transformer(path)


def _loss_and_grads(loss_fn, model, features):
    model.zero_grad(set_to_none=True)
    loss = loss_fn([dict(f) for f in features], None)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got, want, rel=1e-4):
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rel * want[name].abs().max().item() + 1e-7, (name, err, want[name].abs().max().item())


@pytest.mark.parametrize("num_neg,mini_batch_size,dims,weights", [
    (0, None, (32, 16, 8), (1.0, 0.5, 0.25)),
    (2, 3, (32, 20, 7), (2.0, 1.0, 1.0)),
    (1, 4, (24, 5), None),  # the full 32 left out (sentence-transformers warns)
])
def test_equals_sentence_transformers_matryoshka(tiny_dir, num_neg, mini_batch_size, dims, weights):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    b = 7
    texts = random_texts(b * (2 + num_neg), seed=40 + num_neg)
    features = [model.tokenize(texts[i * b : (i + 1) * b]) for i in range(2 + num_neg)]
    st = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), matryoshka_dims=list(dims),
                        matryoshka_weights=None if weights is None else list(weights))
    ref_loss, ref_grads = _loss_and_grads(st, model, features)
    ours = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size, matryoshka_dims=list(dims),
                                             matryoshka_weights=weights, tile_size=3)
    loss, grads = _loss_and_grads(ours, model, features)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    _assert_grads_close(grads, ref_grads)
    cfg = ours.get_config_dict()
    assert cfg["matryoshka_dims"] == list(dims)
    assert cfg["matryoshka_weights"] == list(weights or (1.0,) * len(dims))


def test_st_loss_one_forward_and_dot_score(tiny_dir):
    """One encoder forward per column whatever the number of dims; with ``dot_score`` the
    prefixes are not normalized (reference with ``normalize=False``)."""
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    calls = []
    handle = model[0].register_forward_hook(lambda *_: calls.append(1))
    texts = random_texts(10, seed=3)
    features = [model.tokenize(texts[:5]), model.tokenize(texts[5:])]
    loss_fn = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=None, similarity_fct="dot_score",
                                                matryoshka_dims=[32, 12, 3], matryoshka_weights=[1, 1, 2])
    loss = loss_fn([dict(f) for f in features])
    handle.remove()
    assert len(calls) == 2
    with torch.no_grad():
        q, k = (model(dict(f))["sentence_embedding"] for f in features)
    ref = retrieval_loss_reference(q, k, 20.0, matryoshka_dims=[32, 12, 3], matryoshka_weights=[1, 1, 2],
                                   normalize=False)
    _close(loss, ref, 1e-5, "dot_score")
    assert loss_fn.get_config_dict()["matryoshka_dims"] == [32, 12, 3]
    assert InfCLMultipleNegativesRankingLoss(model).get_config_dict()["matryoshka_dims"] is None


def test_st_loss_bad_dims(tiny_dir):
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    model = _model(tiny_dir)
    with pytest.raises(ValueError, match="exceed the embedding dimension c=32"):
        InfCLMultipleNegativesRankingLoss(model, matryoshka_dims=[64, 32])
    with pytest.raises(ValueError, match="descending"):
        InfCLMultipleNegativesRankingLoss(model, matryoshka_dims=[8, 32])
    with pytest.raises(ValueError, match="one weight per dimension"):
        InfCLMultipleNegativesRankingLoss(model, matryoshka_dims=[32, 8], matryoshka_weights=[1, 2, 3])


# ----------------------------------------------------------------------------------------------
# Two gloo ranks, unequal sizes
# ----------------------------------------------------------------------------------------------

DIST_DIMS, DIST_WEIGHTS = (24, 10, 3), (1.0, 0.5, 2.0)
DIST_SIZES = ([3, 5], [1, 4])  # queries per rank
DIST_NEG = 2


def _dist_case(sizes, seed, across):
    """Per-rank features (keys grouped by column), ids with a repeat inside rank 1 and, if
    ``across``, repeats across the ranks (else rank 0 takes part in no masked pair: the gathered
    rows must still enter its graph, or the backward's collectives would not match)."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(b, 24, generator=g) for b in sizes]
    ks = [torch.randn(b * (1 + DIST_NEG), 24, generator=g) for b in sizes]
    ids, nxt = [], 0
    for k in ks:
        ids.append(torch.arange(nxt, nxt + k.shape[0]) * 31 + 1)
        nxt += k.shape[0]
    ids[1][-1] = ids[1][0]            # rank 1's last negative is its own first positive
    if across:
        ids[1][sizes[1]] = ids[0][0]  # rank 1's first negative is rank 0's first positive
        ids[0][-1] = ids[1][1]        # rank 0's last negative is rank 1's second positive
    return {"q": qs, "k": ks, "ids": ids}


def _dist_worker(rank, world, payload):
    from ds_infcl.adapters.retrieval import load_sentence_transformer
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss
    from ds_infcl.loss.retrieval import matryoshka_retrieval_loss

    out = {}
    for ci, case in enumerate(payload["cases"]):
        for symmetric in (False, True):
            q = case["q"][rank].clone().requires_grad_()
            k = case["k"][rank].clone().requires_grad_()
            log_scale = torch.tensor(math.log(20.0), requires_grad=True)
            loss = matryoshka_retrieval_loss(
                q, k, log_scale.exp(), torch.arange(q.shape[0]), matryoshka_dims=DIST_DIMS,
                matryoshka_weights=DIST_WEIGHTS, key_ids=case["ids"][rank], symmetric=symmetric, tile_size=2,
            )
            out[(ci, symmetric)] = (loss.detach(), *torch.autograd.grad(loss, (q, k, log_scale)))
    model = load_sentence_transformer(payload["model_dir"])
    loss_fn = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=2, matryoshka_dims=[32, 16, 4],
                                                matryoshka_weights=[1.0, 0.5, 0.25])
    loss = loss_fn([model.tokenize(col[rank]) for col in payload["columns"]])
    loss.backward()
    out["st"] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.slow
def test_two_ranks_equal_single_process(tiny_dir):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    world = 2
    cases = [_dist_case(sizes, seed=i, across=i == 0) for i, sizes in enumerate(DIST_SIZES)]
    st_sizes = [2, 3]
    B = sum(st_sizes)
    texts = random_texts(B * 3, seed=77)
    global_cols = [texts[i * B : (i + 1) * B] for i in range(3)]
    columns = [[col[:st_sizes[0]], col[st_sizes[0]:]] for col in global_cols]
    results = spawn(_dist_worker, world, {"cases": cases, "model_dir": tiny_dir, "columns": columns},
                    timeout=240.0, pg_timeout=90.0)

    for ci, (case, sizes) in enumerate(zip(cases, DIST_SIZES)):
        q64 = torch.cat(case["q"]).double().requires_grad_()
        k64 = torch.cat(case["k"]).double().requires_grad_()
        koffs = [0, case["k"][0].shape[0]]
        labels = torch.cat([torch.arange(b) + o for b, o in zip(sizes, koffs)])
        ids = torch.cat(case["ids"])
        for symmetric in (False, True):
            ls64 = torch.tensor(math.log(20.0), dtype=torch.float64, requires_grad=True)
            ref = retrieval_loss_reference(q64, k64, ls64.exp(), labels, key_ids=ids, symmetric=symmetric,
                                           matryoshka_dims=DIST_DIMS, matryoshka_weights=DIST_WEIGHTS)
            rq, rk, rs = torch.autograd.grad(ref, (q64, k64, ls64))
            qoffs = [0, sizes[0]]
            for r, res in enumerate(results):
                loss, gq, gk, gs = res[(ci, symmetric)]
                what = f"sizes {sizes}, symmetric={symmetric}, rank {r}"
                _close(loss, ref, 1e-5, f"loss, {what}")
                # after the data-parallel mean each rank's feature gradient is 1/W of its own
                _close(gq / world, rq[qoffs[r] : qoffs[r] + sizes[r]], 2e-5, f"dq, {what}")
                kk = case["k"][r].shape[0]
                _close(gk / world, rk[koffs[r] : koffs[r] + kk], 2e-5, f"dk, {what}")
            mean_gs = sum(res[(ci, symmetric)][3] for res in results) / world
            _close(mean_gs, rs, 2e-5, f"d log_scale, sizes {sizes}, symmetric={symmetric}")

    # the sentence-transformers loss on 2 ranks = MatryoshkaLoss(MNRL) on the gathered batch
    model = _model(tiny_dir)
    st = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), matryoshka_dims=[32, 16, 4],
                        matryoshka_weights=[1.0, 0.5, 0.25])
    ref_loss, ref_grads = _loss_and_grads(st, model, [model.tokenize(c) for c in global_cols])
    for res in results:
        torch.testing.assert_close(res["st"][0], ref_loss, rtol=1e-5, atol=1e-6)
    mean = {n: sum(res["st"][1][n] for res in results) / world for n in ref_grads}
    _assert_grads_close(mean, ref_grads)
