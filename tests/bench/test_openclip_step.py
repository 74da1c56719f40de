"""``bench.openclip_step`` and its place in ``bench.engine``, on CPU: argument handling, the clear
exit when ``open_clip`` cannot be imported, and the step itself on a stand-in ``open_clip``
module (tiny linear towers; the real one needs torchvision and a GPU): FLOPs counted as the
trainer counts them, OpenCLIP's ``accum_freq`` path training like the plain step."""

import argparse
import importlib.util
import json
import sys
import types

import pytest
import torch
from torch import nn

from ds_infcl.bench import engine, openclip_step
from ds_infcl.bench.engine_impls import parse_impl


class _StubClip(nn.Module):
    """OpenCLIP's ``CLIP`` interface on two linear towers (image: flattened 3x4x4 pixels)."""

    def __init__(self, init_logit_scale=2.659, init_logit_bias=None):
        super().__init__()
        self.visual = nn.Linear(48, 8)
        self.visual.image_size = (4, 4)
        self.embed = nn.Embedding(10, 8)
        self.text_proj = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(float(init_logit_scale)))
        self.logit_bias = None if init_logit_bias is None else nn.Parameter(torch.tensor(float(init_logit_bias)))
        self.vocab_size, self.context_length = 10, 5
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    def encode_image(self, image):
        return nn.functional.normalize(self.visual(image.flatten(1)), dim=-1)

    def encode_text(self, text):
        return nn.functional.normalize(self.text_proj(self.embed(text).mean(1)), dim=-1)

    def forward(self, image, text):
        out = {"image_features": self.encode_image(image), "text_features": self.encode_text(text),
               "logit_scale": self.logit_scale.exp()}
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out


class _StubClipLoss(nn.Module):
    def __init__(self, local_loss, gather_with_grad, cache_labels, rank, world_size):
        super().__init__()
        assert world_size == 1 and not local_loss and not gather_with_grad

    def forward(self, image_features, text_features, logit_scale):
        logits = logit_scale * image_features @ text_features.T
        labels = torch.arange(len(logits))
        return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2


class _StubSigLipLoss(nn.Module):
    """OpenCLIP's SigLipLoss on one process: -mean over rows of sum_j log sigmoid(z_ij (s x_ij + t))."""

    def __init__(self, rank, world_size):
        super().__init__()
        assert world_size == 1

    def forward(self, image_features, text_features, logit_scale, logit_bias):
        logits = logit_scale * image_features @ text_features.T + logit_bias
        z = 2 * torch.eye(len(logits)) - 1
        return -nn.functional.logsigmoid(z * logits).sum() / len(logits)


@pytest.fixture
def stub_open_clip(monkeypatch):
    mod = types.ModuleType("open_clip")
    mod.__version__ = "stub"
    mod.create_model = lambda name, pretrained, precision, device, output_dict, **kw: _StubClip(**kw).to(device)
    mod.loss = types.SimpleNamespace(ClipLoss=_StubClipLoss, SigLipLoss=_StubSigLipLoss)
    monkeypatch.setitem(sys.modules, "open_clip", mod)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return mod


def test_arguments():
    assert openclip_step.open_clip_model_name("vit-l-14") == "ViT-L-14"
    with pytest.raises(ValueError, match=r"no OpenCLIP model for arch 'tiny'; choose one of \['vit-b-16', 'vit-l-14'\]"):
        openclip_step.open_clip_model_name("tiny")
    args = openclip_step.parse_args(["--batch-per-gpu", "512", "--accum-freq", "4", "--out", "x"])
    assert (args.arch, args.batch_per_gpu, args.accum_freq, args.device) == ("vit-b-16", 512, 4, "cuda")
    for bad in (["--batch-per-gpu", "6", "--accum-freq", "4"], ["--batch-per-gpu", "0"], ["--batch-per-gpu", "8", "--steps", "0"]):
        with pytest.raises(SystemExit):
            openclip_step.parse_args(bad + ["--out", "x"])
    assert parse_impl("infcl+compile+auto") == ("infcl", ["model.compile=blocks", "batch.chunk_size=auto"])
    assert parse_impl("local") == ("local", [])
    assert parse_impl("siglip+towers+gcauto") == ("siglip", ["model.compile=towers", "batch.grad_cache=auto"])
    assert parse_impl("infcl+compile+fp8+fp8row") == (
        "infcl", ["model.compile=blocks", "model.fp8=true", "model.fp8_recipe=rowwise"])
    assert parse_impl("infcl+compile+fp8auto+chunk016")[1] == [
        "model.compile=blocks", "model.fp8=true", "model.fp8_layers=auto", "batch.chunk_size=16"]
    with pytest.raises(ValueError, match=r"--impls 'infcl\+fast': expected LOSS\[\+option ...\] with options "
                                         r"\['auto', 'ckptauto', 'compile', 'fp8', 'fp8auto', 'fp8row', 'gcauto'"):
        parse_impl("infcl+fast")


def test_missing_open_clip_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip raises ImportError
    rc = openclip_step.main(["--batch-per-gpu", "4", "--out", str(tmp_path)])
    assert rc == openclip_step.MISSING_EXIT_CODE
    out = capsys.readouterr().out
    assert "open_clip could not be imported" in out and "pip install open_clip_torch" in out


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="open_clip may import here; the row would run")
def test_engine_row_says_open_clip_is_missing(tmp_path):
    args = argparse.Namespace(arch="vit-b-16", num_gpus=1, openclip_steps=1, warmup=2, openclip_loss="clip", case_timeout=120,
                              out=str(tmp_path))
    row = engine._run_openclip_case(args, 8, 1)
    assert row["status"] == "no open_clip" and row["impl"] == "openclip_step" and row["samples_per_s_per_gpu"] == ""
    assert "pip install open_clip_torch" in (tmp_path / "openclip_step_eager_8" / "log.txt").read_text()
    skipped = engine._openclip_rows(argparse.Namespace(arch="tiny"))
    assert skipped == []


def test_step_on_a_stand_in_open_clip(stub_open_clip, tmp_path):
    summaries = {}
    for accum in (1, 2):
        out = tmp_path / f"accum{accum}"
        assert openclip_step.main(["--device", "cpu", "--batch-per-gpu", "8", "--accum-freq", str(accum),
                                   "--warmup", "0", "--steps", "4", "--lr", "0.01", "--out", str(out)]) == 0
        summaries[accum] = json.loads((out / "summary.json").read_text())
    s = summaries[1]
    # 3 x forward FLOPs of one pair: the image linear (2 x 48 x 8) and the text projection (2 x 8 x 8)
    assert s["model_flops_per_sample"] == 3 * (2 * 48 * 8 + 2 * 8 * 8)
    assert s["samples_per_s_per_gpu"] > 0 and s["mfu"] is None and s["global_batch"] == 8
    # accum_freq 2 computes the same loss and the same summed gradients: the same training
    assert s["losses"][-1] < s["losses"][0] - 0.05  # it trains (lr 0.01)
    assert summaries[2]["losses"] == pytest.approx(s["losses"], rel=1e-2)


def test_siglip_step_on_a_stand_in_open_clip(stub_open_clip, tmp_path):
    """--loss siglip: the model gets open_clip_train's --siglip init (scale log 10, bias -10) and
    SigLipLoss; accum_freq 2 trains the same; the row says siglip."""
    made = []
    create = stub_open_clip.create_model
    stub_open_clip.create_model = lambda *a, **kw: made.append(create(*a, **kw)) or made[-1]
    runs = {}
    for accum in (1, 2):
        out = tmp_path / f"siglip{accum}"
        assert openclip_step.main(["--device", "cpu", "--batch-per-gpu", "8", "--accum-freq", str(accum), "--loss",
                                   "siglip", "--warmup", "0", "--steps", "4", "--lr", "0.01", "--out", str(out)]) == 0
        runs[accum] = json.loads((out / "summary.json").read_text())
    assert float(made[0].logit_bias) != -10.0  # trained from its init
    assert runs[1]["impl"] == "openclip_step siglip" and runs[2]["impl"] == "openclip_step siglip accum_freq 2"
    assert runs[1]["loss"] == "siglip"
    # the first loss at init: every pair's logit is 10 x cos - 10, so about 8 x softplus(-10 ...) + diag terms
    assert 5.0 < runs[1]["losses"][0] < 12.0
    assert runs[1]["losses"][-1] < runs[1]["losses"][0]
    assert runs[2]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-2)


def test_compiled_and_checkpointed_modes_on_a_stand_in_open_clip(stub_open_clip, tmp_path, monkeypatch):
    # --compile wraps the model in torch.compile (as open_clip_train's --torchcompile) and trains the
    # same as eager; --grad-checkpointing turns on the model's checkpointing; the row names both.
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(model) or model)
    made = []
    create = stub_open_clip.create_model
    stub_open_clip.create_model = lambda *a, **kw: made.append(create(*a, **kw)) or made[-1]
    runs = {}
    for flags in ([], ["--compile"], ["--compile", "--grad-checkpointing"]):
        out = tmp_path / ("_".join(flags) or "eager")
        assert openclip_step.main(["--device", "cpu", "--batch-per-gpu", "8", "--accum-freq", "2", "--warmup", "0",
                                   "--steps", "3", "--out", str(out)] + flags) == 0
        runs[tuple(flags)] = json.loads((out / "summary.json").read_text())
    assert [r["impl"] for r in runs.values()] == [
        "openclip_step accum_freq 2", "openclip_step compiled accum_freq 2",
        "openclip_step compiled accum_freq 2 grad checkpointing"]
    assert compiled == made[1:]  # the compiled runs compiled their own model, the eager one did not
    assert [m.grad_checkpointing for m in made] == [False, False, True]
    assert runs[("--compile",)]["losses"] == pytest.approx(runs[()]["losses"], rel=1e-5)


def test_best_openclip_configuration_at_the_same_global_batch():
    def row(phase, impl, batch, sps, status="ok", gpus=1):
        return {"phase": phase, "impl": impl, "global_batch": batch, "samples_per_s_per_gpu": sps, "status": status,
                "gpus": gpus}
    rows = [row("throughput", "infcl+compile", 2048, 1800.0), row("throughput", "infcl+compile", 16384, 1900.0),
            row("throughput", "local", 4096, 900.0),
            row("openclip", "openclip_step accum_freq 4", 2048, 1356.0),
            row("openclip", "openclip_step compiled accum_freq 4", 2048, 2023.0),
            row("openclip", "openclip_step compiled accum_freq 32", 16384, 3000.0, status="oom"),
            row("openclip", "openclip_step compiled accum_freq 32", 16384, 1500.0, gpus=2)]
    lines = engine.best_openclip_lines(rows)
    assert lines[2] == "| infcl+compile | 2048 | 1800.0 | openclip_step compiled accum_freq 4 | 2023.0 | 0.89x |"
    assert lines[3] == "| infcl+compile | 16384 | 1900.0 | none ran | | |"  # the oom row and the 2-GPU row do not count
    assert lines[4] == "| local | 4096 | 900.0 | none ran | | |"
