"""``model.fp8`` on a GPU with float8 tensor cores (compute capability 8.9+: H100, H200) and torchao
(the ``gpu`` extra; for torch 2.11, torchao 0.17.0):

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_fp8_gpu.py

1. The ViT-B/16 towers of the CLIP benchmark, compiled blocks, bf16: the float8 towers' features
   and gradients against the same towers in bf16 (close, not equal: float8 rounds each matmul's
   inputs to 3 mantissa bits), and the forward + backward time of both (printed, not asserted).
2. The trainer on one GPU (DeepSpeed ZeRO-2, bf16, AdamW, the tiny towers of the CLIP benchmark,
   compiled blocks, 20 steps): float8 tensorwise and rowwise follow the bf16 run's losses within
   5%; GradCache "auto" and a chunk of 24 rows (padded matmuls) too.
"""

import copy
import importlib.util
import json
import os
import time
import types

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip(f"needs float8 tensor cores (compute capability 8.9+), {torch.cuda.get_device_name()} has none",
                allow_module_level=True)
if importlib.util.find_spec("torchao") is None:
    pytest.skip("torchao not installed: pip install 'ds_infcl[gpu]' (torchao 0.17.0 for torch 2.11)",
                allow_module_level=True)

from ds_infcl.tasks.bench import BenchClipTask  # noqa: E402
from ds_infcl.train.fp8 import convert_to_fp8  # noqa: E402
from ds_infcl.train.model import compile_blocks, find_blocks  # noqa: E402
from tests.train import harness as h  # noqa: E402

DEVICE = torch.device("cuda")


def _fwd_bwd(towers, idx):
    q, k = towers.encode_query(idx), towers.encode_key(idx)
    loss = (20.0 * q.float() @ k.float().T).logsumexp(1).mean()
    loss.backward()
    return q.detach().float(), k.detach().float()


def _time(towers, idx, iters=10):
    for _ in range(2):  # compilation, then warm
        _fwd_bwd(towers, idx)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        towers.zero_grad(set_to_none=True)
        _fwd_bwd(towers, idx)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_vit_b16_towers_close_to_bf16(recipe):
    torch.manual_seed(0)
    ref = BenchClipTask(arch="vit-b-16").build_towers().to(DEVICE, torch.bfloat16)
    towers = copy.deepcopy(ref)
    cfg = types.SimpleNamespace(fp8=True, compile="blocks", fp8_recipe=recipe, fp8_layers="blocks")
    names = convert_to_fp8(towers, find_blocks(towers), cfg, 256)
    assert len(names) == 144
    for model in (ref, towers):
        compile_blocks(model)
    idx = torch.arange(256, device=DEVICE)
    (q0, k0), (q1, k1) = _fwd_bwd(ref, idx), _fwd_bwd(towers, idx)
    # float8 rounds every matmul input of 12 layers (e4m3 forward, e5m2 gradients), so compare
    # directions: garbage (a wrong scale, a transposed operand) gives cosines near 0
    feature_cos = [torch.nn.functional.cosine_similarity(a, b, dim=1).min().item() for a, b in ((q0, q1), (k0, k1))]
    grad_cos = []
    for name in ("vision.vision_model.encoder.layers.0.mlp.fc1.weight", "text.text_model.encoder.layers.11.self_attn.q_proj.weight"):
        g0, g1 = ref.get_parameter(name).grad.float(), towers.get_parameter(name).grad.float()
        grad_cos.append(torch.nn.functional.cosine_similarity(g0.flatten(), g1.flatten(), dim=0).item())
    t_bf16, t_fp8 = _time(ref, idx), _time(towers, idx)
    print(f"\nViT-B/16 towers, batch 256, forward + backward: bf16 {t_bf16 * 1e3:.1f} ms, float8 {recipe} "
          f"{t_fp8 * 1e3:.1f} ms ({t_bf16 / t_fp8:.2f}x); feature cosine min (image, text) {feature_cos}, "
          f"gradient cosine (vision layer 0 fc1, text layer 11 q_proj) {grad_cos}")
    assert min(feature_cos) > 0.95 and min(grad_cos) > 0.8


def test_trainer_fp8_trains_like_bf16(tmp_path):
    common = ["batch.global_batch_size=96", "train.num_steps=20", "logging.progress_bar=false",
              "logging.tensorboard=false", "checkpoint.at_end=false", "eval.at_end=false", "task.name=bench_clip",
              'task.args={"arch": "tiny"}', "model.compile=blocks"]
    ds_set = ['optimizer={"type": "AdamW", "params": {"lr": 0.001, "torch_adam": true}}', "scheduler=null",
              "bf16.enabled=true"]
    cases = {
        "bf16": [],
        "fp8": ["model.fp8=true"],
        "fp8_rowwise": ["model.fp8=true", "model.fp8_recipe=rowwise"],
        "fp8_gcauto": ["model.fp8=true", "batch.grad_cache=auto", "batch.chunk_size=32"],
        "fp8_chunk24": ["model.fp8=true", "batch.grad_cache=true", "batch.chunk_size=24"],
    }
    jobs = [h.job(name, "zero2.json", ds_set, common + extra) for name, extra in cases.items()]
    path = h.write_jobs(tmp_path, jobs)
    log = h.run_jobs_on_gpu(path, timeout=1200)
    print("\n".join(line for line in log.splitlines() if "model.fp8" in line))
    assert "model.fp8: 24 of 26 linear layers in float8 (tensorwise scaling" in log
    assert "model.fp8: 24 of 26 linear layers in float8 (rowwise scaling" in log
    assert "the micro-batch's 24 rows are not a multiple of 16" in log
    ref = h.summary(tmp_path / "bf16")["losses"]
    for name in cases:
        losses = h.summary(tmp_path / name)["losses"]
        print(f"{name}: first {losses[0]:.4f} last {losses[-1]:.4f} (bf16 {ref[0]:.4f} -> {ref[-1]:.4f})")
        # float8 moves the tiny towers' first loss by about 0.4% (CPU emulation); 5% over 20
        # steps leaves room for the trajectories to part, not for a broken step (NaN, no update)
        assert losses == pytest.approx(ref, rel=0.05), name


def _digits_config(task, tmp_path):
    """The demo's digits CLIP run (``make demo``'s config, 150 steps, global batch 256) or the
    ``open_clip`` task's digits run (``launch/open_clip_digits.json``), on this GPU."""
    if task == "clip":
        from ds_infcl.demos.trainer import demo_run_config

        return demo_run_config(str(tmp_path / "unused"), 150, 256, None, "infcl", task="digits", data_dir="builtin:digits")
    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch not installed (not pinned for CI; pip install 'ds_infcl[open_clip]')")
    return json.loads((h.REPO / "launch" / "open_clip_digits.json").read_text())


@pytest.mark.parametrize("task", ["clip", "open_clip"])
def test_digits_accuracy_within_one_point(tmp_path, task):
    """The issue's bar: float8 (tensorwise) trains the digits to the bf16 run's held-out zero-shot
    top-1 within 1 point (359 digits: 1 point is 3.6 of them), both runs with compiled blocks."""
    cfg = _digits_config(task, tmp_path)
    cfg.update(checkpoint={"every_steps": 0, "at_end": False, "export_final": False},
               eval={"every_steps": 0, "at_end": True}, logging={"every_steps": 10, "progress_bar": False})
    cfg.pop("output_dir", None)
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    ds_set = ["optimizer.params.lr=0.002"] if task == "clip" else []  # the demo's lr
    jobs = [dict(h.job(name, "zero2.json", ds_set, ["model.compile=blocks"] + extra), config=str(tmp_path / "run.json"))
            for name, extra in (("bf16", []), ("fp8", ["model.fp8=true"]))]
    path = h.write_jobs(tmp_path, jobs)
    log = h.run_jobs_on_gpu(path, timeout=1200)
    top1 = {name: h.summary(tmp_path / name)["eval"]["zero_shot_top1"] for name in ("bf16", "fp8")}
    print(f"\n{task} digits, held-out zero-shot top-1: bf16 {100 * top1['bf16']:.1f}%, float8 {100 * top1['fp8']:.1f}%; "
          + next((line for line in log.splitlines() if "model.fp8:" in line), "no model.fp8 line"))
    assert top1["bf16"] > 0.8
    assert abs(top1["fp8"] - top1["bf16"]) <= 0.01
