"""``ds_infcl.bench.vs_openclip`` without GPUs: the engine commands it builds (flags the engine
has, OpenCLIP's plain and accum_freq batches by the GPU's memory, side by side only where twice
the GPUs are visible), the best OpenCLIP row picked at each per-GPU batch, and a whole run over
stand-in engine results."""

import csv
import os
import re
import subprocess
import sys

import pytest

from ds_infcl.bench import vs_openclip
from ds_infcl.bench.vs_openclip import TABLES, best_rows, engine_command, openclip_micro


def _flags(cmd):
    return [a for a in cmd if a.startswith("--")]


def _values(cmd, flag):
    i = cmd.index(flag) + 1
    out = []
    while i < len(cmd) and not cmd[i].startswith("--"):
        out.append(cmd[i])
        i += 1
    return out


def test_every_flag_is_one_the_engine_takes():
    help_text = subprocess.run([sys.executable, "-m", "ds_infcl.bench.engine", "--help"], capture_output=True,
                               text=True, check=True).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
    for name, table in TABLES.items():
        cmd = engine_command(table, table.batches, openclip_micro(table, 141.0), True, "out")
        assert set(_flags(cmd)) <= known, (name, set(_flags(cmd)) - known)


@pytest.mark.parametrize("mem, micro_b16, micro_l14", [(141.0, 1024, 512), (79.6, 512, 256), (None, 512, 256)])
def test_openclip_micro_batch_follows_the_gpu_memory(mem, micro_b16, micro_l14):
    assert openclip_micro(TABLES["clip-1"], mem) == micro_b16
    assert openclip_micro(TABLES["vitl-1"], mem) == micro_l14


def test_the_clip_2_command_global_batches_and_openclip_configurations():
    cmd = engine_command(TABLES["clip-2"], (512, 2048, 16384), 1024, False, "o")
    assert _values(cmd, "--num-gpus") == ["2"]
    assert _values(cmd, "--throughput-batch") == ["1024", "4096", "32768"]  # global batches
    assert _values(cmd, "--openclip-batches") == ["512"]  # per GPU, where the plain step fits
    assert _values(cmd, "--openclip-accum-batches") == ["2048", "16384"]
    assert _values(cmd, "--openclip-accum-micro") == ["1024"]
    assert _values(cmd, "--impls") == ["infcl+compile+gcauto", "openclip_step"]
    assert "--side-by-side" not in cmd and "--openclip-loss" not in cmd
    assert _values(cmd, "--deepspeed-config") == ["ds_configs/zero1.json"]
    assert _values(cmd, "--steps") == ["8"] and _values(cmd, "--warmup") == ["3"]
    assert _values(cmd, "--openclip-steps") == ["5"]  # both sides time the 5 steps after 3 warm-up steps
    longer = engine_command(TABLES["clip-2"], (512,), 1024, False, "o", steps=10, warmup=2)
    assert _values(longer, "--steps") == ["10"] and _values(longer, "--openclip-steps") == ["8"]
    siglip = engine_command(TABLES["siglip-1"], (2048,), 512, True, "o")
    assert _values(siglip, "--impls")[0] == "siglip+compile+gcauto" and _values(siglip, "--openclip-loss") == ["siglip"]
    assert _values(siglip, "--openclip-batches") == ["512"] and "--side-by-side" in siglip


def test_no_timed_step_is_refused(capsys):
    with pytest.raises(SystemExit):
        vs_openclip.main(["--steps", "3", "--tables", "clip-1"])
    assert "--steps 3 --warmup 3: give 0 <= --warmup < --steps" in capsys.readouterr().err


def _row(impl, gb, sps, status="ok", gpus=2):
    phase = "openclip" if impl.startswith("openclip_step") else "throughput"
    return {"phase": phase, "impl": impl, "gpus": str(gpus), "global_batch": str(gb), "samples_per_s_per_gpu": str(sps),
            "status": status}


def test_best_rows_pick_the_fastest_openclip_at_the_same_global_batch():
    rows = [_row("infcl+compile+gcauto", 1024, 4000.0), _row("openclip_step compiled", 1024, 2700.0),
            _row("openclip_step compiled", 2048, 2800.0),  # 1,024 per GPU: another batch
            _row("infcl+compile+gcauto", 4096, 3300.0), _row("openclip_step compiled accum_freq 2", 4096, 2100.0),
            _row("openclip_step compiled accum_freq 4", 4096, 2500.0, status="oom"),
            _row("infcl+compile+gcauto", 32768, 0, status="failed")]
    got = best_rows("clip-2", TABLES["clip-2"], rows, (512, 2048, 16384))
    assert [(r["per_gpu_batch"], r["ours"], r["openclip_best"], r["openclip"], r["ratio"]) for r in got] == [
        (512, 4000.0, "compiled", 2700.0, "1.48x"),
        (2048, 3300.0, "compiled accum_freq 2", 2100.0, "1.57x"),
        (16384, "", "none ran", "", ""),
    ]


class _StandInEngine:
    """Stands in for ``subprocess.Popen`` of an engine command: writes the engine's results.csv
    (ours 3,000, OpenCLIP 2,500 samples/s per GPU at every batch) and finishes after ``seconds``,
    recording which GPUs it was given and when it ran."""

    def __init__(self, seconds=0.0):
        self.seconds, self.runs = seconds, []

    def __call__(self, cmd, stdout=None, stderr=None, env=None):
        import time

        engine, start = self, time.time()
        out = _values(cmd, "--out")[0]
        ours = _values(cmd, "--impls")[0]
        with open(os.path.join(out, "results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["phase", "impl", "gpus", "global_batch", "samples_per_s_per_gpu", "status"])
            w.writeheader()
            gpus = int(_values(cmd, "--num-gpus")[0])
            for gb in map(int, _values(cmd, "--throughput-batch")):
                w.writerow(_row(ours, gb, 3000.0, gpus=gpus))
                w.writerow(_row("openclip_step compiled", gb, 2500.0, gpus=gpus))

        class Proc:
            returncode = None

            def poll(self):
                if self.returncode is None and time.time() - start >= engine.seconds:
                    self.returncode = 0
                    engine.runs.append((os.path.basename(out), (env or {}).get("CUDA_VISIBLE_DEVICES"), start,
                                        time.time(), cmd))
                return self.returncode

            def wait(self):
                return 0

            def terminate(self):
                pass

        return Proc()


def test_a_run_over_stand_in_engine_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vs_openclip, "_visible_gpu_ids", lambda: ["0", "1"])
    monkeypatch.setattr(vs_openclip, "_gpu_info", lambda: {"name": "2 x FAKE GPU", "mem_gib": 141.0})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = _StandInEngine()
    monkeypatch.setattr(vs_openclip.subprocess, "Popen", engine)
    code = vs_openclip.main(["--out", str(tmp_path), "--batches", "512"])
    assert code == 0
    names = [name for name, *_ in engine.runs]
    assert names == list(TABLES)  # 2 GPUs: every table, one after the other, on both GPUs
    assert all(gpus is None for _, gpus, *_ in engine.runs)
    side = {name: "--side-by-side" in cmd for name, _, _, _, cmd in engine.runs}
    assert side == {"clip-1": True, "clip-2": False, "siglip-1": True, "siglip-2": False, "vitl-1": True}
    text = (tmp_path / "results.md").read_text()
    assert text.count("| 1.20x |") == 5 and "2 x FAKE GPU" in text
    assert "| ViT-L/14, CLIP | 1 | 512 | 3000.0 | compiled | 2500.0 | 1.20x |" in capsys.readouterr().out


def test_parallel_tables_run_at_once_on_disjoint_gpus(tmp_path, monkeypatch):
    # --parallel: each table on its own GPUs (ours then OpenCLIP's, no side by side), started in
    # order as soon as enough GPUs are free; the combined table keeps the tables' order.
    monkeypatch.setattr(vs_openclip, "_visible_gpu_ids", lambda: ["4", "5", "6", "7"])
    monkeypatch.setattr(vs_openclip, "_gpu_info", lambda: {"name": "8 x FAKE GPU", "mem_gib": 141.0})
    engine = _StandInEngine(seconds=0.3)
    monkeypatch.setattr(vs_openclip.subprocess, "Popen", engine)
    monkeypatch.setattr(vs_openclip, "_POLL_S", 0.02)
    assert vs_openclip.main(["--parallel", "--out", str(tmp_path), "--batches", "512"]) == 0
    runs = {name: (gpus, start, end, cmd) for name, gpus, start, end, cmd in engine.runs}
    assert {name: gpus for name, (gpus, *_) in runs.items()} == {
        "clip-1": "4", "clip-2": "5,6", "siglip-1": "7", "siglip-2": "4,5", "vitl-1": "6"}
    assert not any("--side-by-side" in cmd for *_, cmd in runs.values())
    first = [runs[n] for n in ("clip-1", "clip-2", "siglip-1")]
    assert max(start for _, start, _, _ in first) < min(end for _, _, end, _ in first)  # at once
    assert runs["siglip-2"][1] >= min(end for _, _, end, _ in first)  # waited for two GPUs
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["table"] for r in rows] == list(TABLES) and all(r["ratio"] == "1.20x" for r in rows)


def test_a_table_needing_more_gpus_than_visible_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(vs_openclip, "_visible_gpu_ids", lambda: ["0"])
    monkeypatch.setattr(vs_openclip, "_gpu_info", lambda: {"name": "1 x FAKE", "mem_gib": 80.0})
    with pytest.raises(SystemExit, match="clip-2 need"):
        vs_openclip.main(["--tables", "clip-2", "--out", str(tmp_path)])
