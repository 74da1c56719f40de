"""CPU benchmark: the tiled PyTorch path against materialized logits (time and peak memory).

Each (provider, b) point runs in its own subprocess, so that the peak resident set (VmHWM, Linux)
measures that computation alone; memory is reported beyond the inputs and their gradients.
Symmetric loss, float32, forward + backward, c = 256 by default.

    python -m ds_infcl.bench.cpu_tiled --out docs/bench            # b in {1k, 4k, 16k}
    python -m ds_infcl.bench.cpu_tiled --batch 1024 4096 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date

from ds_infcl.bench.results import write_rows_csv

_WORKER = r"""
import json, sys, time, torch
from ds_infcl.loss import contrastive_loss
from ds_infcl.ops import contrastive_loss_reference

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

provider, b, c, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fn = {
    "tiled": lambda q, k, s: contrastive_loss(q, k, s, symmetric=True, backend="torch"),
    "materialized": lambda q, k, s: contrastive_loss_reference(q, k, s, symmetric=True),
}[provider]
torch.manual_seed(0)
fn(torch.randn(8, c, requires_grad=True), torch.randn(8, c), 10.0).backward()  # warm-up, tiny
q = torch.nn.functional.normalize(torch.randn(b, c), dim=-1).requires_grad_()
k = torch.nn.functional.normalize(torch.randn(b, c), dim=-1).requires_grad_()
q.grad, k.grad = torch.zeros_like(q), torch.zeros_like(k)
base = status("VmRSS")
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    loss = fn(q, k, 14.3)
    loss.backward()
    times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps({"median_s": times[len(times) // 2], "min_s": times[0], "extra_peak_bytes": status("VmHWM") - base,
                  "loss": float(loss)}))
"""


def run_point(provider: str, b: int, c: int, reps: int, timeout: float) -> dict:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, provider, str(b), str(c), str(reps)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1024, 4096, 16384], help="b = m values")
    ap.add_argument("--dim", type=int, default=256, help="feature dim c")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median reported)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    ap.add_argument("--out", default=None, help="folder for cpu_tiled.csv and cpu_tiled.md")
    args = ap.parse_args(argv)

    rows = []
    for b in args.batch:
        point = {"b": b, "c": args.dim}
        for provider in ("materialized", "tiled"):
            res = run_point(provider, b, args.dim, args.reps, args.timeout)
            point[provider] = res
            print(f"b={b:>6} {provider:>12}: {res}", file=sys.stderr, flush=True)
        rows.append(point)

    header = "| b = m | c | materialized: time | materialized: extra peak | tiled: time | tiled: extra peak | tiled / materialized time |"
    lines = [header, "|" + "---|" * 7]
    csv_rows = []
    for p in rows:
        mat, til = p["materialized"], p["tiled"]
        def fmt(r):
            if "error" in r:
                return "failed", "-"
            return f"{r['median_s'] * 1e3:.0f} ms", f"{r['extra_peak_bytes'] / 2**20:.0f} MiB"
        ratio = (f"{til['median_s'] / mat['median_s']:.2f}x" if "error" not in mat and "error" not in til else "-")
        lines.append(f"| {p['b']:,} | {p['c']} | {' | '.join(fmt(mat))} | {' | '.join(fmt(til))} | {ratio} |")
        for name, r in (("materialized", mat), ("tiled", til)):
            csv_rows.append({"b": p["b"], "c": p["c"], "provider": name, **{k: r.get(k) for k in ("median_s", "min_s", "extra_peak_bytes", "error")}})
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_rows_csv(os.path.join(args.out, "cpu_tiled.csv"), csv_rows)
        import torch

        meta = (f"Measured {date.today().isoformat()} on {platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores, torch {torch.__version__}, symmetric loss, float32, forward + backward, "
                f"median of {args.reps}; extra peak = peak resident memory beyond the inputs and their gradients.")
        with open(os.path.join(args.out, "cpu_tiled.md"), "w") as f:
            f.write("# Tiled vs materialized loss on CPU\n\n" + meta + "\n\n" + table + "\n\n"
                    "Command: `python -m ds_infcl.bench.cpu_tiled --out docs/bench`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
