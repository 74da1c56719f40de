"""bench.plots reads the benchmarks' CSVs (the committed H100 ones) and writes a PNG, or says that
matplotlib is missing and writes nothing."""

import builtins
import os

import pytest

from ds_infcl.bench import plots

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench")
RING = os.path.join(DOCS, "ring_nvidia_h100_w2.csv")
LOSS = os.path.join(DOCS, "loss_h100_2026-11-25.csv")


@pytest.mark.parametrize("kind,csv_path", [("ring", RING), ("loss", LOSS)])
def test_plot_or_a_clear_line_without_matplotlib(kind, csv_path, tmp_path, capsys, monkeypatch):
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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert fn(csv_path, str(png)) == str(png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_loss_plot_takes_the_benchmarks_rows(tmp_path):
    # bench.loss plots the rows of its own run (its CSV may hold earlier runs' rows too)
    import csv

    with open(LOSS, newline="") as f:
        rows = list(csv.DictReader(f))
    with pytest.raises(ValueError, match="give png"):
        plots.loss_plot(rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = tmp_path / "rows.png"
    assert plots.loss_plot(rows, str(png)) == str(png) and png.stat().st_size > 0


def test_missing_csv_is_an_argument_error(tmp_path):
    with pytest.raises(SystemExit):
        plots.main(["ring", str(tmp_path / "none.csv")])
