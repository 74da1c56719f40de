"""The ``open_clip`` task on a GPU (skipped without CUDA or a working ``import open_clip``): an
OpenCLIP architecture (tiny, given inline) trains on the digits shards through the trainer with
GradCache, for the InfoNCE and the SigLIP loss; its export loads back with
``open_clip.create_model(name, pretrained=<file>)`` with the trained logit scale (and bias).

    TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_open_clip_task.py

On CPU-only machines ``import open_clip`` needs a CPU torchvision (see docs/siglip.md); the CPU
suite checks the task's error for that case (tests/tasks/test_clip.py).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
    pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0", allow_module_level=True)
open_clip = pytest.importorskip("open_clip")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("impl", ["infcl", "siglip"])
def test_open_clip_model_trains_and_exports(tmp_path, impl):
    from ds_infcl.tasks.clip import ensure_digits_shards

    data = os.environ.get("DS_INFCL_DIGITS", str(tmp_path / "digits"))
    ensure_digits_shards(data)
    with open(os.path.join(ROOT, "launch", "open_clip_digits.json")) as f:
        cfg = json.load(f)
    cfg["task"]["args"]["data_dir"] = data
    cfg["loss"] = {"impl": impl}
    if impl == "siglip":  # an OpenCLIP model with a bias (as its SigLIP configs have)
        cfg["task"]["args"]["model_kwargs"] = {"init_logit_bias": -10.0}
    cfg["train"]["num_steps"] = 100
    cfg["eval"] = {"every_steps": 0, "at_end": True}
    cfg["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"),
         "--config", str(path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"open_clip task, {impl}: loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f}, "
          f"held-out zero-shot top-1 {summary['eval']['zero_shot_top1']:.3f}")
    assert summary["eval"]["zero_shot_top1"] > 0.3  # chance is 0.1
    export = tmp_path / "run" / "final_model"
    meta = json.loads((export / "open_clip_config.json").read_text())
    open_clip.add_model_config(_config_dir(tmp_path, meta["model_name"], cfg["task"]["args"]["model_config"]))
    model = open_clip.create_model(meta["model_name"], pretrained=str(export / meta["weights"]),
                                   **cfg["task"]["args"].get("model_kwargs", {}))
    # The export holds the float32 master; the summary reads the bf16 module copy (one bf16
    # rounding apart).
    assert model.logit_scale.item() == pytest.approx(summary["final_logit_scale"], rel=2**-8)
    if impl == "siglip":
        # The trained bias, from the float32 master: 100 steps move it less than one bf16 ulp at
        # -10 (0.0625), so a bf16 export would still read -10.0 exactly.
        assert model.logit_bias is not None and model.logit_bias.item() != -10.0
        assert abs(model.logit_bias.item() + 10.0) < 1.0


def _config_dir(tmp_path, name, config):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(config))
    return str(folder)
