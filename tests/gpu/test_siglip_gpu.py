"""The SigLIP Triton kernels on a CUDA GPU against the float64 reference (skipped without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_siglip_gpu.py

Odd shapes (b = 1, 1,000, b != m both ways), a benchmark shape (16,384 x 512, against the
tiled float64 path), bf16/fp16/fp32, diagonal / labels / multi-positive ids, scale and bias at
SigLIP's start (10, -10) and unnormalized large logits. Tolerances as tests/ops/test_siglip.py:
fp32 within 1e-5 relative; 16-bit within twice plain PyTorch's error in that dtype or 1.5x the
error of exact arithmetic on the rounded inputs, and for bf16 at least 5e-3 (G is stored once in
bf16 as the operand of the dq/dk products). A loss step is also captured in a CUDA graph and
replayed on new inputs. Each case prints its errors.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.bench.loss import capture_graph  # noqa: E402
from ds_infcl.loss import siglip_loss  # noqa: E402
from ds_infcl.ops.siglip import siglip_backward_torch, siglip_forward_torch, siglip_ids, siglip_reference  # noqa: E402
from tests.ops.accuracy import error_bound, features, rel_err  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positives(kind, b, m):
    g = torch.Generator(device="cuda").manual_seed(7)
    if kind == "labels":
        return {"labels": torch.randint(0, m, (b,), device="cuda", generator=g)}
    if kind == "ids":
        return {"query_ids": torch.randint(0, 50, (b,), device="cuda", generator=g),
                "key_ids": torch.randint(0, 50, (m,), device="cuda", generator=g)}
    return {}


def _run(fn, q, k, scale, bias, dtype, upstream=0.37):
    qq = q.detach().to(dtype).clone().requires_grad_()
    kk = k.detach().to(dtype).clone().requires_grad_()
    f = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.tensor(scale, device="cuda", dtype=f, requires_grad=True)
    t = torch.tensor(bias, device="cuda", dtype=f, requires_grad=True)
    loss = fn(qq, kk, s, t)
    (loss * upstream).backward()
    return [loss.detach(), qq.grad, kk.grad, s.grad, t.grad]


CASES = [(1, 1000, 512, 10.0, -10.0, "diag"), (1000, 1000, 768, 10.0, -10.0, "diag"),
         (1000, 3001, 512, 10.0, -10.0, "labels"), (3001, 1000, 72, 3.0, -2.0, "ids"),
         (777, 999, 512, 100.0, -10.0, "labels")]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("b,m,c,scale,bias,kind", CASES)
def test_kernels_match_float64(dtype, b, m, c, scale, bias, kind):
    q, k = features(b, m, c, seed=b + m, normalize=scale < 100, device="cuda")
    pos = _positives(kind, b, m)
    dt = DTYPES[dtype]
    ours = _run(lambda *a: siglip_loss(*a, backend="triton", **pos), q, k, scale, bias, dt)
    ref = _run(lambda *a: siglip_reference(*a, **pos), q, k, scale, bias, torch.float64)
    plain = floor = None
    if dt != torch.float32:
        plain = _run(lambda *a: siglip_reference(*a, upcast=False, **pos), q, k, scale, bias, dt)
        floor = _run(lambda *a: siglip_reference(*a, **pos), q.to(dt).double(), k.to(dt).double(), scale, bias,
                     torch.float64)
    for i, name in enumerate(("loss", "dq", "dk", "dscale", "dbias")):
        err = rel_err(ours[i], ref[i])
        bound = error_bound(dt, 0.0 if plain is None else rel_err(plain[i], ref[i]))
        if floor is not None:
            bound = max(bound, 1.5 * rel_err(floor[i], ref[i]) + 1e-6)
        if dt == torch.bfloat16 and i in (1, 2):
            bound = max(bound, 5e-3)
        print(f"siglip {dtype} b={b} m={k.shape[0]} c={c} {kind} {name}: err {err:.2e} bound {bound:.2e}")
        assert err <= bound, f"{name}: {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_benchmark_shape_against_tiled_fp32(dtype):
    # 16,384 x 512: the float64 b x b reference would take 2 GiB per matrix; the tiled path in
    # float32 on the same rounded inputs is a reference far more accurate than 16-bit.
    b, c = 16384, 512
    q, k = features(b, b, c, seed=3, device="cuda")
    dt = DTYPES[dtype]
    qq, kk = q.to(dt), k.to(dt)
    s, t = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    qid, kid = siglip_ids(b, b, q.device)
    want = siglip_forward_torch(qq, kk, s, t, qid, kid, tile_b=4096, tile_m=4096) / b
    got = siglip_loss(qq, kk, s, t, backend="triton")
    assert rel_err(got, want) <= 1e-5, (got.item(), want.item())
    dq, dk, ds, dbias = siglip_backward_torch(qq, kk, s, t, qid, kid, torch.tensor(1.0 / b, device="cuda"),
                                              tile_b=4096, tile_m=4096)
    qg, kg = qq.clone().requires_grad_(), kk.clone().requires_grad_()
    sg, tg = s.clone().requires_grad_(), t.clone().requires_grad_()
    siglip_loss(qg, kg, sg, tg, backend="triton").backward()
    for name, got_g, ref_g, bound in (("dq", qg.grad, dq, 5e-3), ("dk", kg.grad, dk, 5e-3),
                                      ("ds", sg.grad, ds, 1e-4), ("dt", tg.grad, dbias, 1e-4)):
        err = rel_err(got_g, ref_g)
        print(f"siglip {dtype} b={b} c={c} {name}: err {err:.2e}")
        assert err <= bound


def test_graph_capture_replays_eager():
    b, c = 4096, 512
    q, k = features(b, b, c, seed=5, device="cuda")
    qq = q.to(torch.bfloat16).requires_grad_()
    kk = k.to(torch.bfloat16).requires_grad_()
    s = torch.tensor(10.0, device="cuda", requires_grad=True)
    t = torch.tensor(-10.0, device="cuda", requires_grad=True)
    out = {}

    def step():
        qq.grad = kk.grad = s.grad = t.grad = None
        loss = siglip_loss(qq, kk, s, t, backend="triton", check_finite=False)
        loss.backward()
        out["loss"] = loss

    graph = capture_graph(step)
    q2, k2 = features(b, b, c, seed=6, device="cuda")
    with torch.no_grad():
        qq.copy_(q2.to(torch.bfloat16))
        kk.copy_(k2.to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [out["loss"].clone(), qq.grad.clone(), kk.grad.clone(), s.grad.clone(), t.grad.clone()]
    step()
    eager = [out["loss"], qq.grad, kk.grad, s.grad, t.grad]
    for x, y in zip(replayed, eager):
        assert rel_err(x, y) <= 1e-3
