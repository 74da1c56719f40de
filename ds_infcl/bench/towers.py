"""Time and profile one GradCache chunk of the bench task's CLIP towers, eager against compiled.

    python -m ds_infcl.bench.towers --arch vit-b-16 --chunk 512

Builds the ``bench_clip`` towers (random init, bf16, SDPA attention) on one GPU and times, per
chunk of ``--chunk`` image-text pairs, GradCache's no-gradient pass (pass 1) and the forward +
backward of pass 3, first eager, then with every block compiled as ``model.compile: blocks`` does
(``ds_infcl.train.model.compile_blocks``). The towers alone, no DeepSpeed, no loss, no optimizer:
the ceiling a training step can reach, and the place to look when a step is slower than it.
Prints the device time of the eager chunk by kind of kernel (matrix products, attention, the
rest) and torch.profiler's table of its kernels (``--top`` rows).
"""

import argparse
import functools
import time
from typing import Callable, Dict

import torch


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul")
_ATTENTION = ("flash", "attention", "fmha", "sdpa")


def kernel_kinds(events) -> Dict[str, float]:
    """Device microseconds of profiler ``events`` (``key_averages()``) by kind of kernel."""
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        us = getattr(e, "self_device_time_total", 0.0)
        if us <= 0:
            continue
        name = e.key.lower()
        kind = "matmul" if any(k in name for k in _GEMM) else "attention" if any(k in name for k in _ATTENTION) else "other"
        kinds[kind] += us
    return kinds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="vit-b-16", choices=["vit-b-16", "vit-l-14"])
    p.add_argument("--chunk", type=int, default=512, help="image-text pairs per chunk")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--top", type=int, default=25, help="rows of the kernel table")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    from ds_infcl.tasks.bench import _GeneratedClipTowers
    from ds_infcl.train.model import compile_blocks

    dev = torch.device("cuda")
    index = torch.arange(args.chunk, device=dev)

    def no_grad_pass(m):
        with torch.no_grad():
            return m.encode_query(index), m.encode_key(index)

    def forward_backward(m):
        q, k = m.encode_query(index), m.encode_key(index)
        (q.float().sum() + k.float().sum()).backward()

    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; {args.arch}, chunk {args.chunk}, bf16")
    for compiled in (False,) if args.no_compile else (False, True):
        torch.manual_seed(0)
        m = _GeneratedClipTowers(args.arch, "sdpa").to(dev).bfloat16().train()
        if compiled:
            compile_blocks(m)
        a = _time_ms(functools.partial(no_grad_pass, m), args.reps)
        b = _time_ms(functools.partial(forward_backward, m), args.reps)
        label = "compiled blocks" if compiled else "eager"
        print(f"{label}: pass 1 (no grad) {a:.1f} ms, forward + backward {b:.1f} ms, chunk {a + b:.1f} ms "
              f"-> {args.chunk / ((a + b) / 1e3):,.0f} samples/s (towers only)", flush=True)
        if not compiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                no_grad_pass(m)
                forward_backward(m)
                torch.cuda.synchronize()
            events = prof.key_averages()
            kinds = kernel_kinds(events)
            total = sum(kinds.values()) or 1.0
            print("eager chunk, device time by kind: " + ", ".join(
                f"{k} {v / 1e3:.1f} ms ({v / total:.0%})" for k, v in kinds.items()))
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))
        del m
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
