"""``python -m ds_infcl.bench.ring --cpu-smoke`` on 2 gloo ranks, as the GPU runs use it: the table
and the CSV, point by point and ``--paired`` (every impl and the single-GPU reference in the same
rounds), and ``--paired --base`` (another version of the package in the same rounds). Checks the
script, not the numbers; among that, that the ranks run the same number of steps of a point (a rank with more would post collectives nobody answers: a hang, which the
point-by-point mode could hit when the ranks' first steps straddled ``--seconds-per-point / --reps``;
timing-dependent, it hung this test once before the fix)."""

import csv
import os
import re
import shutil
import subprocess
import sys

import pytest

from ds_infcl.train.dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, *extra, impls=("infcl", "infcl_ring", "local"), env=None):
    env = dict(env or os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "ds_infcl.bench.ring", "--cpu-smoke", "--impls", *impls,
           "--batch", "12", "--dim", "8", "--warmup-seconds", "0", "--seconds-per-point", "0.05",
           "--out", str(tmp_path), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r[0]: r for r in re.findall(r"^\| ([\w@.~-]+) \| 12 \| 24 \| ([0-9.]+) \| (\S+) \| [0-9.]+ \| (\S+) \| "
                                         r"(\S+) \| (.+?) \|$", out.stdout, re.M)}
    with open(os.path.join(tmp_path, "ring_cpu-smoke_w2.csv")) as f:
        saved = list(csv.DictReader(f))
    return rows, saved


@pytest.mark.parametrize("paired", [False, True])
def test_ring_bench_table_and_csv(tmp_path, paired):
    extra = ("--paired", "1", "--paired-calls", "2") if paired else ()
    rows, saved = _run(tmp_path, *extra)
    assert set(rows) == {"infcl", "infcl_ring", "local"}, rows
    assert [r["impl"] for r in saved] == ["infcl", "infcl_ring", "local"]
    suffix = " (paired, 1 x 2 calls)" if paired else ""
    # infcl names the algorithm it chose, even when the pinned ring ran after it (paired: the
    # rounds end with infcl_ring and the single-GPU reference)
    assert rows["infcl"][5] == "ok (gather)" + suffix, rows["infcl"]
    assert rows["infcl_ring"][5] == "ok" + suffix and rows["local"][5] == "ok" + suffix
    for impl in ("infcl", "infcl_ring"):  # the single-GPU reference and the weak-scaling figure
        assert float(rows[impl][3]) > 0 and rows[impl][4].endswith("%"), rows[impl]
    assert rows["local"][3] == "-" and rows["local"][4] == "-"


def test_ring_bench_pins_the_own_block_backward(tmp_path):
    """``infcl_own_early`` / ``infcl_own_late`` (not run by default): infcl with the gather path's
    own block backward pinned in the forward or in the backward, side by side in paired rounds."""
    rows, saved = _run(tmp_path, "--paired", "1", "--paired-calls", "2", impls=("infcl_own_early", "infcl_own_late"))
    assert set(rows) == {"infcl_own_early", "infcl_own_late"}, rows
    for impl in rows:
        assert rows[impl][5] == "ok (paired, 1 x 2 calls)" and float(rows[impl][3]) > 0, rows[impl]


def _pin_worker(rank, world, _):
    import types

    import torch

    import ds_infcl.bench.ring as bench_ring
    import ds_infcl.loss.ring_fused as fused

    from tests.ring.ring_harness import record_calls

    bench_ring._DEVICE = "cpu"
    calls = record_calls(fused, "_backward_rest")
    out = {}
    for impl in ("infcl_own_early", "infcl_own_late", "infcl"):
        calls.clear()
        step, status = bench_ring._make_step(impl, 12, 8, torch.float32, None, types.SimpleNamespace(backend="torch"))
        step()
        out[impl] = (status, len(calls))
    return out


def test_the_own_block_pins_take_effect():
    """The pinned variants run the backward they name: the own block's in the forward (the
    backward then covers the other keys: ``_backward_rest``) or not; plain infcl at 12 rows is
    below the default threshold."""
    from tests.ring.ring_harness import spawn

    for out in spawn(_pin_worker, 2, None, timeout=120):
        assert out == {"infcl_own_early": ("ok", 1), "infcl_own_late": ("ok", 0), "infcl": ("ok", 0)}, out


def test_ring_bench_times_another_version_in_the_same_rounds(tmp_path):
    """``--base FOLDER`` (a copy of this package's tree here) and ``--base REV`` (a revision of the
    git checkout): that version's infcl runs as ``infcl@NAME`` in the same rounds, imported beside
    the current one, with its own single-GPU reference for its weak scaling."""
    base = tmp_path / "before"
    shutil.copytree(os.path.join(REPO, "ds_infcl"), base / "ds_infcl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    scratch = tmp_path / "tmp"  # the processes' TMPDIR: where each extracts the base version
    scratch.mkdir()
    rows, saved = _run(tmp_path, "--paired", "1", "--paired-calls", "2", "--base", str(base), impls=("infcl",),
                       env=dict(os.environ, TMPDIR=str(scratch)))
    assert set(rows) == {"infcl", "infcl@before"}, rows
    assert not list(scratch.glob("ds_infcl_base_*")), "the extracted base trees outlived their processes"
    assert [r["impl"] for r in saved] == ["infcl", "infcl@before"]
    for impl in rows:
        assert rows[impl][5].endswith("(paired, 1 x 2 calls)") and float(rows[impl][3]) > 0, rows[impl]
        assert rows[impl][4].endswith("%"), rows[impl]
    if not os.path.exists(os.path.join(REPO, ".git")):  # (a directory, or a file in a git worktree)
        pytest.skip("not a git checkout: --base REV needs one")
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows, _ = _run(tmp_path, "--paired", "1", "--paired-calls", "2", "--base", "HEAD", impls=("infcl",))
    assert set(rows) == {"infcl", f"infcl@{head}"}, rows


def test_ring_bench_base_errors_name_the_fix(tmp_path):
    from ds_infcl.bench.base_tree import load_base, rename_imports

    assert rename_imports("from ds_infcl.loss import x\nimport ds_infcl\nDS_INFCL_X = 'ds_infcl_base'") == (
        "from ds_infcl_base.loss import x\nimport ds_infcl_base\nDS_INFCL_X = 'ds_infcl_base'")
    with pytest.raises(ValueError, match="holds no ds_infcl/ package"):
        load_base(str(tmp_path))
    if os.path.isdir(os.path.join(REPO, ".git")):
        with pytest.raises(ValueError, match="neither a folder nor a revision"):
            load_base("no-such-revision-anywhere")
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "ds_infcl.bench.ring", "--cpu-smoke", "--base", "HEAD"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "add --paired ROUNDS" in out.stderr, out.stderr[-2000:]


def test_warm_up_captures_the_graphs_before_the_memory_and_timed_steps(monkeypatch):
    """A first step slower than ``--warmup-seconds`` (it compiles) must not end the warm-up: the
    second step captures the gather path's CUDA graphs, so the warm-up runs at least three steps,
    ``--warmup-seconds`` counted after the first. (It ended after one: the graphs were captured in
    the timed rounds and the extra-memory column read 0.00 GiB at 4k and 8k rows per GPU.)"""
    import time
    import types

    import torch.distributed as dist

    from ds_infcl.bench import ring as bench_ring

    monkeypatch.setattr(bench_ring, "_DEVICE", "cpu")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        calls, marks = [], []

        def step():
            time.sleep(0.2 if not calls else 0.001)  # the first step "compiles"
            calls.append(time.perf_counter())

        args = types.SimpleNamespace(warmup=1, warmup_seconds=0.05)
        bench_ring._warm_up(step, None, args, after_first=lambda: marks.append(len(calls)))
        assert marks == [1]  # once, right after the first step
        assert len(calls) >= bench_ring.MIN_WARMUP_STEPS
        assert calls[-1] - calls[0] >= 0.05  # the seconds run from the end of the first step
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["quick", "paired"])
def test_ring_bench_siglip_default_call(tmp_path, mode):
    """The SigLIP rows (``siglip`` names the algorithm it chose; the pinned ones run theirs;
    OpenCLIP's ``SigLipLoss`` is skipped where open_clip cannot be imported, as on this CPU CI),
    with the default call (``--check-finite``), timed as issue 37 did (``--quick``: one warm-up,
    the median of three) or paired."""
    extra = ("--quick",) if mode == "quick" else ("--paired", "1", "--paired-calls", "2")
    rows, saved = _run(tmp_path, "--check-finite", *extra,
                       impls=("siglip", "siglip_ring", "siglip_gather", "siglip_openclip", "infcl"))
    suffix = "" if mode == "quick" else " (paired, 1 x 2 calls)"
    assert [r["impl"] for r in saved] == ["siglip", "siglip_ring", "siglip_gather", "siglip_openclip", "infcl"]
    assert rows["siglip"][5] == "ok (gather)" + suffix, rows["siglip"]
    assert rows["siglip_ring"][5] == "ok" + suffix and rows["siglip_gather"][5] == "ok" + suffix
    status = {r["impl"]: r["status"] for r in saved}["siglip_openclip"]
    assert status.startswith(("ok", "skipped (open_clip unavailable")), status
    assert rows["infcl"][5] == "ok (gather)" + suffix
    assert rows["siglip"][3] == "-"  # no weak-scaling reference for SigLIP


def test_quick_and_paired_exclude_each_other(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "ds_infcl.bench.ring", "--cpu-smoke", "--quick", "--paired", "2"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode != 0 and "--quick times each point alone" in out.stderr


def test_checked_rows_time_the_default_call_beside_the_unchecked_one(tmp_path):
    """``infcl_checked`` / ``siglip_checked``: the default call (its input check on) in the same
    paired rounds as the rows without the check, so the check's cost is one subtraction."""
    rows, saved = _run(tmp_path, "--paired", "1", "--paired-calls", "2",
                       impls=("infcl", "infcl_checked", "siglip", "siglip_checked"))
    assert [r["impl"] for r in saved] == ["infcl", "infcl_checked", "siglip", "siglip_checked"]
    for impl in ("infcl_checked", "siglip_checked"):
        assert rows[impl][5] == "ok (paired, 1 x 2 calls)", rows[impl]
        assert {r["impl"]: r["backend"] for r in saved}[impl] == "torch"
