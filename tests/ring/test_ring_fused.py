"""The fused distributed InfoNCE (``ds_infcl.loss.ring_fused``): the diagonal shortcut taken when
the caller passes ``labels=None`` gives the same loss and gradients as the general path with
``labels = arange(b)``, and both equal the fp64 reference, on 2 gloo ranks with unequal sizes
(one rank without queries too), by both algorithms (the ring with its exchange overlapped and not;
the gather path with its own block computed before the layout exchange and not); and one call
builds the small autograd graph
the shortcut is for (no ``key[labels]`` index node, one Function, the collectives' nodes)."""

from __future__ import annotations

import os

import pytest
import torch

from ds_infcl.ops.reference import contrastive_loss_reference
from tests.ring.ring_harness import record_calls, spawn

pytestmark = pytest.mark.slow

C, SCALE = 10, 7.0
# (per-rank query counts, keys per query): unequal sizes, a rank without queries, hard negatives.
LAYOUTS = [([3, 7], 1), ([0, 5], 1), ([4, 2], 2)]


def _cases():
    # The ring with each hop's exchange overlapped with the block's kernels ("1") and after them
    # ("0"); the gather path with its own block computed before the layout exchange (early) and
    # not; and the early block computed, then dropped because the layout picks the ring (auto with
    # a gather-bytes cap of 0, the rank's own prediction, ring_predicted, made to guess wrong).
    # The gather path also with its own block's backward run in the backward (else in the forward),
    # and with the Triton kernels (interpreted): its backward then adds the own block's share of
    # dq in the pass that scales dq (lse_backward_triton(dq_add=)).
    # ("gather*": pinned while GATHER_MAX_LOCAL would send these sizes to the ring; the pin keeps
    # the early own block.)
    variants = (("gather", "gather", "auto", False, True, "torch"), ("gather", "gather", "auto", True, True, "torch"),
                ("gather*", "gather", "auto", True, True, "torch"),
                ("gather", "gather", "auto", False, False, "torch"), ("gather", "gather", "auto", True, True, "triton"),
                ("ring", "ring", "1", False, True, "torch"), ("ring", "ring", "0", False, True, "torch"),
                ("ring", "auto", "auto", True, True, "torch"))
    return [dict(sizes=sizes, hard=hard, symmetric=sym, algorithm=alg, pin=pin, overlap=ov, early=early,
                 own_early=own_early, backend=backend)
            for sizes, hard in LAYOUTS for sym in (True, False)
            for alg, pin, ov, early, own_early, backend in variants]


def _data(case, seed):
    g = torch.Generator().manual_seed(seed)
    key_sizes = [b * case["hard"] for b in case["sizes"]]
    q = torch.nn.functional.normalize(torch.randn(sum(case["sizes"]), C, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(sum(key_sizes), C, generator=g), dim=1)
    return q, k, key_sizes


def _graph_names(fn):
    names, stack, seen = set(), [fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


def _worker(rank, world, cases):
    import torch.distributed as dist

    import ds_infcl.loss.algorithm as algorithm
    import ds_infcl.loss.ring_steps as steps
    import ds_infcl.loss.ring_fused as fused_mod
    from ds_infcl.loss import contrastive_loss
    from ds_infcl.loss.ring import last_algorithm

    early_blocks = record_calls(fused_mod, "own_block_early", lambda own: own is not None)
    max_bytes, max_local = algorithm.GATHER_MAX_BYTES, algorithm.GATHER_MAX_LOCAL
    predicted = fused_mod.ring_predicted
    all_reduces = record_calls(dist, "all_reduce")
    out = []
    for seed, case in enumerate(cases):
        q_all, k_all, key_sizes = _data(case, seed)
        q0, k0 = sum(case["sizes"][:rank]), sum(key_sizes[:rank])
        res = {}
        steps.RING_OVERLAP = case["overlap"]
        fused_mod.EARLY_MIN_LOGITS = 1 if case["early"] else 1 << 62
        algorithm.GATHER_MAX_BYTES = 0 if case["pin"] == "auto" else max_bytes
        algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS = 0 if case["own_early"] else 1 << 62
        algorithm.GATHER_MAX_LOCAL = 0 if case["algorithm"] == "gather*" else max_local
        fused_mod.ring_predicted = (lambda *_: False) if case["pin"] == "auto" else predicted
        for mode in ("none", "arange"):
            os.environ["DS_INFCL_ALGORITHM"] = case["pin"]
            early_blocks.clear()
            q = q_all[q0:q0 + case["sizes"][rank]].clone().requires_grad_(True)
            k = k_all[k0:k0 + key_sizes[rank]].clone().requires_grad_(True)
            s = torch.tensor(SCALE, requires_grad=True)
            labels = None if mode == "none" else torch.arange(q.shape[0])
            all_reduces.clear()
            loss = contrastive_loss(q, k, s, labels, symmetric=case["symmetric"], impl="infcl",
                                    backend=case["backend"], tile_size=4)
            names = _graph_names(loss.grad_fn)
            own_early = getattr(loss.grad_fn, "own_early", False)  # (the Function's ctx)
            forward_all_reduces = len(all_reduces)
            loss.backward()
            assert last_algorithm() == case["algorithm"].rstrip("*")
            res[mode] = dict(loss=loss.item(), dq=q.grad, dk=k.grad, ds=s.grad.item(), graph=names,
                             all_reduces=forward_all_reduces, early=early_blocks == [True],
                             own_early=own_early)
        os.environ.pop("DS_INFCL_ALGORITHM", None)
        out.append(res)
    return out


def test_diagonal_shortcut_matches_general_path_and_reference():
    cases = _cases()
    results = spawn(_worker, 2, cases, timeout=120)
    for seed, case in enumerate(cases):
        q, k, key_sizes = _data(case, seed)
        qd, kd = q.double().requires_grad_(True), k.double().requires_grad_(True)
        sd = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        glabels = torch.cat([torch.arange(b) + sum(key_sizes[:r]) for r, b in enumerate(case["sizes"])])
        ref = contrastive_loss_reference(qd, kd, sd, glabels, symmetric=case["symmetric"])
        ref.backward()
        for mode in ("none", "arange"):
            what = f"{case}, labels {mode}"
            outs = [res[seed][mode] for res in results]
            for r, o in enumerate(outs):
                assert abs(o["loss"] - ref.item()) <= 2e-6 * max(1.0, abs(ref.item())), (what, r)
                assert o["early"] == (case["early"] and case["sizes"][r] > 0), (what, r)
                assert o["own_early"] == (case["algorithm"] != "ring" and case["own_early"]), (what, r)
                # One Function: no index node for the positive keys (gathered inside, or not at all
                # on the diagonal) and no zero-weighted pairing terms' products and sums.
                assert "IndexBackward0" not in o["graph"], (what, r, o["graph"])
                assert "MulBackward0" not in o["graph"] and "SumBackward0" not in o["graph"], o["graph"]
            # rank r holds W * dL/dF_r (DESIGN.md 3.1): the mean over ranks is the global gradient
            dq = torch.cat([o["dq"] for o in outs]).double() / 2
            dk = torch.cat([o["dk"] for o in outs]).double() / 2
            assert torch.allclose(dq, qd.grad, rtol=0, atol=2e-5 * qd.grad.abs().max().item()), what
            assert torch.allclose(dk, kd.grad, rtol=0, atol=2e-5 * kd.grad.abs().max().item()), what
            ds_ref = sd.grad.item()
            assert abs(sum(o["ds"] for o in outs) / 2 - ds_ref) <= 1e-5 * max(1.0, abs(ds_ref)), what
            # The gather path's symmetric loss on the diagonal sends its row terms with the column
            # statistics: no all-reduce; labels on some rank need it.
            if case["algorithm"] != "ring":
                want = 0 if (case["symmetric"] and mode == "none") else 1
                assert [o["all_reduces"] for o in outs] == [want, want], what
        for r in range(2):  # the shortcut and the general path: the same numbers
            a, b = results[r][seed]["none"], results[r][seed]["arange"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), (case, r)
            for name in ("dq", "dk"):
                assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), (case, r, name)
            assert a["ds"] == pytest.approx(b["ds"], rel=1e-5, abs=1e-7), (case, r)


def _upstream_worker(rank, world, cases):
    """Per case: the gradients of the loss backpropagated with this rank's upstream gradient
    ``g[rank]``, the gather path with its own block's backward in the forward and in the backward."""
    import ds_infcl.loss.algorithm as algorithm
    import ds_infcl.loss.ring_steps as steps
    from ds_infcl.loss import contrastive_loss

    os.environ["DS_INFCL_ALGORITHM"] = "gather"
    out = []
    for seed, case in enumerate(cases):
        q_all, k_all, key_sizes = _data(case, seed)
        q0, k0 = sum(case["sizes"][:rank]), sum(key_sizes[:rank])
        res = {}
        for own_early in (True, False):
            algorithm.GATHER_OWN_BACKWARD_MIN_LOGITS = 0 if own_early else 1 << 62
            q = q_all[q0:q0 + case["sizes"][rank]].clone().requires_grad_(True)
            k = k_all[k0:k0 + key_sizes[rank]].clone().requires_grad_(True)
            s = torch.tensor(SCALE, requires_grad=True)
            labels = torch.arange(q.shape[0]) if case["arange"] else None
            loss = contrastive_loss(q, k, s, labels, symmetric=case["symmetric"], impl="infcl",
                                    backend="torch", tile_size=4)
            (loss * case["g"][rank]).backward()
            res[own_early] = dict(dq=q.grad, dk=k.grad, ds=s.grad.item(), own_early=loss.grad_fn.own_early)
        out.append(res)
    os.environ.pop("DS_INFCL_ALGORITHM")
    return out


def test_own_block_backward_in_forward_follows_each_ranks_upstream_gradient():
    """The gather path's own block, differentiated in the forward for the unit weight and scaled
    by the upstream gradient in the backward, gives the gradients of the backward computed whole:
    for one upstream gradient on every rank (then the reference's times g) and for a different
    one per rank (the own block's weights are all its rank's own); unequal sizes, a rank without
    queries, hard negatives."""
    cases = [dict(sizes=sizes, hard=hard, symmetric=sym, arange=arange, g=g)
             for sizes, hard in (([3, 7], 1), ([0, 5], 1), ([4, 2], 2)) for sym in (True, False)
             for arange in (False, True) for g in ((0.37, 0.37), (0.5, 2.0))]
    results = spawn(_upstream_worker, 2, cases, timeout=120)
    for seed, case in enumerate(cases):
        for r in range(2):
            on, off = results[r][seed][True], results[r][seed][False]
            assert on["own_early"] and not off["own_early"], case
            for name in ("dq", "dk"):  # the sums in another order: float32 rounding apart
                atol = 1e-6 * (off[name].abs().max().item() if off[name].numel() else 0.0)
                assert torch.allclose(on[name], off[name], rtol=0, atol=atol), (case, r, name)
            assert on["ds"] == pytest.approx(off["ds"], rel=1e-6, abs=1e-7), (case, r)
        if case["g"][0] == case["g"][1]:  # against the fp64 reference times g (rank r: W g dL/dF_r)
            q, k, key_sizes = _data(case, seed)
            qd, kd = q.double().requires_grad_(True), k.double().requires_grad_(True)
            sd = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
            glabels = torch.cat([torch.arange(b) + sum(key_sizes[:r]) for r, b in enumerate(case["sizes"])])
            (contrastive_loss_reference(qd, kd, sd, glabels, symmetric=case["symmetric"]) * case["g"][0]).backward()
            dq = torch.cat([results[r][seed][True]["dq"] for r in range(2)]).double() / 2
            dk = torch.cat([results[r][seed][True]["dk"] for r in range(2)]).double() / 2
            assert torch.allclose(dq, qd.grad, rtol=0, atol=2e-5 * qd.grad.abs().max().item()), case
            assert torch.allclose(dk, kd.grad, rtol=0, atol=2e-5 * kd.grad.abs().max().item()), case
