"""Cases and the worker of the distributed SigLIP tests (importable by spawn)."""

from __future__ import annotations

import os

import torch

from ds_infcl import settings
from ds_infcl.loss import SigLIPLoss, siglip_loss
from ds_infcl.loss.siglip import last_siglip_algorithm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Per-rank row counts: equal, unequal (one rank empty at 4 ranks).
SIZES = {
    2: {"equal": [4, 4], "unequal": [3, 7]},
    3: {"equal": [4, 4, 4], "unequal": [1, 6, 3]},
    4: {"equal": [3, 3, 3, 3], "unequal": [2, 0, 5, 3]},
}
# The Triton kernels under the interpreter (TRITON_INTERPRET=1 is inherited from tests/conftest.py)
# on blocks of G of 32 x 32 (DS_INFCL_TRITON_CHUNK), so that the ring's accumulators take several
# ragged blocks per step; one rank with no rows at 3 ranks.
TRITON_SIZES = {2: [40, 70], 3: [33, 0, 50], 4: [20, 45, 1, 33]}
TRITON_CHUNK = "32x32"
OPENCLIP_IMPLS = ("bidir", "shift", "reduce", "gather")
UPSTREAM = 0.37


# Both algorithms (DS_INFCL_ALGORITHM pinned; "auto" takes the gather path at these sizes).
ALGORITHMS = ("ring", "gather")


def cases(world):
    out = []
    for algorithm in ALGORITHMS:
        for sizes in ("equal", "unequal"):
            for pos, dtype in (("diag", "fp32"), ("labels", "fp32"), ("ids", "fp32"), ("diag", "bf16")):
                out.append(dict(kind="ours", sizes=SIZES[world][sizes], pos=pos, dtype=dtype, c=12,
                                algorithm=algorithm))
        out.append(dict(kind="module", sizes=SIZES[world]["unequal"], pos="diag", dtype="fp32", c=12,
                        algorithm=algorithm))
        out.append(dict(kind="ours", sizes=SIZES[world]["unequal"], pos="labels", dtype="fp16", c=12,
                        algorithm=algorithm))
        # bf16 is left out of the interpreter (its bf16 dot is wrong; tests/gpu covers it).
        for pos, dtype in (("labels", "fp32"), ("ids", "fp16")):
            out.append(dict(kind="ours", sizes=TRITON_SIZES[world], pos=pos, dtype=dtype, c=12, backend="triton",
                            algorithm=algorithm))
    # The default choice, with the module's learnable scale and bias.
    out.append(dict(kind="module", sizes=SIZES[world]["equal"], pos="diag", dtype="fp32", c=12, algorithm="auto"))
    for impl in OPENCLIP_IMPLS:
        out.append(dict(kind="openclip", impl=impl, sizes=SIZES[world]["equal"], pos="diag", dtype="fp32", c=12))
    # Our drop-in with OpenCLIP's signature (ds_infcl.adapters.open_clip_loss), unequal sizes too.
    for sizes in ("equal", "unequal"):
        out.append(dict(kind="dropin", sizes=SIZES[world][sizes], pos="diag", dtype="fp32", c=12))
    return out


def case_data(case, seed):
    """Global inputs (rank-ordered): features, per-rank labels (local), global ids, per-rank key
    counts (2 keys per query with labels: hard negatives)."""
    g = torch.Generator().manual_seed(seed)
    sizes, c = case["sizes"], case["c"]
    key_sizes = [2 * b if case["pos"] == "labels" else b for b in sizes]
    q = torch.nn.functional.normalize(torch.randn(sum(sizes), c, generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(sum(key_sizes), c, generator=g), dim=1)
    labels = [torch.randint(0, max(m, 1), (b,), generator=g) for b, m in zip(sizes, key_sizes)]
    qids = torch.randint(0, 4, (sum(sizes),), generator=g)
    kids = torch.randint(0, 4, (sum(key_sizes),), generator=g)
    dtype = DTYPES[case["dtype"]]
    return dict(query=q.to(dtype), key=k.to(dtype), labels=labels, key_sizes=key_sizes, query_ids=qids,
                key_ids=kids, scale=9.0, bias=-4.0)


def _slice(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def run_case(case, seed, rank, world):
    """The case on this rank: loss, gradients and, for our loss, the algorithm it took."""
    algorithm = case.get("algorithm")
    if algorithm is None:
        return _run_case(case, seed, rank, world)
    with settings.override("DS_INFCL_ALGORITHM", algorithm):
        out = _run_case(case, seed, rank, world)
    out["algorithm"] = last_siglip_algorithm()
    return out


def _run_case(case, seed, rank, world):
    data = case_data(case, seed)
    sizes, key_sizes = case["sizes"], data["key_sizes"]
    q = _slice(data["query"], sizes, rank).clone().requires_grad_(True)
    k = _slice(data["key"], key_sizes, rank).clone().requires_grad_(True)
    kwargs = {}
    if case["pos"] == "labels":
        kwargs["labels"] = data["labels"][rank]
    elif case["pos"] == "ids":
        kwargs.update(query_ids=_slice(data["query_ids"], sizes, rank), key_ids=_slice(data["key_ids"], key_sizes, rank))
    if case["kind"] == "module":
        mod = SigLIPLoss(init_logit_scale=float(torch.tensor(data["scale"]).log()), init_logit_bias=data["bias"])
        loss = mod(q, k, **kwargs)
        (loss * UPSTREAM).backward()
        ds = mod.logit_scale.grad / mod.scale.detach()  # d/ds from d/dlogit_scale
        return dict(loss=loss.item(), dq=q.grad, dk=k.grad, ds=ds.item(), dt=mod.logit_bias.grad.item())
    s = torch.tensor(data["scale"], requires_grad=True)
    t = torch.tensor(data["bias"], requires_grad=True)
    if case["kind"] == "openclip":
        from tests.loss.openclip_ref import openclip_loss_module

        oc = openclip_loss_module()
        loss = oc.SigLipLoss(rank=rank, world_size=world, dist_impl=case["impl"])(q, k, s, t)
    elif case["kind"] == "dropin":
        from ds_infcl.adapters.open_clip_loss import SigLipLoss

        loss = SigLipLoss(rank=rank, world_size=world)(q, k, s, t)
    elif case.get("backend") == "triton":
        os.environ["DS_INFCL_TRITON_CHUNK"] = TRITON_CHUNK
        try:
            loss = siglip_loss(q, k, s, t, backend="triton", **kwargs)
            (loss * UPSTREAM).backward()
        finally:
            del os.environ["DS_INFCL_TRITON_CHUNK"]
        return dict(loss=loss.item(), dq=q.grad, dk=k.grad, ds=s.grad.item(), dt=t.grad.item())
    else:
        loss = siglip_loss(q, k, s, t, **kwargs)
    (loss * UPSTREAM).backward()
    return dict(loss=loss.item(), dq=q.grad, dk=k.grad, ds=s.grad.item(), dt=t.grad.item())


def worker(rank, world, payload):
    results = []
    for i, case in enumerate(payload["cases"]):
        results.append(run_case(case, 100 + i, rank, world))
    # A mismatched rank (another feature dim) errors on every rank, no hang.
    q = torch.randn(3, 8 if rank == 0 else 6)
    try:
        siglip_loss(q, q.clone(), 5.0, -1.0)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    # A bad input on one rank only (NaN features) raises on every rank.
    q = torch.randn(3, 8)
    if rank == world - 1:
        q[1, 2] = float("nan")
    try:
        siglip_loss(q, q.clone(), 5.0, -1.0)
        nan_error = None
    except ValueError as err:
        nan_error = str(err)
    return dict(results=results, mismatch=mismatch, nan_error=nan_error)
