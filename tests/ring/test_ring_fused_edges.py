"""Edge cases of the fused distributed InfoNCE (``ds_infcl.loss.ring_fused``) against the fp64
reference on the gathered batch, on 3 gloo ranks, by both algorithms (the gather path also with its
own block's backward in the forward and its all-to-all of the other keys' gradient), both directions:
duplicate labels (several queries share one positive key, some keys are nobody's positive), a
rank that holds keys but no queries, a rank with neither, fp16/bf16 inputs, a one-element scale
parameter, and a second backward through a retained graph (the gradients add up); a second
derivative refused on every rank; a rank with queries but no keys stopping every rank; a NaN key
on a keys-only rank (check_finite on and off)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ds_infcl.ops.reference import contrastive_loss_reference
from tests.ring.ring_harness import spawn

pytestmark = pytest.mark.slow

C, SCALE = 8, 6.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (loss, gradient) tolerances relative to the largest reference magnitude.
TOL = {"fp32": (2e-6, 2e-5), "bf16": (1e-2, 2e-2), "fp16": (2e-3, 4e-3)}

# Per rank: (query count, key count, labels as a list or None for the diagonal).
LAYOUTS = {
    # duplicates: queries 0, 1 and 4 of rank 0 share key 0; key 1 of rank 2 is nobody's positive
    "duplicates": [(5, 3, [0, 0, 2, 1, 0]), (2, 4, [3, 3]), (3, 3, [0, 2, 2])],
    # rank 1 holds keys but no queries (hard negatives of the others' queries)
    "keys_only": [(3, 3, None), (0, 4, None), (4, 6, [5, 0, 0, 3])],
    # rank 0 holds nothing at all
    "empty_rank": [(0, 0, None), (4, 4, [1, 1, 0, 3]), (2, 2, None)],
}


# The algorithms: the ring, the gather path, and the gather path with its own block's backward
# run in the forward (``own_backward_early``, off at these sizes by default), with the torch
# backend and with the Triton kernels (interpreted: the own block's sums scaled once with the
# other keys' block, in the pass that scales dq on the end ranks, by ``own_share`` on the middle
# one, whose other keys are two ranges).
ALGORITHMS = (("gather", False, "torch"), ("gather", True, "torch"), ("gather", True, "triton"),
              ("ring", False, "torch"))


def _cases():
    cases = []
    for layout in LAYOUTS:
        for sym in (True, False):
            for alg, own_early, backend in ALGORITHMS:
                cases.append(dict(layout=layout, symmetric=sym, algorithm=alg, own_early=own_early, dtype="fp32",
                                  backend=backend))
    for dtype in ("bf16", "fp16"):
        for alg, own_early, backend in ALGORITHMS:
            cases.append(dict(layout="duplicates", symmetric=True, algorithm=alg, own_early=own_early, dtype=dtype,
                              backend=backend))
    return cases


def _data(case, seed):
    g = torch.Generator().manual_seed(seed)
    rows = LAYOUTS[case["layout"]]
    q = torch.nn.functional.normalize(torch.randn(sum(r[0] for r in rows), C, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(sum(r[1] for r in rows), C, generator=g), dim=1)
    dtype = DTYPES[case["dtype"]]
    return q.to(dtype), k.to(dtype)


def _local(case, seed, rank):
    rows = LAYOUTS[case["layout"]]
    q, k = _data(case, seed)
    q0, k0 = sum(r[0] for r in rows[:rank]), sum(r[1] for r in rows[:rank])
    b, m, lab = rows[rank]
    labels = None if lab is None else torch.tensor(lab, dtype=torch.long)
    return q[q0:q0 + b], k[k0:k0 + m], labels


def _worker(rank, world, cases):
    import ds_infcl.loss.algorithm as algorithm
    from ds_infcl.loss import contrastive_loss
    from ds_infcl.loss.ring import last_algorithm

    out = []
    for seed, case in enumerate(cases):
        os.environ["DS_INFCL_ALGORITHM"] = case["algorithm"]
        algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS = 0 if case["own_early"] else 1 << 62
        q, k, labels = _local(case, seed, rank)
        q, k = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        s = torch.nn.Parameter(torch.full((1,), SCALE))  # a one-element parameter, as a module's
        loss = contrastive_loss(q, k, s, labels, symmetric=case["symmetric"], impl="infcl",
                                backend=case["backend"], tile_size=2)
        loss.backward(retain_graph=True)
        first = (q.grad.clone(), k.grad.clone(), s.grad.clone())
        loss.backward()  # the retained graph again: every gradient doubles
        assert last_algorithm() == case["algorithm"]
        assert getattr(loss.grad_fn, "own_early", False) == case["own_early"]
        out.append(dict(loss=loss.item(), first=first, second=(q.grad, k.grad, s.grad)))
    os.environ.pop("DS_INFCL_ALGORITHM", None)
    return out


def _reference(case, seed):
    rows = LAYOUTS[case["layout"]]
    q, k = _data(case, seed)
    qd, kd = q.double().requires_grad_(True), k.double().requires_grad_(True)
    sd = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    glabels, k0 = [], 0
    for b, m, lab in rows:
        glabels.append((torch.arange(b) if lab is None else torch.tensor(lab, dtype=torch.long)) + k0)
        k0 += m
    loss = contrastive_loss_reference(qd, kd, sd, torch.cat(glabels), symmetric=case["symmetric"])
    loss.backward()
    return loss.item(), qd.grad, kd.grad, sd.grad.item()


def _close(got, ref, rel, what):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    scale = max(ref.abs().max().item(), 1e-3)
    err = (got - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:.1e} * {scale:.3g}"


def test_fused_infonce_edge_cases_match_reference():
    cases = _cases()
    results = spawn(_worker, 3, cases, timeout=150)
    world = 3
    for seed, case in enumerate(cases):
        loss, dq, dk, ds = _reference(case, seed)
        loss_tol, grad_tol = TOL[case["dtype"]]
        outs = [res[seed] for res in results]
        for r, o in enumerate(outs):
            _close(o["loss"], loss, loss_tol, f"loss, rank {r}, {case}")
        for which, mult in (("first", 1), ("second", 2)):
            # rank r holds W * dL/dF_r (DESIGN.md 3.1): the mean over ranks is the global gradient
            got_dq = torch.cat([o[which][0].double() for o in outs]) / world / mult
            got_dk = torch.cat([o[which][1].double() for o in outs]) / world / mult
            got_ds = sum(o[which][2].double().sum().item() for o in outs) / world / mult
            _close(got_dq, dq, grad_tol, f"dq ({which} backward), {case}")
            _close(got_dk, dk, grad_tol, f"dk ({which} backward), {case}")
            _close(got_ds, ds, max(1e-5, loss_tol), f"dscale ({which} backward), {case}")


def _double_backward_worker(rank, world, payload):
    from ds_infcl.loss import contrastive_loss, lse

    out = {}
    for name in ("gather", "ring", "lse"):
        os.environ["DS_INFCL_ALGORITHM"] = "ring" if name == "lse" else name
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(3, C, generator=g).requires_grad_(True)
        k = torch.randn(4, C, generator=g).requires_grad_(True)
        if name == "lse":
            row, col = lse(q, k, 3.0, backend="torch")
            loss = row.sum() + col.sum()
        else:
            loss = contrastive_loss(q, k, 3.0, symmetric=True, impl="infcl", backend="torch")
        try:
            (gq,) = torch.autograd.grad(loss, q, create_graph=True)
            gq.pow(2).sum().backward()  # a gradient penalty: needs the second derivative
            out[name] = "no error"
        except RuntimeError as err:
            out[name] = str(err)
    os.environ.pop("DS_INFCL_ALGORITHM", None)
    return out


def test_double_backward_raises_a_clear_error_on_every_rank():
    """The distributed Functions are differentiable once: their backward runs collectives and
    kernels that build no graph (Triton's would silently drop the second-order terms), so a
    second derivative must fail plainly on every rank, before any collective, not with an
    in-place error from deep in the torch backend's backward after a collective ran under
    autograd (what it did)."""
    results = spawn(_double_backward_worker, 2, None, timeout=90)
    for rank, res in enumerate(results):
        for name, msg in res.items():
            assert "differentiable once" in msg and "create_graph" in msg, (rank, name, msg)


def _no_keys_worker(rank, world, payload):
    from ds_infcl.loss import contrastive_loss

    q = torch.randn(2, C)
    k = torch.randn(0 if rank == 1 else 3, C)  # rank 1: queries but no keys for their positives
    out = {}
    for name, labels in (("diagonal", None), ("labels", torch.tensor([0, 1]))):
        for alg in ("gather", "ring"):
            os.environ["DS_INFCL_ALGORITHM"] = alg
            try:
                contrastive_loss(q, k, 3.0, labels, symmetric=True, impl="infcl", backend="torch")
                out[(name, alg)] = None
            except ValueError as err:
                out[(name, alg)] = str(err)
    os.environ.pop("DS_INFCL_ALGORITHM", None)
    return out


def test_rank_with_queries_but_no_keys_stops_every_rank():
    """A query's positive lives on its rank: queries without local keys are a local input error,
    raised on that rank and announced to the others (no hang), whichever algorithm is pinned."""
    results = spawn(_no_keys_worker, 2, None, timeout=90)
    for rank, res in enumerate(results):
        for what, msg in res.items():
            assert msg is not None, (rank, what)
            if rank == 1:
                assert "keys" in msg, (what, msg)
            else:
                assert "rejected their local inputs" in msg, (what, msg)


def _nan_key_worker(rank, world, payload):
    from ds_infcl.loss import contrastive_loss

    out = {}
    for alg in ("gather", "ring"):
        os.environ["DS_INFCL_ALGORITHM"] = alg
        q = torch.randn(0 if rank == 1 else 3, C)  # rank 1 holds keys only, one of them NaN
        k = torch.randn(4 if rank == 1 else 3, C)
        if rank == 1:
            k[2, 0] = float("nan")
        try:
            contrastive_loss(q, k, 3.0, symmetric=True, impl="infcl", backend="torch")
            out[(alg, True)] = None
        except ValueError as err:
            out[(alg, True)] = str(err)
        loss = contrastive_loss(q, k, 3.0, symmetric=True, impl="infcl", backend="torch", check_finite=False)
        out[(alg, False)] = loss.item()
    os.environ.pop("DS_INFCL_ALGORITHM", None)
    return out


def test_nan_key_on_a_rank_without_queries():
    """check_finite on a keys-only rank: a NaN key is refused on every rank; without the check the
    NaN reaches every rank's loss (it is a negative of every query), and nothing hangs."""
    results = spawn(_nan_key_worker, 2, None, timeout=90)
    for rank, res in enumerate(results):
        for alg in ("gather", "ring"):
            msg = res[(alg, True)]
            assert msg is not None, (rank, alg)
            assert ("finite" in msg.lower() or "nan" in msg.lower()) if rank == 1 else "rejected" in msg, msg
            assert res[(alg, False)] != res[(alg, False)], (rank, alg, res[(alg, False)])  # NaN


def _algorithm_setting_worker(rank, world, rank1_setting):
    """Rank 1 runs the loss with DS_INFCL_ALGORITHM=``rank1_setting``, rank 0 with it unset; returns
    the ValueError's message (or "no error")."""
    from ds_infcl.loss import contrastive_loss

    if rank == 1:
        os.environ["DS_INFCL_ALGORITHM"] = rank1_setting
    else:
        os.environ.pop("DS_INFCL_ALGORITHM", None)
    q = torch.nn.functional.normalize(torch.randn(4, C), dim=1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(4, C), dim=1).requires_grad_()
    try:
        contrastive_loss(q, k, torch.tensor(SCALE), symmetric=True, impl="infcl", backend="torch")
    except ValueError as err:
        return str(err)
    return "no error"


def test_ranks_with_different_algorithm_settings_stop_with_one_error():
    # Rank 1 was launched with another algorithm pinned: every rank must stop with the same error,
    # before either algorithm's collectives start (on NCCL they would wait on each other forever).
    results = spawn(_algorithm_setting_worker, 2, "ring", timeout=90)
    for rank, msg in enumerate(results):
        assert "disagree on the algorithm settings" in msg and "DS_INFCL_ALGORITHM" in msg, (rank, msg)


def test_a_bad_algorithm_setting_on_one_rank_stops_every_rank():
    # Rank 1 has a DS_INFCL_ALGORITHM that names no algorithm: it raises before the layout exchange
    # (ring_fused.own_block_early, as choose_algorithm would), and tells rank 0, which raises too.
    rank0, rank1 = spawn(_algorithm_setting_worker, 2, "fast", timeout=90)
    assert rank1 == "DS_INFCL_ALGORITHM must be auto, ring or gather, got 'fast'", rank1
    assert "rank(s) [1] of the process group rejected their local inputs" in rank0, rank0


def _staged_worker(rank, world, payload):
    from ds_infcl.ring.layout import exchange_layout

    q, k = torch.zeros(3 + rank, C), torch.zeros(5 - rank, C)
    tagged = exchange_layout(q, k, None, staged=(7 + rank) * rank)  # rank 0 untagged
    plain = exchange_layout(q, k, None)
    return tagged.staged, plain.staged, tagged.key_sizes


def test_the_layout_carries_every_ranks_staged_tag_unchecked():
    """``exchange_layout(staged=...)`` hands every rank all ranks' tags in rank order, without
    requiring them to agree (the copy-engine keys' epochs, ds_infcl.loss.peer_copy); 0 by default."""
    for staged, plain, key_sizes in spawn(_staged_worker, 3, None, timeout=90):
        assert staged == (0, 8, 18) and plain == (0, 0, 0) and key_sizes == (5, 4, 3)


def _import_error(module: str, **env) -> str:
    r = subprocess.run([sys.executable, "-c", f"import {module}"], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    return r.stderr


@pytest.mark.parametrize("name, value, want", [
    ("DS_INFCL_GATHER_EARLY_MIN_LOGITS", "16k", "must be an integer >= 0, got '16k'"),
    ("DS_INFCL_GATHER_MAX_LOCAL", "-1", "must be an integer >= 0, got '-1'"),
    ("DS_INFCL_GATHER_MAX_BYTES", "0.5GiB", "must be an integer >= 0, got '0.5GiB'"),
    ("DS_INFCL_RING_OVERLAP_MAX_ROWS", "", "must be an integer >= 0, got ''"),
    ("DS_INFCL_PEER_COPY_MIN_ROWS", "-5", "must be an integer >= 0, got '-5'"),
    ("DS_INFCL_PEER_COPY", "auto", "must be 0 or 1, got 'auto'"),
])
def test_bad_algorithm_settings_stop_the_import(name, value, want):
    """Each integer setting of the algorithms is read at import: a bad value stops the process
    before any collective, naming the variable."""
    assert f"{name} {want}" in _import_error("ds_infcl.loss.ring_fused", **{name: value})
