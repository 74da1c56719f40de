"""The output of ``ds_infcl.bench.ring``: the CSV's columns, the markdown table it prints last, the
CSV and its PNG."""

from __future__ import annotations

import csv
import os

__all__ = ["FIELDS", "format_table", "write_outputs"]

FIELDS = ["gpu", "date", "world", "impl", "b", "global_batch", "c", "dtype", "backend", "ms",
          "extra_gib", "tflops", "single_gpu_ms", "weak_eff", "status"]


def _backend_label(impl: str, backend: str) -> str:
    """The CSV's ``backend`` column: ours, OpenCLIP's loss, or the torch baselines."""
    if impl.startswith("infcl") or impl.removesuffix("_checked") in ("siglip", "siglip_ring", "siglip_gather"):
        return backend
    if impl == "openclip":
        return "open_clip ClipLoss (local, gather_with_grad)"
    if impl == "siglip_openclip":
        return "open_clip SigLipLoss (default arguments)"
    return "torch (fp32 logits)"


def _fmt(x, spec):
    return "-" if x != x else format(x, spec)


def format_table(rows) -> str:
    lines = ["| impl | b per GPU | global B | ms/step | extra GiB/GPU | TFLOP/s/GPU | 1-GPU ms (B) | "
             "weak-scaling eff | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['b']:,} | {r['global_batch']:,} | {_fmt(r['ms'], '.1f')} | "
            f"{_fmt(r['extra_gib'], '.2f')} | {_fmt(r['tflops'], '.1f')} | "
            f"{_fmt(r['single_gpu_ms'], '.1f')} | {_fmt(r['weak_eff'] * 100, '.0f')}"
            f"{'%' if r['weak_eff'] == r['weak_eff'] else ''} | {r['status']} |"
        )
    largest = {}
    for r in rows:
        largest.setdefault(r["impl"], 0)
        if r["status"] == "ok" or r["status"].startswith("ok ("):  # "ok (ring)": the algorithm infcl chose
            largest[r["impl"]] = max(largest[r["impl"]], r["global_batch"])
    lines.append("")
    lines.append("largest global batch that ran: " + ", ".join(
        f"{impl} {largest.get(impl, 0):,}" for impl in dict.fromkeys(r["impl"] for r in rows)))
    return "\n".join(lines)


def write_outputs(rows, out: str, stem: str) -> None:
    """``<out>/<stem>.csv`` (``FIELDS``) and its PNG (``ds_infcl.bench.plots.ring_plot``)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"csv written: {path}")
    from ds_infcl.bench.plots import ring_plot

    ring_plot(path, os.path.join(out, f"{stem}.png"))
