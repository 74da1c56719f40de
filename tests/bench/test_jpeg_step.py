"""``python -m ds_infcl.bench.jpeg_step`` on CPU: the real trainer (one CPU rank under the deepspeed
launcher, and one plain process) on a few tiny JPEG shards it writes, its table against the
trainer's own summary.json and log; the cycle parsing on a synthetic log; the data counts of
damaged shards reaching the table; and the errors (a folder that is not shards, ``--decode gpu``
without CUDA)."""

import csv
import io
import json
import os
import re
import statistics
import tarfile

import pytest
import torch

from ds_infcl.bench import jpeg_step

TINY = ["--arch", "tiny", "--decode", "cpu", "--global-batch", "32", "--chunk-size", "16", "--steps", "4",
        "--num-workers", "2", "--worker-batch-size", "8", "--no-compile"]


def _rows(out):
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


def _cycles_and_waits(log_text):
    """Independent reading of the ``[clip data]`` lines: ``{k: (wait, cycle)}`` by splitting."""
    out = {}
    for line in log_text.splitlines():
        if line.startswith("[clip data] batch "):
            words = line.replace(",", "").split()
            k, wait = int(words[3]), float(words[5])
            out[k] = (wait, float(words[8]) if "cycle" in words else None)
    return out


def test_cycle_parsing_on_a_synthetic_log():
    text = "\n".join([
        "[ds_infcl] world 2 (cuda), global batch 1200 ...",
        "[clip data] batch 1 waited 4.5000 s",
        "[clip data] batch 2 waited 0.2000 s, cycle 9.0000 s",  # the first step (compile): excluded
        "noise [clip data] batch 3 waited 0.0100 s, cycle 0.5000 s",
        "[clip data] batch 4 waited 0.0300 s, cycle 0.7000 s",
        "[ds_infcl] step 4 loss 3.2",
        "[clip data] batch 5 waited 0.0200 s, cycle 0.6000 s",
    ])
    assert jpeg_step.parse_data_lines(text) == {1: (4.5, None), 2: (0.2, 9.0), 3: (0.01, 0.5), 4: (0.03, 0.7),
                                                5: (0.02, 0.6)}
    rates = jpeg_step.data_rates(text, global_batch=1200, ranks=2)
    assert rates["median_cycle_s"] == 0.6 and rates["num_cycles"] == 3
    assert rates["e2e_samples_per_s_per_gpu"] == 1000.0  # 1200 / 0.6 / 2
    assert rates["median_wait_s"] == 0.025  # batches 2..5: 0.2, 0.01, 0.03, 0.02
    empty = jpeg_step.data_rates("[clip data] batch 1 waited 1.0 s\n", 32, 1)
    assert empty["e2e_samples_per_s_per_gpu"] == "" and empty["median_cycle_s"] == "" and empty["num_cycles"] == 0
    assert jpeg_step.format_data_counts({}) == "0 skipped"
    assert jpeg_step.format_data_counts({"bad_image": 3, "bad_caption": 1}) == "bad_caption=1, bad_image=3"


def test_one_command_writes_shards_trains_and_reports(tmp_path, capsys):
    shards, out = tmp_path / "shards", tmp_path / "out"
    rc = jpeg_step.main(TINY + ["--num-gpus", "1", "--image-size", "40", "--num-samples", "96",
                                "--samples-per-shard", "32", "--processes", "1", "--shards", str(shards),
                                "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert json.loads((shards / "sizes.json").read_text()) == {"00000.tar": 32, "00001.tar": 32, "00002.tar": 32}
    run = json.loads((out / "cpu" / "run.json").read_text())
    args = run["task"]["args"]
    assert run["task"]["name"] == "clip" and run["loss"]["impl"] == "infcl" and "model" not in run  # --no-compile
    assert (args["decode"], args["report_data_time"], args["resampled"], args["arch"]) == ("cpu", True, True, "tiny")
    assert (args["num_workers"], args["worker_batch_size"], args["data_dir"]) == (2, 8, str(shards))
    assert run["batch"] == {"global_batch_size": 32, "grad_cache": True, "chunk_size": 16}

    summary = json.loads((out / "cpu" / "summary.json").read_text())
    lines = _cycles_and_waits((out / "cpu" / "log.txt").read_text())
    assert sorted(lines) == [1, 2, 3, 4]  # one line per step; no cycle for batch 1
    cycle = statistics.median(lines[k][1] for k in (3, 4))
    [row] = _rows(out)
    assert row["status"] == "ok" and row["decode"] == "cpu" and row["gpus"] == "1"
    assert float(row["step_samples_per_s_per_gpu"]) == round(summary["samples_per_s"], 1)
    assert float(row["median_cycle_s"]) == round(cycle, 4)
    assert float(row["e2e_samples_per_s_per_gpu"]) == round(32 / cycle, 1)
    assert float(row["median_wait_s"]) == round(statistics.median(lines[k][0] for k in (2, 3, 4)), 4)
    assert float(row["peak_mem_gib"]) == round(summary["peak_mem_mib"] / 1024, 2)
    assert summary["data"] == {} and row["data"] == "0 skipped"
    table = (out / "results.md").read_text()
    assert re.search(r"^\| cpu \| 1 \| 32 \| 16 \| off \| ok \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|  \| "
                     r"[0-9.]+ \| 0 skipped \| [0-9.]+ \|$", table, re.M), table
    assert table.splitlines()[-1] in printed  # the table is printed too


def _damage_first_image_of_each_shard(src, dst):
    """Copy the shards with the first sample's JPEG of every shard replaced by bytes no decoder
    reads (the sample counts, and so sizes.json, stay the same)."""
    dst.mkdir()
    for name in sorted(os.listdir(src)):
        if not name.endswith(".tar"):
            (dst / name).write_bytes((src / name).read_bytes())
            continue
        with tarfile.open(src / name) as tin, tarfile.open(dst / name, "w") as tout:
            members = tin.getmembers()
            first_jpg = next(m.name for m in members if m.name.endswith(".jpg"))
            for m in members:
                data = b"not a jpeg at all" if m.name == first_jpg else tin.extractfile(m).read()
                info = tarfile.TarInfo(m.name)
                info.size = len(data)
                tout.addfile(info, io.BytesIO(data))


def test_reused_damaged_shards_show_their_skipped_samples(tmp_path, capsys):
    from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards

    write_synth_jpeg_shards(str(tmp_path / "clean"), num_samples=64, samples_per_shard=16, image_size=40)
    shards, out = tmp_path / "damaged", tmp_path / "out"
    _damage_first_image_of_each_shard(tmp_path / "clean", shards)
    before = sorted(os.listdir(shards))
    rc = jpeg_step.main(TINY + ["--num-gpus", "0", "--shards", str(shards), "--num-samples", "999", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "reusing 64 samples in 4 shards" in printed and sorted(os.listdir(shards)) == before
    summary = json.loads((out / "cpu" / "summary.json").read_text())
    # 4 steps of 32 from 4 shards of 16 drawn with replacement: every shard read starts with a bad image
    assert summary["data"].get("bad_image", 0) >= 1, summary["data"]
    [row] = _rows(out)
    assert row["status"] == "ok" and row["gpus"] == "0"
    assert row["data"] == jpeg_step.format_data_counts(summary["data"]) and "bad_image=" in row["data"]
    assert f"| {row['data']} |" in (out / "results.md").read_text()
    assert "data: " in (out / "cpu" / "log.txt").read_text()  # the trainer's own line


def test_a_folder_that_is_not_shards_is_an_error_and_untouched(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=f"--shards {re.escape(str(folder))} exists and holds no sizes.json"):
        jpeg_step.main(TINY + ["--shards", str(folder), "--out", str(tmp_path / "out")])
    assert os.listdir(folder) == ["notes.txt"] and not (tmp_path / "out").exists()
    (folder / "sizes.json").write_text(json.dumps({"00000.tar": 5}))
    with pytest.raises(SystemExit, match="missing: 00000.tar"):
        jpeg_step.main(TINY + ["--shards", str(folder), "--out", str(tmp_path / "out")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_gpu_decode_without_cuda_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        jpeg_step.main(TINY[:2] + ["--decode", "cpu", "gpu", "--shards", str(tmp_path / "s"), "--out",
                                   str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--decode gpu needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "s").exists() and not (tmp_path / "out").exists()  # nothing written, nothing run


def test_too_few_steps_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        jpeg_step.main(TINY + ["--steps", "2", "--shards", str(tmp_path / "s"), "--out", str(tmp_path / "out")])
    assert "--steps must be >= 3" in capsys.readouterr().err
