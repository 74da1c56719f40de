"""``model.fp8`` on CPU: the config and preflight errors, and which layers the filter chooses on the
CLIP benchmark's towers (built on the meta device: no memory, no init time).

torchao is not pinned for CPU CI (it is the ``gpu`` extra): the conversion itself runs in
tests/gpu/test_fp8_gpu.py. Where torchao is installed, ``test_emulated_conversion`` also converts
the tiny towers here with torchao's float32 emulation of float8.
"""

import importlib.util
import json
import sys
import types

import pytest
import torch
from torch import nn

from ds_infcl.errors import ConfigError
from ds_infcl.tasks.bench import BenchClipTask
from ds_infcl.train import fp8 as fp8_mod
from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.model import find_blocks
from tests.train import harness
from tests.train.blocks_task import BlockTowers

BASE = {"batch": {"global_batch_size": 64}, "train": {"num_steps": 1}, "logging": {"tensorboard": False}}
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def _cfg(**model):
    return run_config_from_dict({**BASE, "model": model, "output_dir": "unused"})


def _model_config(**kw):
    return types.SimpleNamespace(**{"fp8": True, "compile": "blocks", "fp8_recipe": "tensorwise", "fp8_layers": "blocks",
                                    **kw})


def _meta_towers(arch):
    with torch.device("meta"):
        return BenchClipTask(arch=arch).build_towers()


def _expected(num_layers, linears=LAYER_LINEARS):
    """The names an independent reading of the HF CLIP layout gives: every linear of every encoder
    layer of both towers, and nothing else (not the patch embedding, not the projections); sorted."""
    return sorted(f"{tower}.{tower}_model.encoder.layers.{i}.{lin}" for tower in ("vision", "text")
                  for i in range(num_layers) for lin in linears)


def _names(blocks, *args):
    return sorted(fp8_mod.fp8_layer_names(blocks, *args))


# -- config ---------------------------------------------------------------------------------------

def test_config_keys():
    cfg = _cfg(compile="blocks", fp8=True, fp8_recipe="rowwise", fp8_layers="auto")
    assert (cfg.model.fp8, cfg.model.fp8_recipe, cfg.model.fp8_layers) == (True, "rowwise", "auto")
    assert _cfg().model.fp8 is False
    with pytest.raises(ConfigError, match=r'model.fp8: needs model.compile "blocks": without it .* slower than bf16; '
                                          r'set model.compile "blocks" or model.fp8 false'):
        _cfg(fp8=True)
    with pytest.raises(ConfigError, match=r"model.fp8_recipe: 'delayed' is not allowed; choose one of \['tensorwise', 'rowwise'\]"):
        _cfg(compile="blocks", fp8=True, fp8_recipe="delayed")
    with pytest.raises(ConfigError, match=r"model.fp8_layers: 'all' is not allowed; choose one of \['blocks', 'auto'\]"):
        _cfg(compile="blocks", fp8=True, fp8_layers="all")
    with pytest.raises(ConfigError, match=r"model.fp8_recipe: only used with model.fp8 true"):
        _cfg(compile="blocks", fp8_recipe="rowwise")
    with pytest.raises(ConfigError, match=r"model.fp8: expected true/false, got 'yes'"):
        _cfg(compile="blocks", fp8="yes")


def test_check_fp8_names_what_is_missing(monkeypatch):
    """Each requirement, in the order a user meets them, with how to go on."""
    on, off = _model_config(), _model_config(fp8=False)
    fp8_mod.check_fp8(off, 3, "cpu")  # off: nothing to check
    with pytest.raises(ConfigError, match=r"model.fp8: not supported with ZeRO stage 3 .* use ZeRO stage 0-2"):
        fp8_mod.check_fp8(on, 3, "cuda")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r'model.fp8: needs torchao, which is not installed: pip install "ds_infcl\[gpu\]"'):
        fp8_mod.check_fp8(on, 2, "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"need a CUDA GPU of compute capability 8.9 or newer .* this run is on cpu"):
        fp8_mod.check_fp8(on, 2, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no float8 tensor cores"):
        fp8_mod.check_fp8(on, 2, "cuda")
    monkeypatch.setitem(sys.modules, "torchao", None)  # installed but broken: the import error is named
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ConfigError, match=r"model.fp8: needs torchao .* import failed"):
        fp8_mod.check_fp8(on, 2, "cuda")


def test_check_refuses_fp8_on_this_cpu_before_anything_is_built(tmp_path, capsys, monkeypatch):
    """``--check`` (and a run's first checks) say what is missing: torchao in CI, the GPU where
    torchao is installed (the compile toolchain taken as present: a machine without g++ is named
    by ``model.compile``'s check first)."""
    from ds_infcl.train import preflight
    from ds_infcl.train.cli import main

    monkeypatch.setattr(preflight, "compile_toolchain_problem", lambda device_type: None)

    raw = {**BASE, "model": {"compile": "blocks", "fp8": True}, "output_dir": str(tmp_path / "out")}
    (tmp_path / "run.json").write_text(json.dumps(raw))
    rc = main(["--deepspeed_config", str(harness.REPO / "ds_configs" / "zero2.json"), "--config",
               str(tmp_path / "run.json"), "--check"])
    err = capsys.readouterr().err
    assert rc == 2
    assert ("model.fp8: needs torchao, which is not installed" in err
            or "model.fp8: float8 matmuls need a CUDA GPU" in err), err


# -- which layers -----------------------------------------------------------------------------------

def test_filter_on_tiny_and_vit_b16_towers():
    tiny = _meta_towers("tiny")
    assert _names(find_blocks(tiny)) == _expected(2)  # 32/64 wide: all multiples of 16
    vit_b = _meta_towers("vit-b-16")
    names = _names(find_blocks(vit_b))
    assert names == _expected(12)
    assert not any("projection" in n or "embeddings" in n for n in names)
    # torchao's tensorwise thresholds (not both in <= 4096 and out <= 1024): only the MLPs' fc1
    # (vision 768 -> 3072, text 512 -> 2048); rowwise's keep nothing at these widths
    assert _names(find_blocks(vit_b), "auto", "tensorwise") == _expected(12, ("mlp.fc1",))
    assert fp8_mod.fp8_layer_names(find_blocks(vit_b), "auto", "rowwise") == []


def test_filter_on_vit_l14_towers():
    vit_l = _meta_towers("vit-l-14")
    blocks = find_blocks(vit_l)
    names = _names(blocks)
    assert len(names) == (24 + 12) * 6 and "vision.vision_model.encoder.layers.23.self_attn.q_proj" in names
    auto = _names(blocks, "auto")
    assert auto == [n for n in names if n.endswith("mlp.fc1")]  # vision 1024 -> 4096, text 768 -> 3072
    assert fp8_mod.fp8_layer_names(blocks, "auto", "rowwise") == []


def test_filter_skips_frozen_odd_and_multihead_attention_layers():
    towers = _meta_towers("tiny")
    for p in towers.vision.parameters():  # a locked image tower keeps its precision
        p.requires_grad_(False)
    assert _names(find_blocks(towers)) == [n for n in _expected(2) if n.startswith("text.")]
    assert fp8_mod.fp8_layer_names(find_blocks(BlockTowers(width=24))) == []  # 24 is not a multiple of 16

    class MhaBlock(nn.Module):  # OpenCLIP's ResidualAttentionBlock: MHA reads out_proj.weight itself
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 2)
            self.c_fc = nn.Linear(32, 64)

    blocks = [("resblocks.0", MhaBlock()), ("resblocks.1", nn.Linear(32, 16))]
    assert fp8_mod.fp8_layer_names(blocks) == ["resblocks.0.c_fc", "resblocks.1"]


def test_no_layer_to_convert_is_a_config_error():
    towers = BlockTowers(width=24)
    with pytest.raises(ConfigError, match=r"model.fp8: no linear layer of the towers \(BlockTowers\) qualifies .* set model.fp8 false"):
        fp8_mod.convert_to_fp8(towers, find_blocks(towers), _model_config())
    towers = BlockTowers(width=32)  # 32 -> 32: below torchao's thresholds
    with pytest.raises(ConfigError, match=r'of a shape torchao gains at\); try model.fp8_layers "blocks"'):
        fp8_mod.convert_to_fp8(towers, find_blocks(towers), _model_config(fp8_layers="auto"))


def test_compile_towers_refuses_fp8_with_zero3_and_without_torchao(monkeypatch):
    from ds_infcl.train.model import compile_towers

    with pytest.raises(ConfigError, match=r"model.fp8: not supported with ZeRO stage 3"):
        compile_towers(BlockTowers(), _model_config(), 3)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r'model.fp8: needs torchao \(pip install "ds_infcl\[gpu\]"'):
        compile_towers(BlockTowers(), _model_config(), 2)


# -- the conversion, where torchao is installed -------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="torchao not installed (the gpu extra; not pinned for CPU CI); tests/gpu/test_fp8_gpu.py converts on a GPU")
def test_emulated_conversion():
    """torchao's float8 emulation (float32 maths with float8 rounding) on the tiny towers: exactly
    the chosen layers become ``Float8Linear``, parameter names are unchanged, features and
    gradients stay close to the unconverted towers', and rows not a multiple of 16 pad."""
    torch.manual_seed(0)
    ref = BenchClipTask(arch="tiny").build_towers()
    towers = BenchClipTask(arch="tiny").build_towers()
    towers.load_state_dict(ref.state_dict())
    lines = []
    names = fp8_mod.convert_to_fp8(towers, find_blocks(towers), _model_config(), 24, lines.append, emulate=True)
    assert sorted(names) == _expected(2)
    assert [n for n, m in towers.named_modules() if type(m).__name__ == "Float8Linear"] == names
    assert list(towers.state_dict()) == list(ref.state_dict())
    assert lines[0].startswith("model.fp8: 24 of 26 linear layers in float8 (tensorwise scaling")
    assert "rows are not a multiple of 16" in lines[1]
    idx = torch.arange(24)
    outs = []
    for model in (ref, towers):
        q, k = model.encode_query(idx), model.encode_key(idx)
        (q @ k.T).logsumexp(1).mean().backward()
        outs.append((q.detach(), model.vision.vision_model.encoder.layers[0].mlp.fc1.weight.grad))
    (q0, g0), (q1, g1) = outs
    assert 0 < (q1 - q0).abs().max() < 0.05  # float8's rounding (e4m3: 3 mantissa bits), not garbage
    assert torch.nn.functional.cosine_similarity(g1.flatten(), g0.flatten(), dim=0) > 0.98
