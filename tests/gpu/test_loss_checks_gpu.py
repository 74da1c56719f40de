"""A loss called outside a trainer step on a CUDA GPU reads its value checks (NaN/Inf features, a
finite scale and bias) after its forward is queued (``ds_infcl.ops.validation.checks_read_after_launch``):
the check's counts go to pinned host memory by a queued copy, and the host waits for that copy only,
so it never drains the GPU before launching the loss (docs/bench/loss_small_batch_h100_w1_2026-12-07_twentieth.md
has what the check costs at small batches).

    python -m pytest -q -s tests/gpu/test_loss_checks_gpu.py
"""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ds_infcl.loss import contrastive_loss, lse, siglip_loss  # noqa: E402

CALLS = {
    "contrastive_loss": lambda q, k: contrastive_loss(q, k, 10.0),
    "siglip_loss": lambda q, k: siglip_loss(q, k, 10.0, bias=-10.0),
    "lse": lambda q, k: lse(q, k, 10.0)[0],
}


def _features(b, c=512, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=1)
    return q.bfloat16(), k.bfloat16()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_standalone_call_does_not_synchronize_and_still_raises(name):
    call = CALLS[name]
    q, k = _features(4096)
    for _ in range(3):  # compile, capture the CUDA graphs
        call(q, k)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = call(q, k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    print(f"{name}: {len(syncs)} synchronizing operations in one call")
    assert not syncs, syncs
    cpu = CALLS[name](q.float().cpu(), k.float().cpu())
    torch.testing.assert_close(loss.float().cpu(), cpu, rtol=2e-2, atol=2e-2)  # bf16 features
    bad = q.clone()
    bad[[3, 4000]] = float("nan")
    with pytest.raises(ValueError, match=r"^query has 2 of 4096 rows with NaN or Inf values"):
        call(bad, k)
    bad_key = k.clone()
    bad_key[7, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^key has 1 of 4096 rows with NaN or Inf values"):
        call(q, bad_key)
    torch.cuda.synchronize()
    call(q, k)  # a good call after the errors: nothing left queued from them
