"""Built-in example of the loss: ``python -m ds_infcl.demos.loss``.

Computes the symmetric contrastive loss and its gradients for b = m = 8,192 random unit features
(c = 256) with the tiled path and with materialized logits, each in its own process, and prints
the loss values, the time and the peak memory beyond the inputs.
"""

from __future__ import annotations

import argparse

from ds_infcl.bench.cpu_tiled import run_point


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args(argv)
    print(f"symmetric InfoNCE, b = m = {args.batch:,}, c = {args.dim}, float32, forward + backward")
    results = {}
    for provider in ("tiled", "materialized"):
        r = run_point(provider, args.batch, args.dim, reps=1, timeout=1800)
        results[provider] = r
        if "error" in r:
            print(f"  {provider:>12}: failed: {r['error']}")
        else:
            print(f"  {provider:>12}: loss {r['loss']:.6f}  time {r['median_s'] * 1e3:8.0f} ms  "
                  f"extra peak memory {r['extra_peak_bytes'] / 2**20:7.0f} MiB")
    if all("error" not in r for r in results.values()):
        diff = abs(results["tiled"]["loss"] - results["materialized"]["loss"])
        print(f"  |tiled - materialized| = {diff:.2e}; materialized logits alone take "
              f"{args.batch * args.batch * 4 / 2**20:.0f} MiB")
        return 0 if diff <= 1e-4 * abs(results["materialized"]["loss"]) else 1
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
