"""Plots of the loss and ring benchmarks' CSVs: time and share of the matmul peak against the
batch, one PNG per table (matplotlib is optional: without it a line says so and the CSV stays
the record).

    python -m ds_infcl.bench.plots loss docs/bench/loss_h100_2026-11-25.csv
    python -m ds_infcl.bench.plots ring docs/bench/ring_nvidia_h100_w2.csv --peak-tflops 989

``loss``: per feature dim ``c``, the median time of a forward + backward (eager ``total`` and
CUDA-graph ``graph`` modes) and its percentage of the bf16 matmul rate measured in the same run,
per provider. ``ring``: per implementation, the step time per GPU, the TFLOP/s per GPU as a
percentage of ``--peak-tflops`` (the GPU's dense bf16 peak; H100/H200 SXM: 989), and the ring's
weak-scaling efficiency.
"""

from __future__ import annotations

import argparse
import csv
import os
from typing import Dict, List, Optional, Union

__all__ = ["loss_plot", "ring_plot", "main"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _read(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(v) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x == x else None


def _finish(fig, plt, png: str) -> str:
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"plot written: {png}")
    return png


def loss_plot(source: Union[str, List[Dict]], png: Optional[str] = None) -> Optional[str]:
    """Time (log) and % of the matmul rate against ``b`` for ``bench.loss``'s CSV (a path), or its
    rows as the benchmark made them (then ``png`` is required)."""
    plt = _pyplot()
    if png is None:
        if not isinstance(source, str):
            raise ValueError("loss_plot: give png when plotting rows")
        png = os.path.splitext(source)[0] + ".png"
    if plt is None:
        print(f"matplotlib is not installed: no plot written ({png}); the CSV has every number.")
        return None
    rows = _read(source) if isinstance(source, str) else source
    rows = [r for r in rows if r["mode"] in ("total", "graph") and _num(r["median_ms"]) is not None]
    dims = sorted({int(r["c"]) for r in rows})
    fig, axes = plt.subplots(2, max(1, len(dims)), figsize=(4.6 * max(1, len(dims)), 7), squeeze=False)
    for j, c in enumerate(dims):
        keys = sorted({(r["provider"], r["dtype"], r["mode"]) for r in rows if int(r["c"]) == c})
        for key in keys:
            pts = sorted((int(r["b"]), float(r["median_ms"]), float(r["pct_matmul"])) for r in rows
                         if int(r["c"]) == c and (r["provider"], r["dtype"], r["mode"]) == key)
            style = "-" if key[2] == "total" else "--"
            label = f"{key[0]} {key[1]} {'eager' if key[2] == 'total' else 'CUDA graph'}"
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", label=label)
        axes[0][j].set_yscale("log")
        axes[0][j].set_ylabel("ms per forward + backward")
        axes[0][j].set_title(f"symmetric loss, c = {c}")
        axes[1][j].axhline(65, color="grey", ls=":", lw=0.8)
        axes[1][j].set_ylabel("% of the measured bf16 matmul rate")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch b (= m)")
            ax.legend(fontsize=6)
    return _finish(fig, plt, png)


def ring_plot(csv_path: str, png: Optional[str] = None, peak_tflops: float = 989.0) -> Optional[str]:
    """Time per GPU, % of ``peak_tflops`` and weak-scaling efficiency against the per-GPU ``b``
    for ``bench.ring``'s CSV."""
    plt = _pyplot()
    png = png or os.path.splitext(csv_path)[0] + ".png"
    if plt is None:
        print(f"matplotlib is not installed: no plot written ({png})")
        return None
    rows = [r for r in _read(csv_path) if _num(r["ms"]) is not None]
    if not rows:
        print(f"no timed rows in {csv_path}: no plot")
        return None
    world, gpu, c = rows[0]["world"], rows[0]["gpu"], rows[0]["c"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        pts = sorted((int(r["b"]), float(r["ms"]), float(r["tflops"]), _num(r["weak_eff"]))
                     for r in rows if r["impl"] == impl)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1] for p in pts], marker="o", label=impl)
        axes[1].plot(xs, [100 * p[2] / peak_tflops for p in pts], marker="o", label=impl)
        eff = [(p[0], 100 * p[3]) for p in pts if p[3] is not None]
        if eff:
            axes[2].plot([e[0] for e in eff], [e[1] for e in eff], marker="o", label=impl)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per step (slowest rank)")
    axes[1].set_ylabel(f"% of {peak_tflops:g} TFLOP/s (8 b B c per GPU)")
    axes[2].set_ylabel("weak-scaling efficiency %")
    axes[2].axhline(90, color="grey", ls=":", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("per-GPU batch b")
        if ax.get_legend_handles_labels()[0]:  # (no efficiency lines on one GPU: nothing to label)
            ax.legend(fontsize=7)
    fig.suptitle(f"{world} x {gpu}, c = {c}, symmetric, forward + backward")
    return _finish(fig, plt, png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["loss", "ring"])
    ap.add_argument("csv")
    ap.add_argument("--out", help="PNG path (default: the CSV's, with .png)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="ring: the GPU's dense bf16 peak")
    args = ap.parse_args(argv)
    if not os.path.exists(args.csv):
        ap.error(f"{args.csv}: no such file")
    if args.kind == "loss":
        loss_plot(args.csv, args.out)
    else:
        ring_plot(args.csv, args.out, args.peak_tflops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
