"""Across 2 and 3 gloo ranks, the retrieval loss and the sentence-transformers loss equal the
single-process reference on the gathered batch: the loss on every rank, and the gradients
after the data-parallel mean (DESIGN.md 3.1), with unequal sizes, hard negatives and
false-negative pairs that cross ranks."""

import pytest
import torch

from tests.adapters.test_retrieval import masked_reference
from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts
from tests.ring.ring_harness import spawn

pytestmark = pytest.mark.slow

SIZES = {2: [3, 5], 3: [4, 1, 3]}  # queries per rank
NUM_NEG = 2


def _feature_case(world):
    """Global features, per-rank slices, ids with duplicates inside and across ranks."""
    sizes = SIZES[world]
    B = sum(sizes)
    g = torch.Generator().manual_seed(world)
    q = torch.nn.functional.normalize(torch.randn(B, 16, generator=g), dim=1)
    # per rank: keys [P_r (b_r), N_r (b_r * NUM_NEG)] -> global order is rank by rank
    keys, ids, labels, qs = [], [], [], []
    next_id = 0
    for r, b in enumerate(sizes):
        k = torch.nn.functional.normalize(torch.randn(b * (1 + NUM_NEG), 16, generator=g), dim=1)
        keys.append(k)
        ids.append(torch.arange(next_id, next_id + k.shape[0]) * 31)
        next_id += k.shape[0]
        labels.append(torch.arange(b))
    # duplicates: rank 1's first negative repeats rank 0's first positive (cross-rank), rank 0's last
    # negative repeats its second positive (local), the last rank's first positive repeats rank 0's third
    ids[1][sizes[1]] = ids[0][0]
    ids[0][-1] = ids[0][1]
    ids[-1][0] = ids[0][2]
    return {"sizes": sizes, "q": q, "keys": keys, "ids": ids, "labels": labels}


def _worker(rank, world, payload):
    from ds_infcl.adapters.retrieval import load_sentence_transformer, retrieval_loss
    from ds_infcl.adapters.st_loss import InfCLMultipleNegativesRankingLoss

    out = {}
    case = payload["features"]
    off = sum(case["sizes"][:rank])
    q = case["q"][off : off + case["sizes"][rank]].clone().requires_grad_()
    k = case["keys"][rank].clone().requires_grad_()
    for symmetric in (False, True):
        loss = retrieval_loss(q, k, 20.0, case["labels"][rank], key_ids=case["ids"][rank], symmetric=symmetric)
        gq, gk = torch.autograd.grad(loss, (q, k))
        out[f"masked_{symmetric}"] = (loss.detach(), gq, gk)

    model = load_sentence_transformer(payload["model_dir"])
    cols = [c[rank] for c in payload["columns"]]
    loss_fn = InfCLMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = loss_fn([model.tokenize(c) for c in cols])
    loss.backward()
    out["st"] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_dist")))


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_equals_single_process(world, tiny_dir):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from ds_infcl.adapters.retrieval import load_sentence_transformer

    case = _feature_case(world)
    sizes = case["sizes"]
    texts = random_texts(sum(sizes) * (2 + NUM_NEG), seed=100 + world)
    B = sum(sizes)
    global_cols = [texts[i * B : (i + 1) * B] for i in range(2 + NUM_NEG)]
    offs = [sum(sizes[:r]) for r in range(world)]
    columns = [[col[o : o + s] for o, s in zip(offs, sizes)] for col in global_cols]
    results = spawn(_worker, world, {"features": case, "model_dir": tiny_dir, "columns": columns},
                    timeout=240.0, pg_timeout=90.0)

    # 1. masked feature-level loss: every rank returns the global loss; rank gradients are W times
    #    the gradient of the global loss (the data-parallel mean divides by W)
    keys = torch.cat(case["keys"])
    ids = torch.cat(case["ids"])
    koffs = [0]
    for k in case["keys"][:-1]:
        koffs.append(koffs[-1] + k.shape[0])
    labels = torch.cat([lab + o for lab, o in zip(case["labels"], koffs)])
    for symmetric in (False, True):
        q64 = case["q"].double().requires_grad_()
        k64 = keys.double().requires_grad_()
        ref = masked_reference(q64, k64, 20.0, labels, ids, ids[labels][:, None], symmetric)
        gq_ref, gk_ref = torch.autograd.grad(ref, (q64, k64))
        for r, res in enumerate(results):
            loss, gq, gk = res[f"masked_{symmetric}"]
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
            tol = 2e-5 * max(gq_ref.abs().max().item(), gk_ref.abs().max().item())  # fp32 vs fp64
            torch.testing.assert_close(gq.double() / world, gq_ref[offs[r] : offs[r] + sizes[r]], rtol=0, atol=tol)
            kk = case["keys"][r].shape[0]
            torch.testing.assert_close(gk.double() / world, gk_ref[koffs[r] : koffs[r] + kk], rtol=0, atol=tol)

    # 2. sentence-transformers loss: MNRL on the gathered batch, one process
    model = load_sentence_transformer(tiny_dir)
    ref_loss = MultipleNegativesRankingLoss(model)([model.tokenize(c) for c in global_cols], None)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for r, res in enumerate(results):
        torch.testing.assert_close(res["st"][0], ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, want in ref_grads.items():
        mean = sum(res["st"][1][name] for res in results) / world
        err = (mean - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item() + 1e-7, (name, err)
