"""The decoder step on a GPU in bf16 (``ds_infcl.adapters.decoder_step``): packing, Liger-Kernel's
fused ops and compiled blocks each against the plain padded step, and the activation estimate that
``gradient_checkpointing: "auto"`` decides with against measured memory (skipped without CUDA).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_decoder_step_gpu.py

Tolerance without hand tuning (flash-attention's rule): each bf16 variant's error against a float32
run of the same weights is at most twice the plain bf16 step's error, plus a small floor. The liger
tests need ``pip install liger-kernel`` (the ``gpu`` extra); without it they skip, saying so
(liger-kernel is not pinned for CPU CI).
"""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)

from ds_infcl.adapters.decoder_step import (  # noqa: E402
    LayerCheckpointing,
    activation_bytes,
    apply_liger,
    liger_available,
    pack_texts,
    pool_packed,
    pool_padded,
)

needs_liger = pytest.mark.skipif(not liger_available(), reason="liger-kernel not installed (pip install 'ds_infcl[gpu]')")


def _model(dtype, liger=False, seed=0):
    from transformers import AutoModel, Qwen2Config

    config = Qwen2Config(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModel.from_config(config).to("cuda", dtype)
    if liger:
        apply_liger(model)
    return model


def _inputs(n=24, width=200, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, width + 1, (n,), generator=g)
    ids = torch.randint(1, 999, (n, width), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return (ids * mask).cuda(), mask.cuda()


def _step(model, ids, mask, packing):
    """Last-token embeddings and a loss of them; returns (embeddings, parameter gradients)."""
    model.zero_grad(set_to_none=True)
    if packing:
        packed = pack_texts(ids, mask, rows_multiple=8)
        hidden = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).last_hidden_state
        emb = pool_packed(hidden, packed, "lasttoken")
    else:
        hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        emb = pool_padded(hidden, mask, "lasttoken")
    emb = torch.nn.functional.normalize(emb.float(), dim=-1)
    (20 * emb @ emb.T).logsumexp(1).mean().backward()
    return emb.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _err(a, ref):
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _check(variant, plain, ref, floor=2e-3):
    assert _err(variant[0], ref[0]) <= 2 * _err(plain[0], ref[0]) + floor
    worst = max(_err(variant[1][n], g) - 2 * _err(plain[1][n], g) for n, g in ref[1].items())
    assert worst <= floor, worst


def test_packing_bf16():
    ids, mask = _inputs()
    ref = _step(_model(torch.float32), ids, mask, packing=False)
    plain = _step(_model(torch.bfloat16), ids, mask, packing=False)
    packed = _step(_model(torch.bfloat16), ids, mask, packing=True)
    print(f"\npacking bf16: embedding error {_err(packed[0], ref[0]):.2e} (padded {_err(plain[0], ref[0]):.2e})")
    _check(packed, plain, ref)


@needs_liger
@pytest.mark.parametrize("packing", [False, True])
def test_liger_matches_plain(packing):
    ids, mask = _inputs()
    ref = _step(_model(torch.float32), ids, mask, packing=packing)
    plain = _step(_model(torch.bfloat16), ids, mask, packing=packing)
    liger = _step(_model(torch.bfloat16, liger=True), ids, mask, packing=packing)
    print(f"\nliger bf16 (packing {packing}): embedding error {_err(liger[0], ref[0]):.2e} "
          f"(plain {_err(plain[0], ref[0]):.2e})")
    _check(liger, plain, ref)


def test_compiled_blocks_with_packing():
    # Not with Liger: its kernels crashed inside compiled blocks on an H200 (liger-kernel 0.8.5,
    # triton 3.6), and the trainer refuses the two together (adapters/decoder_step.LIGER_WITH_COMPILE).
    from ds_infcl.train.model import compile_blocks

    ids, mask = _inputs()
    ref = _step(_model(torch.float32), ids, mask, packing=True)
    plain = _step(_model(torch.bfloat16), ids, mask, packing=True)
    model = _model(torch.bfloat16)
    assert len(compile_blocks(model)) == 4
    compiled = _step(model, ids, mask, packing=True)
    _check(compiled, plain, ref)


def test_activation_estimate_and_auto_checkpointing():
    model = _model(torch.bfloat16)
    ids = torch.randint(1, 999, (16, 256), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    hidden = model(input_ids=ids, use_cache=False).last_hidden_state
    kept = torch.cuda.memory_allocated() - before - hidden.numel() * hidden.element_size()
    estimate = activation_bytes(model.config, ids.numel(), torch.bfloat16)
    print(f"\nactivations kept for the backward: measured {kept / 2**20:.1f} MiB, estimated {estimate / 2**20:.1f} MiB")
    del hidden
    assert kept <= LayerCheckpointing.SAFETY * estimate  # the decision never under-budgets
    assert estimate <= 2.5 * kept  # nor checkpoints for nothing
    auto = LayerCheckpointing(model, "auto", log=print)
    free = torch.cuda.mem_get_info()[0]
    per_token = activation_bytes(model.config, 1, torch.bfloat16)
    assert auto.decide(1024, torch.device("cuda"), torch.bfloat16) is False
    assert auto.decide(int(2 * free / per_token), torch.device("cuda"), torch.bfloat16) is True
    with torch.no_grad():  # nothing to keep without gradients
        assert auto.decide(int(2 * free / per_token), torch.device("cuda"), torch.bfloat16) is False
