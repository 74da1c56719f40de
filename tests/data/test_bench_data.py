"""The data-path benchmark (``python -m ds_infcl.bench.data``) on a few shards written here: the
CPU rows measure through the real loader, the GPU rows are skipped with the reason on this
machine, and run on the CPU with PIL standing in for ``decode_jpeg`` (the same code path)."""

import csv
import json

from ds_infcl.bench.data import main
from ds_infcl.data.device_decode import gpu_decode_problem
from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards
from tests.data.test_device_decode import pil_decode

ARGS = ["--image-size", "32", "--batch-size", "8", "--num-images", "16", "--batches-per-worker", "2"]


def test_bench_data_on_cpu(tmp_path, capsys):
    shards = str(tmp_path / "shards")
    write_synth_jpeg_shards(shards, num_samples=24, samples_per_shard=8, image_size=48)
    out = tmp_path / "out"
    assert main(["--shards", shards, "--workers", "0", "2", "--out", str(out)] + ARGS) == 0
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["path"] for r in rows] == ["cpu in-process (1 core)", "cpu loader", "gpu decode (main process)",
                                         "gpu loader"]
    cpu, loader = rows[0], rows[1]
    assert cpu["status"] == loader["status"] == "ok" and int(cpu["images"]) == 16 and loader["workers"] == "2"
    assert int(loader["images"]) == 2 * 2 * 8 and float(loader["images_per_s"]) > 0
    assert abs(float(cpu["images_per_s"]) - 16 / float(cpu["seconds"])) < 0.2 * float(cpu["images_per_s"])
    problem = gpu_decode_problem()
    if problem is not None:
        assert rows[2]["status"] == f"skipped: {problem}" and rows[3]["status"].startswith("skipped")
    assert json.loads((out / "results.json").read_text())["rows"][0]["images"] == 16
    assert printed.strip().splitlines()[-1].startswith("| gpu loader")  # the table is printed last

    # the GPU rows' code on the CPU: PIL behind decode_jpeg's interface
    capsys.readouterr()
    assert main(["--shards", shards, "--workers", "2", "--no-cpu", "--device", "cpu", "--gpu-workers", "0", "2",
                 "--out", str(out)] + ARGS, decode=pil_decode) == 0
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(r["path"], r["workers"], r["status"]) for r in rows] == [
        ("gpu decode (main process)", "0", "ok"), ("gpu loader", "0", "ok"), ("gpu loader", "2", "ok")]
    assert int(rows[0]["images"]) == 16 and int(rows[2]["images"]) == 2 * 2 * 8
    assert all(r["bad_images"] == "0" and r["device"] == "cpu" for r in rows)
