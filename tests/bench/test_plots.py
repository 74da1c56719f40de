"""bench.plots reads the benchmarks' CSVs (the committed H100 ones) and writes a PNG, or says that
matplotlib is missing and writes nothing."""

import builtins
import importlib.util
import os

import pytest

from ds_infcl.bench import plots

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench")
RING = os.path.join(DOCS, "ring_nvidia_h100_w2.csv")
LOSS = os.path.join(DOCS, "loss_h100_2026-11-25.csv")
# matplotlib is optional (not in requirements-ci.txt); without it the plots say so (tested below).
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (optional, not in requirements-ci.txt)")


@pytest.mark.parametrize("kind,csv_path", [("ring", RING), ("loss", LOSS)])
def test_a_clear_line_without_matplotlib(kind, csv_path, tmp_path, capsys, monkeypatch):
    png = tmp_path / f"{kind}.png"
    fn = plots.ring_plot if kind == "ring" else plots.loss_plot
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "__import__", no_matplotlib)
        assert fn(csv_path, str(png)) is None
    assert "matplotlib is not installed" in capsys.readouterr().out and not png.exists()


@needs_matplotlib
@pytest.mark.parametrize("kind,csv_path", [("ring", RING), ("loss", LOSS)])
def test_plot_writes_a_png(kind, csv_path, tmp_path):
    png = tmp_path / f"{kind}.png"
    fn = plots.ring_plot if kind == "ring" else plots.loss_plot
    assert fn(csv_path, str(png)) == str(png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _loss_rows():
    import csv

    with open(LOSS, newline="") as f:
        return list(csv.DictReader(f))


def test_loss_plot_of_rows_needs_a_png_path():
    with pytest.raises(ValueError, match="give png"):
        plots.loss_plot(_loss_rows())


@needs_matplotlib
def test_loss_plot_takes_the_benchmarks_rows(tmp_path):
    # bench.loss plots the rows of its own run (its CSV may hold earlier runs' rows too)
    rows = _loss_rows()
    png = tmp_path / "rows.png"
    assert plots.loss_plot(rows, str(png)) == str(png) and png.stat().st_size > 0


def test_missing_csv_is_an_argument_error(tmp_path):
    with pytest.raises(SystemExit):
        plots.main(["ring", str(tmp_path / "none.csv")])
