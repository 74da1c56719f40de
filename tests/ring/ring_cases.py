"""Case definitions and the worker of the distributed exactness tests (importable by spawn)."""

from __future__ import annotations

import itertools
import time

import torch

IMPLS = ("infcl", "vanilla", "local", "disco")
# The infcl implementation by either of its algorithms (ds_infcl.loss.algorithm.choose_algorithm picks
# by size; these tiny cases would all take "gather", so both are pinned here).
ALGORITHMS = ("ring", "gather")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Per-rank query counts: equal, unequal (one rank empty at 4 ranks).
SIZES = {
    1: {"equal": [5], "unequal": [5]},
    2: {"equal": [4, 4], "unequal": [3, 7]},
    3: {"equal": [4, 4, 4], "unequal": [1, 6, 3]},
    4: {"equal": [3, 3, 3, 3], "unequal": [2, 0, 5, 3]},
}


def loss_cases(world):
    """InfoNCE cases: every implementation x (one direction with hard negatives, symmetric) x
    dtype x (equal, unequal sizes)."""
    cases = []
    for impl, (direction, hard), dtype, sizes in itertools.product(
        IMPLS, [("one", 2), ("sym", 0)], DTYPES, ("equal", "unequal")
    ):
        for algorithm in ALGORITHMS if impl == "infcl" else (None,):
            cases.append(dict(kind="loss", impl=impl, symmetric=direction == "sym", hard=hard,
                              dtype=dtype, sizes=SIZES[world][sizes], c=12, scale=8.0, normalize=True,
                              algorithm=algorithm))
    # Symmetric with hard negatives (key-to-query over the positive keys), unnormalized features.
    for impl in IMPLS:
        for algorithm in ALGORITHMS if impl == "infcl" else (None,):
            cases.append(dict(kind="loss", impl=impl, symmetric=True, hard=1, dtype="fp32",
                              sizes=SIZES[world]["unequal"], c=9, scale=2.5, normalize=False, algorithm=algorithm))
    # The nn.Module with a learnable logit scale (the parameter ZeRO manages).
    for impl, sym, hard, algorithm in [("infcl", True, 0, "ring"), ("infcl", True, 0, "gather"),
                                       ("local", False, 1, None), ("vanilla", True, 0, None)]:
        cases.append(dict(kind="module", impl=impl, symmetric=sym, hard=hard, dtype="fp32",
                          sizes=SIZES[world]["unequal"], c=12, scale=8.0, normalize=True, algorithm=algorithm))
    return cases


def triton_cases():
    """The ring on the Triton backend (interpreter on CPU): a few small fp32 cases."""
    return [
        dict(kind="loss", impl="infcl", symmetric=sym, hard=hard, dtype="fp32", sizes=[3, 5], c=16,
             scale=6.0, normalize=True, backend="triton", algorithm=algorithm)
        for sym, hard in [(False, 1), (True, 0)] for algorithm in ALGORITHMS
    ] + [dict(kind="lse", exclude_positive=True, compute_col=True, hard=1, dtype="fp32",
              sizes=[3, 5], c=16, scale=6.0, normalize=True, backend="triton")]


def lse_cases(world):
    """The ``lse`` functional (ring_lse with more than one rank): exclusion and column flags."""
    return [
        dict(kind="lse", exclude_positive=ex, compute_col=col, hard=1, dtype="fp32",
             sizes=SIZES[world][sz], c=10, scale=5.0, normalize=True)
        for ex, col, sz in [(False, True, "unequal"), (True, True, "equal"), (True, False, "unequal"),
                            (False, False, "equal")]
    ] + [dict(kind="lse", exclude_positive=True, compute_col=True, hard=1, dtype="bf16",
              sizes=SIZES[world]["unequal"], c=10, scale=5.0, normalize=True)]


def case_data(case, seed):
    """Global inputs of a case: queries ``[B, c]``, keys ``[M, c]`` (rank-ordered, in the case's
    dtype), per-rank local labels, per-rank key counts and upstream weights for ``lse``."""
    g = torch.Generator().manual_seed(seed)
    sizes, c, hard = case["sizes"], case["c"], case["hard"]
    key_sizes = [b * (1 + hard) for b in sizes]
    q = torch.randn(sum(sizes), c, generator=g)
    k = torch.randn(sum(key_sizes), c, generator=g)
    if case["normalize"]:
        q = torch.nn.functional.normalize(q, dim=1)
        k = torch.nn.functional.normalize(k, dim=1)
    dtype = DTYPES[case["dtype"]]
    labels = [torch.randperm(m, generator=g)[:b] if hard else torch.arange(b)
              for b, m in zip(sizes, key_sizes)]
    grad_row = torch.rand(sum(sizes), generator=g)
    grad_col = torch.rand(sum(key_sizes), generator=g)
    return dict(query=q.to(dtype), key=k.to(dtype), labels=labels, key_sizes=key_sizes,
                grad_row=grad_row, grad_col=grad_col)


def _local(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def run_case(rank, case, seed, tile_size=3, group=None):
    """One rank's share of a case: loss value (or LSE vectors) and gradients."""
    import os

    os.environ["DS_INFCL_ALGORITHM"] = case.get("algorithm") or "auto"
    try:
        return _run_case(rank, case, seed, tile_size, group)
    finally:
        os.environ.pop("DS_INFCL_ALGORITHM", None)


def _run_case(rank, case, seed, tile_size, group):
    from ds_infcl.loss import contrastive_loss, lse

    data = case_data(case, seed)
    q = _local(data["query"], case["sizes"], rank).clone().requires_grad_(True)
    k = _local(data["key"], data["key_sizes"], rank).clone().requires_grad_(True)
    labels = data["labels"][rank]
    scale = torch.tensor(case["scale"], requires_grad=True)
    backend = case.get("backend", "torch")
    out = {}
    if case["kind"] == "loss":
        loss = contrastive_loss(q, k, scale, labels, symmetric=case["symmetric"], impl=case["impl"],
                                backend=backend, group=group, tile_size=tile_size)
        loss.backward()
        out["loss"] = loss.item()
        if case.get("algorithm") and torch.distributed.get_world_size() > 1:  # one rank: no ring at all
            from ds_infcl.loss.ring import last_algorithm

            assert last_algorithm() == case["algorithm"], (last_algorithm(), case)
    elif case["kind"] == "module":
        import math

        from ds_infcl.loss import ContrastiveLoss

        module = ContrastiveLoss(symmetric=case["symmetric"], impl=case["impl"], backend=backend,
                                 tile_size=tile_size, init_logit_scale=math.log(case["scale"]))
        loss = module(q, k, labels)
        loss.backward()
        out["loss"] = loss.item()
        # d loss / d logit_scale = scale * d loss / d scale: report it as a scale gradient.
        scale.grad = module.logit_scale.grad / case["scale"]
    else:
        row, col = lse(q, k, scale, labels=labels, exclude_positive=case["exclude_positive"],
                       compute_col=case["compute_col"], backend=backend, group=group,
                       tile_size=tile_size)
        obj = (row * _local(data["grad_row"], case["sizes"], rank)).sum()
        out["row"] = row.detach()
        if case["compute_col"]:
            obj = obj + (col * _local(data["grad_col"], data["key_sizes"], rank)).sum()
            out["col"] = col.detach()
        else:
            assert col is None
        obj.backward()
    out["dq"], out["dk"], out["ds"] = q.grad, k.grad, scale.grad.item()
    return out


def mismatch_cases(world):
    """Rank 1 disagrees with the others (feature dim, dtype) or fails its local checks (NaN rows,
    labels out of range)."""
    return [dict(impl=impl, what="dim") for impl in IMPLS + ("lse",)] + [
        dict(impl="infcl", what="dtype"), dict(impl="infcl", what="nan"),
        dict(impl="lse", what="nan"), dict(impl="vanilla", what="labels"),
    ]


def run_mismatch(rank, case):
    from ds_infcl.loss import contrastive_loss, lse

    bad = rank == 1
    c = 8 if (bad and case["what"] == "dim") else 16
    dtype = torch.bfloat16 if (bad and case["what"] == "dtype") else torch.float32
    q, k = torch.randn(4, c, dtype=dtype), torch.randn(4, c, dtype=dtype)
    if bad and case["what"] == "nan":
        q[2, 3] = float("nan")
    labels = torch.tensor([0, 1, 2, 7 if (bad and case["what"] == "labels") else 3])
    start = time.monotonic()
    try:
        if case["impl"] == "lse":
            lse(q, k, 5.0, backend="torch")
        else:
            contrastive_loss(q, k, 5.0, labels, impl=case["impl"], backend="torch")
    except ValueError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def check_default_group():
    """``group=None`` resolves to DeepSpeed's data-parallel group once DeepSpeed has a mesh or an
    mpu, and to torch's world group otherwise (a stub stands in for ``deepspeed.utils.groups``)."""
    import sys
    import types

    from ds_infcl.ring import default_group, group_size, resolve_group

    assert default_group() is None  # deepspeed not imported here
    stub = types.ModuleType("deepspeed.utils.groups")
    stub.mesh_device, stub.mpu = None, None
    sentinel = object()
    stub._get_data_parallel_group = lambda: sentinel
    sys.modules["deepspeed.utils.groups"] = stub
    try:
        assert default_group() is None  # plain data parallelism: the world group
        stub.mesh_device = object()
        assert default_group() is sentinel and resolve_group(None) is sentinel
        stub.mesh_device = None
        stub.mpu = object()
        assert default_group() is sentinel
    finally:
        del sys.modules["deepspeed.utils.groups"]
    assert group_size(None) == 1
    return True


def subgroup_cases():
    """Cases run on 2-rank subgroups {0, 2} and {1, 3} of a 4-rank world: group ranks differ from
    global ranks, so the P2P peers must be mapped (``dist.get_global_rank``)."""
    return [c for c in loss_cases(2) if c["dtype"] == "fp32" and c["sizes"] == SIZES[2]["unequal"]
            and c["kind"] == "loss"][:10] + lse_cases(2)[:2]


def worker(rank, world, payload):
    """Runs every case of ``payload`` on this rank (called under ``ring_harness.spawn``)."""
    import torch.distributed as dist

    if payload.get("forbid_communication"):
        def forbidden(*args, **kwargs):
            raise AssertionError("communication at world size 1")

        for name in ("all_gather_into_tensor", "all_reduce", "batch_isend_irecv", "isend", "irecv",
                     "all_gather", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast"):
            if hasattr(dist, name):
                setattr(dist, name, forbidden)
    results = {"cases": [run_case(rank, case, seed) for seed, case in enumerate(payload["cases"])]}
    results["mismatch"] = [run_mismatch(rank, case) for case in payload.get("mismatch", [])]
    if payload.get("subgroup_cases"):
        sub, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        results["subgroup"] = [run_case(dist.get_rank(sub), case, seed, group=sub)
                               for seed, case in enumerate(payload["subgroup_cases"])]
    if payload.get("check_default_group"):
        results["default_group"] = check_default_group()
    return results
