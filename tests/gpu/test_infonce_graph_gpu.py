"""The single-device InfoNCE replayed from CUDA graphs (``ds_infcl.ops.infonce_graph``) against
the eager call on the same inputs (skipped without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_infonce_graph_gpu.py

Each case runs three calls of one shape with new inputs each (the first eager, the second
captures the forward and the backward, and in the default call without labels the value checks,
the third replays them) and compares loss and gradients with the eager call on the same
inputs; calls that interleave (two forwards, then their backwards in either order) too. The
kernels and tiles are the eager ones, so the results agree to the last bit except where cuBLAS
schedules a product differently under capture (then a 16-bit gradient moves by an ulp here and
there); each case prints whether they were bitwise equal.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.loss import contrastive_loss  # noqa: E402
from ds_infcl.ops import infonce_graph as ig  # noqa: E402
from tests.ops.accuracy import rel_err  # noqa: E402

# (b, m, c, dtype, symmetric, explicit labels)
CASES = [
    (8192, 8192, 512, torch.bfloat16, True, False),
    (8192, 8192, 512, torch.bfloat16, False, False),
    (1000, 3000, 72, torch.float16, False, True),
    (777, 777, 128, torch.float32, True, False),
    (1, 5, 64, torch.bfloat16, True, True),
    (4096, 2048, 256, torch.bfloat16, True, True),
]


def _inputs(b, m, c, dtype, labels, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(m, c, device="cuda", generator=g), dim=1).to(dtype)
    s = torch.tensor(10.0 + seed, device="cuda")
    lab = torch.randint(0, m, (b,), device="cuda", generator=g) if labels else None
    return q, k, s, lab


def _forward(q, k, s, lab, symmetric, check_finite=False):
    q, k, s = (t.clone().requires_grad_() for t in (q, k, s))
    loss = contrastive_loss(q, k, s, lab, symmetric=symmetric, backend="triton", check_finite=check_finite)
    return loss, (q, k, s)


def _grads(loss, leaves):
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


def _compare(got, want, dtype, what):
    bitwise = all(torch.equal(x, y) for x, y in zip(got, want))
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for name, x, y in zip(["loss", "dq", "dk", "dscale"], got, want):
        assert rel_err(x, y) <= (1e-6 if name in ("loss", "dscale") else tol), f"{what} {name}: {rel_err(x, y):.1e}"
    return bitwise


@pytest.mark.parametrize("check_finite", [False, True], ids=["unchecked", "default"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}-{'sym' if c[4] else 'one'}"
                         f"{'-labels' if c[5] else ''}")
def test_graph_replay_equals_eager(case, check_finite, monkeypatch):
    b, m, c, dtype, symmetric, labels = case
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "0")
    eager = [_grads(*_forward(*_inputs(b, m, c, dtype, labels, seed), symmetric)) for seed in range(3)]
    assert not ig._GRAPHS
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    graphed = [_grads(*_forward(*_inputs(b, m, c, dtype, labels, seed), symmetric, check_finite))
               for seed in range(3)]
    graphs = {k[0]: g for k, g in ig._GRAPHS.items()}
    assert sorted(graphs) == ["infonce_backward", "infonce_forward"], f"not captured: {sorted(graphs)}"
    assert all(g.replays == 2 for g in graphs.values())  # calls 2 and 3
    forward, backward = graphs["infonce_forward"], graphs["infonce_backward"]
    # the default call's value checks (no labels) run first in the forward's graph: three outputs
    # before the loss, of which the pinned sum and the event come back as they are
    skip = 3 if check_finite and not labels else 0
    host_side = {i for i in forward.kept if forward.out[i] is not None}  # (a one-way loss's col: None)
    assert host_side == ({1, 2} if skip else set())
    assert backward.args[0].data_ptr() == forward.args[0].data_ptr()  # read in place
    assert backward.args[4].data_ptr() == forward.out[skip + 1].data_ptr()  # the row LSE, in place
    bitwise = [_compare(gr, eg, dtype, f"call {i + 1}") for i, (gr, eg) in enumerate(zip(graphed, eager))]
    # Interleaved: two forwards, then the backwards in reverse order (the inputs are reloaded).
    losses = [_forward(*_inputs(b, m, c, dtype, labels, seed), symmetric, check_finite) for seed in (1, 2)]
    late = [_grads(*losses[1]), _grads(*losses[0])]
    _compare(late[0], eager[2], dtype, "interleaved 2")
    _compare(late[1], eager[1], dtype, "interleaved 1")
    # A retained graph's second backward after another call of the shape: the forward graph's
    # replay copied the first call's LSE vectors before overwriting them (Borrowed).
    loss, leaves = _forward(*_inputs(b, m, c, dtype, labels, 1), symmetric, check_finite)
    loss.backward(retain_graph=True)
    _forward(*_inputs(b, m, c, dtype, labels, 2), symmetric, check_finite)
    twice = _grads(loss, leaves)  # the gradients of two backwards, accumulated
    _compare([twice[0]] + [g / 2 for g in twice[1:]], eager[1], dtype, "retained graph, second backward")
    print(f"\ngraphed == eager ({b}x{m}x{c} {dtype} symmetric={symmetric} labels={labels}); bitwise: {bitwise}")
    ig.clear_graphs()


def test_large_shapes_and_captures_stay_eager(monkeypatch):
    """Under ``auto`` only shapes up to MAX_LOGITS are graphed; inside a caller's own capture the
    eager kernels are recorded (no nested capture)."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    q, k, s, _ = _inputs(16384, 16385, 32, torch.bfloat16, False, 0)  # b m just above 2^28
    assert q.shape[0] * k.shape[0] > ig.MAX_LOGITS
    for _ in range(3):
        _grads(*_forward(q, k, s, None, True))
    assert not ig._GRAPHS
    monkeypatch.setattr(ig, "CUDA_GRAPH", "1")
    for _ in range(2):
        _grads(*_forward(q, k, s, None, True))
    assert sorted(k[0] for k in ig._GRAPHS) == ["infonce_backward", "infonce_forward"]
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    q, k, s, _ = _inputs(256, 256, 64, torch.bfloat16, False, 0)
    q, k, s = (t.clone().requires_grad_() for t in (q, k, s))

    def step():
        q.grad = k.grad = s.grad = None
        contrastive_loss(q, k, s, symmetric=True, backend="triton", check_finite=False).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: the first sighting of the shape
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # the second sighting, but inside a capture: eager kernels, no graph of ours
    assert not ig._GRAPHS
    graph.replay()
    torch.cuda.synchronize()
    ig.clear_graphs()


def test_run_graphed_limits_and_borrowed_outputs(monkeypatch):
    """``run_graphed``: ``max_logits`` replaces MAX_LOGITS under ``auto``; borrowed outputs are the
    graph's own buffers (the same storage on every replay, refilled), the others fresh copies."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "auto")
    x = torch.randn(64, 8, device="cuda")

    def fn(a):
        return a * 2.0, a + 1.0

    for _ in range(3):
        ig.run_graphed("probe", fn, (x,), options=(), logits=ig.MAX_LOGITS + 1, backend="triton")
    assert not ig._GRAPHS  # above MAX_LOGITS: eager
    outs = []
    for i in range(4):
        y = x + i
        outs.append(ig.run_graphed("probe", fn, (y,), options=(), logits=ig.MAX_LOGITS + 1, backend="triton",
                                   max_logits=ig.MAX_LOGITS + 1, borrow=(1,)))
        torch.testing.assert_close(outs[-1][0], y * 2.0, rtol=0, atol=0)
        torch.testing.assert_close(outs[-1][1], y + 1.0, rtol=0, atol=0)
    assert len(ig._GRAPHS) == 1
    # calls 3 and 4 replayed: the borrowed output is the graph's buffer, the other a new tensor
    assert outs[2][1].data_ptr() == outs[3][1].data_ptr()
    assert outs[2][0].data_ptr() != outs[3][0].data_ptr()
    torch.testing.assert_close(outs[2][0], (x + 2) * 2.0, rtol=0, atol=0)  # not overwritten by call 4
    ig.clear_graphs()


def test_run_graphed_static_arguments(monkeypatch):
    """``run_graphed(static=...)``: a graph fed by another graph's borrowed output reads that buffer
    in place (captured on it, no copy); given another tensor, it copies it in and stays right."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "1")
    x = torch.randn(64, 8, device="cuda")

    def produce(a):
        return (a * 2.0,)

    def consume(p, a):
        return (p + a,)

    for i in range(4):
        y = x + i
        (p,) = ig.run_graphed("producer", produce, (y,), options=(), logits=1, backend="triton", borrow=(0,))
        (out,) = ig.run_graphed("consumer", consume, (p, y), options=(), logits=1, backend="triton", static=(0,))
        torch.testing.assert_close(out, y * 3.0, rtol=0, atol=0)
    consumer = next(g for k, g in ig._GRAPHS.items() if k[0] == "consumer")
    producer = next(g for k, g in ig._GRAPHS.items() if k[0] == "producer")
    assert consumer.args[0].data_ptr() == producer.out[0].data_ptr()  # the producer's buffer, in place
    assert consumer.args[1].data_ptr() != y.data_ptr()  # the other argument: a static copy
    # another tensor in the static place (e.g. the producer ran eagerly): copied in, right result
    z = torch.randn(64, 8, device="cuda")
    (out,) = ig.run_graphed("consumer", consume, (z, x), options=(), logits=1, backend="triton", static=(0,))
    torch.testing.assert_close(out, z + x, rtol=0, atol=0)
    ig.clear_graphs()


def test_run_graphed_shared_inputs_and_tokens(monkeypatch):
    """``inputs_of``: a later graph reads another graph's copies of its inputs in place while they
    hold the call's; a replay of either, or a copy into their buffers by another graph's call,
    ends that (so a backward that follows a second forward reads its own saved tensors). A
    ``static`` argument that is not a graph's buffer at capture is copied, never written."""
    ig.clear_graphs()
    monkeypatch.setattr(ig, "CUDA_GRAPH", "1")
    x = torch.randn(64, 8, device="cuda")

    def first(a):
        return (a * 2.0,)

    def second(a, p):
        return (a - p,)

    tokens = []
    for i in range(3):
        y = x + i
        (p,), tok = ig.run_graphed("first", first, (y,), options=(), logits=1, backend="triton", borrow=(0,),
                                   token=True)
        a_in = ig.inputs_of(tok)
        assert (a_in is None) == (i == 0)  # the first call runs eagerly
        (out,), tok2 = ig.run_graphed("second", second, (y if a_in is None else a_in[0], p), options=(), logits=1,
                                      backend="triton", static=(0, 1), token=True)
        torch.testing.assert_close(out, -y, rtol=0, atol=0)
        tokens.append((tok, tok2))
    first_g = next(g for k, g in ig._GRAPHS.items() if k[0] == "first")
    second_g = next(g for k, g in ig._GRAPHS.items() if k[0] == "second")
    assert second_g.args[0].data_ptr() == first_g.args[0].data_ptr()  # read in place
    tok, tok2 = tokens[2]
    assert ig.inputs_of(tok) is not None and ig.inputs_of(tok2) is not None and ig.outputs_intact(tok)
    # a replay of the first graph: its copies, and the second's that read them, hold another call's
    ig.run_graphed("first", first, (x + 7,), options=(), logits=1, backend="triton", borrow=(0,))
    assert ig.inputs_of(tok) is None and ig.inputs_of(tok2) is None and not ig.outputs_intact(tok)
    assert ig.outputs_intact(tok2)  # its own outputs: not replayed since
    # the second graph given other tensors: copied into the first's buffers, which counts as a change
    (p,), tok = ig.run_graphed("first", first, (x,), options=(), logits=1, backend="triton", borrow=(0,), token=True)
    z = torch.randn(64, 8, device="cuda")
    (out,) = ig.run_graphed("second", second, (z, p), options=(), logits=1, backend="triton", static=(0, 1))
    torch.testing.assert_close(out, z - 2.0 * x, rtol=0, atol=0)
    assert ig.inputs_of(tok) is None and not ig.outputs_intact(tok)
    # a static place that is no graph's buffer when captured: a copy, the caller's tensor untouched
    u, v = torch.randn(64, 8, device="cuda"), torch.randn(64, 8, device="cuda")
    for i in range(3):
        (out,) = ig.run_graphed("third", second, (u + i, v), options=(), logits=1, backend="triton", static=(0, 1))
    third = next(g for k, g in ig._GRAPHS.items() if k[0] == "third")
    assert third.static == frozenset() and third.args[1].data_ptr() != v.data_ptr()
    w = v.clone()
    (out,) = ig.run_graphed("third", second, (u, w + 1.0), options=(), logits=1, backend="triton", static=(0, 1))
    torch.testing.assert_close(out, u - (w + 1.0), rtol=0, atol=0)
    torch.testing.assert_close(v, w, rtol=0, atol=0)
    ig.clear_graphs()
