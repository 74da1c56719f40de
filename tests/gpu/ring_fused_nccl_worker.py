"""Worker of ``test_ring_fused_nccl.py`` (run by torchrun, one process per GPU): the fused
distributed InfoNCE (``ds_infcl.loss.ring_fused``) on NCCL with the Triton backend, by both
algorithms, ``labels=None`` (the diagonal shortcut, no positive-key gather) against explicit
``labels = arange(b)`` and the float64 reference of the global batch; unequal per-rank sizes,
one key per query and two (the shortcut's slice); the gather path also with its own block computed
before the layout exchange (``own_block_early``) and with its own block's backward run in the
backward instead of the forward (``own_backward_early``). Then the gather path with its local kernels
replayed from CUDA graphs (``ds_infcl.ops.infonce_graph.run_graphed``: the second call of a shape
captures, the third replays) against the same calls run eagerly, and its keys gathered by the copy
engines (``ds_infcl.loss.peer_copy``) against the process group's all-gather. Exit status 1 on any
failure."""

import os
import sys

import torch
import torch.distributed as dist

from ds_infcl.loss import contrastive_loss
from ds_infcl.ops.reference import contrastive_loss_reference

# Relative to the largest reference magnitude (as ring_nccl_worker.py): bf16 gradients are rounded.
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-4, 1.5e-2)}


def run(rank, world, device, dtype, symmetric, keys_per_query, algorithm, seed):
    sizes = [700 + 1111 * r for r in range(world)]
    key_sizes = [b * keys_per_query for b in sizes]
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(sum(sizes), 256, generator=g), dim=1).to(device, dtype)
    k = torch.nn.functional.normalize(torch.randn(sum(key_sizes), 256, generator=g), dim=1).to(device, dtype)
    qs, ks = sum(sizes[:rank]), sum(key_sizes[:rank])
    import ds_infcl.loss.algorithm as algorithm_mod
    import ds_infcl.loss.ring_fused as fused

    # "gather-early": the gather path with its own block computed before the layout exchange;
    # "gather-late": with its own block's backward run in the backward (else in the forward).
    early_min, fused.EARLY_MIN_LOGITS = fused.EARLY_MIN_LOGITS, (1 if algorithm == "gather-early" else 1 << 62)
    own_min = algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS
    algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS = 1 << 62 if algorithm == "gather-late" else 0
    os.environ["DS_INFCL_ALGORITHM"] = algorithm.split("-")[0]
    out = {}
    for mode in ("none", "arange"):
        ql = q[qs:qs + sizes[rank]].clone().requires_grad_(True)
        kl = k[ks:ks + key_sizes[rank]].clone().requires_grad_(True)
        s = torch.tensor(14.3, device=device, requires_grad=True)
        labels = None if mode == "none" else torch.arange(sizes[rank], device=device)
        loss = contrastive_loss(ql, kl, s, labels, symmetric=symmetric, backend="triton")
        loss.backward()
        ds = s.grad.clone()
        dist.all_reduce(ds)
        out[mode] = (loss.detach(), ql.grad / world, kl.grad / world, ds / world)
    os.environ.pop("DS_INFCL_ALGORITHM")
    fused.EARLY_MIN_LOGITS, algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS = early_min, own_min
    glabels = torch.cat([torch.arange(b) + sum(key_sizes[:r]) for r, b in enumerate(sizes)]).to(device)
    qr, kr = q.double().requires_grad_(True), k.double().requires_grad_(True)
    sr = torch.tensor(14.3, dtype=torch.float64, device=device, requires_grad=True)
    ref = contrastive_loss_reference(qr, kr, sr, glabels, symmetric=symmetric)
    ref.backward()
    want = (ref.detach(), qr.grad[qs:qs + sizes[rank]], kr.grad[ks:ks + key_sizes[rank]], sr.grad)

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    errs = [max(rel(a, b) for a, b in zip(out[mode][1:], want[1:])) for mode in out]
    loss_errs = [rel(out[mode][0], want[0]) for mode in out]
    same = max(rel(a, b) for a, b in zip(out["none"], out["arange"]))
    return max(loss_errs), max(errs), same


def graph_check(rank, world, device, early, own_early):
    """(largest relative difference graphed vs eager, bitwise equal, graphs kept, replays) of three
    calls per label mode of the gather path, with new inputs each call."""
    import ds_infcl.loss.algorithm as algorithm_mod
    import ds_infcl.loss.ring_fused as fused
    from ds_infcl.ops import infonce_graph as ig

    own_min, algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS = algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS, 0 if own_early else 1 << 62

    b = 700 + 1111 * rank
    os.environ["DS_INFCL_ALGORITHM"] = "gather"
    # early: the own block computed before the layout exchange (``own_block_early``), at any size.
    fused.EARLY_MIN_LOGITS, early_min = (1 if early else 1 << 62), fused.EARLY_MIN_LOGITS
    ig.MAX_GRAPHS, max_graphs = 12, ig.MAX_GRAPHS  # both label modes' graphs stay (10 with early)

    def call(seed, explicit):
        g = torch.Generator().manual_seed(1000 * seed + rank)
        q = torch.nn.functional.normalize(torch.randn(b, 256, generator=g), dim=1).to(device, torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(b, 256, generator=g), dim=1).to(device, torch.bfloat16)
        labels = torch.randperm(b, generator=g).to(device) if explicit else None
        q.requires_grad_(True)
        k.requires_grad_(True)
        s = torch.tensor(14.3 + seed, device=device, requires_grad=True)
        loss = contrastive_loss(q, k, s, labels, symmetric=True, backend="triton", check_finite=False)
        loss.backward()
        return [loss.detach(), q.grad, k.grad, s.grad]

    results = {}
    for mode in ("0", "auto"):
        ig.clear_graphs()
        ig.CUDA_GRAPH = mode
        results[mode] = [call(seed, explicit) for explicit in (False, True) for seed in range(3)]
    kept, replays = len(ig._GRAPHS), sorted(gr.replays for gr in ig._GRAPHS.values())
    ig.clear_graphs()
    ig.CUDA_GRAPH = "auto"
    fused.EARLY_MIN_LOGITS, ig.MAX_GRAPHS = early_min, max_graphs
    algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS = own_min
    os.environ.pop("DS_INFCL_ALGORITHM")

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    pairs = [(x, y) for got, want in zip(results["auto"], results["0"]) for x, y in zip(got, want)]
    return max(rel(x, y) for x, y in pairs), all(torch.equal(x, y) for x, y in pairs), kept, replays


def interleaved_check(rank, world, device, early, modes=(("0", "0"), ("auto", "0")), equal=False, skew=False):
    """Largest relative difference, graphs against eager, of two forwards followed by their two
    backwards (the second forward replays the graphs whose buffers the first backward needs: the
    own block's backward kept from the forward is computed again, ``outputs_intact``, and the
    later graphs read the query and the keys from the saved tensors, ``inputs_of``). Twice: with
    the same sizes on every rank, and with the second forward's sizes changed on every rank but
    rank 0 (whose own block then replays its graph while its rest of the forward takes another:
    the first backward may not read the query from the own block's graph). ``early``: the own
    block computed before the layout exchange. ``modes``: the two runs compared, each
    ``(DS_INFCL_CUDA_GRAPH, DS_INFCL_PEER_COPY)``, the copy engines taking every size when on
    (``ds_infcl.loss.peer_copy``; the default pair: eager against graphs, the process group's
    all-gather in both). ``equal``: every rank starts with the same sizes (the copy engines' keys
    pulled ahead of the layout). ``skew``: before the second run's interleaved calls, rank 0's
    transport is put one epoch ahead of the others' (ranks out of step: the layout must bring
    them back, with no wait left hanging). Returns ``(largest relative difference, bitwise
    equal)``."""
    from ds_infcl.loss import peer_copy
    from ds_infcl.ops import infonce_graph as ig

    import ds_infcl.loss.algorithm as algorithm_mod
    import ds_infcl.loss.ring_fused as fused

    os.environ["DS_INFCL_ALGORITHM"] = "gather"
    ig.MAX_GRAPHS, max_graphs = 16, ig.MAX_GRAPHS
    own_min, algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS = algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS, 0
    fused.EARLY_MIN_LOGITS, early_min = (1 if early else 1 << 62), fused.EARLY_MIN_LOGITS
    peer_mode, peer_min = peer_copy.PEER_COPY, peer_copy.PEER_COPY_MIN_ROWS
    peer_copy.PEER_COPY_MIN_ROWS = 0

    def inputs(seed, grown):
        b = 700 + (0 if equal else 1111 * rank) + (256 if grown and rank else 0)
        g = torch.Generator().manual_seed(100 * seed + rank)
        q = torch.nn.functional.normalize(torch.randn(b, 256, generator=g), dim=1).to(device, torch.bfloat16)
        k = torch.nn.functional.normalize(torch.randn(b, 256, generator=g), dim=1).to(device, torch.bfloat16)
        return q.requires_grad_(True), k.requires_grad_(True)

    def loss_of(q, k):
        return contrastive_loss(q, k, 14.3, symmetric=True, backend="triton", check_finite=False)

    results = {}
    for mode in modes:
        ig.clear_graphs()
        ig.CUDA_GRAPH = mode[0]
        peer_copy.PEER_COPY = mode[1]
        results[mode] = []
        for grown in (False, True):
            for seed in range(3):  # the shapes' graphs captured and replayed once
                loss_of(*inputs(seed, grown)).backward()
        if skew and rank == 0 and mode[1] == "1":
            next(t for t in peer_copy._TRANSPORTS.values() if t is not None).epoch += 1
        for second_grown in (False, True):
            (q1, k1), (q2, k2) = inputs(10, False), inputs(11, second_grown)
            loss1, loss2 = loss_of(q1, k1), loss_of(q2, k2)
            loss1.backward()
            loss2.backward()
            results[mode] += [loss1.detach(), q1.grad, k1.grad, loss2.detach(), q2.grad, k2.grad]
    ig.clear_graphs()
    ig.CUDA_GRAPH, ig.MAX_GRAPHS = "auto", max_graphs
    algorithm_mod.GATHER_OWN_BACKWARD_MIN_LOGITS, fused.EARLY_MIN_LOGITS = own_min, early_min
    peer_copy.PEER_COPY, peer_copy.PEER_COPY_MIN_ROWS = peer_mode, peer_min
    os.environ.pop("DS_INFCL_ALGORITHM")
    first, second = (results[mode] for mode in modes)
    return (max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()
                for x, y in zip(second, first)),
            all(torch.equal(x, y) for x, y in zip(second, first)))


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    failed, seed = 0, 0
    for dtype in (torch.bfloat16, torch.float32):
        for symmetric, kpq in ((True, 1), (True, 2), (False, 2)):
            for algorithm in ("gather", "gather-early", "gather-late", "ring"):
                seed += 1
                errs = run(rank, world, device, dtype, symmetric, kpq, algorithm, seed)
                errs = torch.tensor(errs, device=device)
                dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                loss_tol, grad_tol = TOL[dtype]
                # the shortcut and the general path: the same numbers up to the dtype's rounding
                ok = errs[0] <= loss_tol and errs[1] <= grad_tol and errs[2] <= grad_tol
                failed += not bool(ok)
                if rank == 0:
                    print(f"{'ok  ' if ok else 'FAIL'} W={world} {dtype} {'sym' if symmetric else 'one'} "
                          f"keys/query={kpq} {algorithm}: rel err loss {errs[0]:.2e} grads {errs[1]:.2e}, "
                          f"labels None vs arange {errs[2]:.2e}", flush=True)
    for early, own_early in ((False, True), (True, True), (False, False)):
        diff, bitwise, kept, replays = graph_check(rank, world, device, early, own_early)
        # Per label mode: the forward (with early: the own block and the rest), the statistics'
        # merge and the backward (with own_early: its two blocks, the own in the forward, the other
        # ranks' keys), each replayed at least twice.
        want = 2 * (3 + early + own_early)
        stats = torch.tensor([diff, float(not bitwise), float(kept != want or min(replays) < 2)], device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        # The same kernels on the same inputs: equal up to a product that cuBLAS schedules differently
        # under capture (an ulp of a bf16 gradient here and there).
        ok = stats[0] <= 2e-3 and stats[2] == 0
        failed += not bool(ok)
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} W={world} gather path{' (own block early)' if early else ''}"
                  f"{' (own backward in the forward)' if own_early else ''} "
                  f"replayed from CUDA graphs: graphs kept {kept} (want {want}), replays {replays}, largest "
                  f"rel diff to eager {stats[0]:.2e}, bitwise on every rank: {not bool(stats[1])}", flush=True)
    for early in (False, True):
        diff = torch.tensor([interleaved_check(rank, world, device, early)[0]], device=device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        ok = diff.item() <= 2e-3
        failed += not ok
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} W={world} gather path{' (own block early)' if early else ''}, two "
                  f"forwards then their backwards (same sizes; other ranks' sizes changed), graphs against "
                  f"eager: largest rel diff {diff.item():.2e}", flush=True)
    # The keys by the copy engines against the process group's all-gather (graphs on, the same
    # interleaved calls): the same bytes gathered, so bitwise the same results; and the copy
    # engines must have been used (a transport set up for the world group): pulled ahead of the
    # layout where the own block runs early and the sizes are equal, else staged, the barrier
    # protocol only to set up and to grow the buffers; and ranks put out of step must recover.
    from ds_infcl.loss import peer_copy

    def counts():
        got = [t.counts for t in peer_copy._TRANSPORTS.values() if t is not None]
        return dict(got[0]) if got else {"ahead": 0, "staged": 0, "barrier": 0}

    for early, equal, skew in ((False, False, False), (True, False, False), (True, True, False),
                               (True, True, True)):
        before = counts()
        _, same = interleaved_check(rank, world, device, early, modes=(("auto", "0"), ("auto", "1")),
                                    equal=equal, skew=skew)
        got = {k: counts()[k] - before[k] for k in before}
        # 10 calls per mode (six warm-up, four interleaved); with equal sizes the three first
        # warm-up calls and the two first forwards and the second's of the same size have them.
        want_ahead = (6 - skew) if early and equal else 0
        expected = got["ahead"] >= want_ahead and sum(got.values()) == 10 and got["barrier"] <= 2 + skew
        stats = torch.tensor([float(not same), float(not expected)], device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        ok = stats.sum().item() == 0
        failed += not ok
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} W={world} gather path{' (own block early)' if early else ''}"
                  f"{' equal sizes' if equal else ''}{' epochs skewed' if skew else ''}, keys by the copy "
                  f"engines against the all-gather: bitwise equal on every rank {not bool(stats[0])}, calls "
                  f"ahead / staged / barrier {got['ahead']} / {got['staged']} / {got['barrier']} (as expected on "
                  f"every rank: {not bool(stats[1])})", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
