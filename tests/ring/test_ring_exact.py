"""Every loss implementation across 1-4 gloo ranks equals the fp64 single-process reference on
the gathered batch: the loss on every rank, and the gradients after the data-parallel mean
(DESIGN.md 3.1). Also the ``lse`` functional (the ring) and the cross-rank metadata check."""

from __future__ import annotations

import pytest
import torch

from ds_infcl.ops.reference import contrastive_loss_reference, lse_reference
from tests.ring.ring_cases import (
    case_data, loss_cases, lse_cases, mismatch_cases, subgroup_cases, triton_cases, worker,
)
from tests.ring.ring_harness import spawn

pytestmark = pytest.mark.slow

# (loss, gradient) tolerances relative to the largest reference magnitude. Accumulation is fp32
# on every path; bf16 gradients are rounded to bf16 (relative step 2**-8) when returned.
TOL = {"fp32": (2e-6, 2e-5), "bf16": (2e-6, 1.2e-2)}


def _global_labels(labels, key_sizes):
    offsets = torch.tensor([0] + key_sizes[:-1]).cumsum(0)
    return torch.cat([lab + off for lab, off in zip(labels, offsets.tolist())])


def _reference(case, seed):
    data = case_data(case, seed)
    q = data["query"].double().requires_grad_(True)
    k = data["key"].double().requires_grad_(True)
    s = torch.tensor(case["scale"], dtype=torch.float64, requires_grad=True)
    glabels = _global_labels(data["labels"], data["key_sizes"])
    ref = {}
    if case["kind"] in ("loss", "module"):
        loss = contrastive_loss_reference(q, k, s, glabels, symmetric=case["symmetric"])
        ref["loss"] = loss.item()
        loss.backward()
    else:
        row, col = lse_reference(q, k, s, labels=glabels, exclude_positive=case["exclude_positive"])
        obj = (row * data["grad_row"].double()).sum()
        ref["row"] = row.detach()
        if case["compute_col"]:
            obj = obj + (col * data["grad_col"].double()).sum()
            ref["col"] = col.detach()
        obj.backward()
    ref["dq"], ref["dk"], ref["ds"] = q.grad, k.grad, s.grad.item()
    return ref, data


def _close(got, ref, rel, what):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    if ref.numel() == 0:
        assert got.numel() == 0, what
        return
    scale = max(ref.abs().max().item(), 1e-3)
    err = (got - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:.1e} * {scale:.3g}"


def check_results(cases, results, world):
    """Compare every rank's outputs with the reference; gradients after the mean over ranks."""
    for seed, case in enumerate(cases):
        ref, data = _reference(case, seed)
        name = f"{world} ranks, case {seed}: {case}"
        loss_tol, grad_tol = TOL[case["dtype"]]
        outs = [res["cases"][seed] for res in results]
        if case["kind"] in ("loss", "module"):
            # Rank r's feature gradient is W * dL/dF_r, so that the mean of the tower gradients
            # over ranks equals the global one: divide by W before comparing.
            factor = world
            for r, out in enumerate(outs):
                _close(out["loss"], ref["loss"], loss_tol, f"loss on rank {r}, {name}")
        else:
            # lse: the gradient of the sum over ranks of each rank's objective, no factor.
            factor = 1
            for key in ("row", "col"):
                if key in ref:
                    _close(torch.cat([o[key] for o in outs]), ref[key], 1e-5, f"{key}, {name}")
        _close(torch.cat([o["dq"] for o in outs]) / factor, ref["dq"], grad_tol, f"dq, {name}")
        _close(torch.cat([o["dk"] for o in outs]) / factor, ref["dk"], grad_tol, f"dk, {name}")
        ds = sum(o["ds"] for o in outs) / factor  # the mean over ranks (loss), the sum (lse)
        _close(ds, ref["ds"], 1e-5, f"scale gradient, {name}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_impls_match_reference(world):
    cases = loss_cases(world) + lse_cases(world) + (triton_cases() if world == 2 else [])
    mismatch = mismatch_cases(world) if world == 3 else []
    subgroup = subgroup_cases() if world == 4 else []
    payload = {"cases": cases, "mismatch": mismatch, "subgroup_cases": subgroup}
    results = spawn(worker, world, payload, timeout=150)
    check_results(cases, results, world)
    for members in ([0, 2], [1, 3]) if subgroup else ():  # 2-rank subgroups of the 4-rank world
        sub_results = [{"cases": results[r]["subgroup"]} for r in members]
        check_results(subgroup, sub_results, 2)
    for i, case in enumerate(mismatch):
        for r, res in enumerate(results):
            out = res["mismatch"][i]
            assert out["error"] is not None, f"rank {r} did not raise on {case}"
            if case["what"] in ("dim", "dtype"):  # every rank lists the ranks' metadata
                word = "feature dim" if case["what"] == "dim" else "dtype"
                assert word in out["error"] and "rank 1" in out["error"], out["error"]
            elif r == 1:  # the rank with the bad input raises its own check's error
                word = "NaN" if case["what"] == "nan" else "labels must lie in"
                assert word in out["error"], out["error"]
            else:  # the others are told which rank rejected its inputs
                assert "rank(s) [1]" in out["error"], out["error"]
            assert out["seconds"] < 10, f"rank {r} took {out['seconds']:.1f} s to raise on {case}"


def test_world_size_one_does_no_communication():
    """A one-rank group: every implementation matches the reference with every collective and
    P2P function replaced by one that fails. Also the resolution of ``group=None``."""
    cases = loss_cases(1) + lse_cases(1)
    payload = {"cases": cases, "forbid_communication": True, "check_default_group": True}
    results = spawn(worker, 1, payload, timeout=90)
    check_results(cases, results, 1)
    assert results[0]["default_group"] is True
