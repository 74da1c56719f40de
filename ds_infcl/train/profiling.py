"""Profile one training step: where its device time goes and how long the device sits idle.

``logging.profile_step: N`` in the run config profiles step ``N`` (1-based) with ``torch.profiler``
on every rank; rank 0 writes to ``<output_dir>/profile/``:

- ``trace.json``: the Chrome/Perfetto trace (open it at https://ui.perfetto.dev);
- ``ops.txt``: the operators sorted by their own device time;
- ``idle.txt``: where the device waited on the host: each idle stretch of the device timeline is
  charged to the innermost Python frame running on the host at that time (the profile records
  Python stacks), summed by frame and by the innermost frame of ``ds_infcl``/``deepspeed`` code;
- ``summary.json`` and one log line: the step's wall time, the time its device kernels ran, the
  idle share, and the kernel time split into categories (matrix multiplies, attention, the loss's
  Triton kernels and the compiler's fused kernels, collectives, the optimizer, copies, the rest).

The same ``profiled`` context serves the benchmarks that time a peer's step
(``ds_infcl.bench.openclip_step --profile``), so both sides are split by one rule.

Kernel time is summed per kernel; kernels on a side stream (the chunk feed's copies, NCCL) can
overlap the main stream, so "busy" can exceed what one stream would show; "idle" is
``1 - busy / wall`` clipped at 0 and means "the device waited on the host" only when nothing overlaps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["profiled", "kernel_category", "KERNEL_CATEGORIES", "summarize_kernels", "format_summary", "idle_report",
           "profiled_call"]

# First match wins: the pattern is searched in the lowercased kernel name.
KERNEL_CATEGORIES: List[Tuple[str, str]] = [
    ("collective", r"nccl|allreduce|all_gather|reduce_scatter|gloo"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention|cudnn_attn"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|wgmma|matmul|\bmm\b|addmm|bmm"),
    ("optimizer", r"multi_tensor|adam|lamb|lion|fused_optim|_foreach"),
    ("copy", r"memcpy|memset|copy_|cat_|catarraybatched"),
    ("loss kernels", r"_lse_|lse_|siglip|infonce|_tile_|gluon"),
    ("compiled (inductor)", r"^triton_|triton_poi|triton_per|triton_red"),
    ("norm", r"layer_norm|layernorm|rms_?norm|batch_norm"),
]


def kernel_category(name: str) -> str:
    """The category of a device kernel by its name (``KERNEL_CATEGORIES``; else ``other``)."""
    low = name.lower()
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, low):
            return category
    return "other"


def summarize_kernels(kernels: Dict[str, float], wall_s: float) -> Dict[str, object]:
    """``kernels``: kernel name -> total device microseconds. The step's split by category."""
    by_cat: Dict[str, float] = {}
    for name, us in kernels.items():
        cat = kernel_category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    busy_s = sum(kernels.values()) / 1e6
    return {
        "wall_ms": wall_s * 1e3,
        "kernel_ms": busy_s * 1e3,
        "idle_fraction": max(0.0, 1.0 - busy_s / wall_s) if wall_s > 0 else None,
        "kernel_ms_by_category": {k: v / 1e3 for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": {k: v / 1e3 for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]},
    }


def _device_kernels(prof) -> Dict[str, float]:
    """Kernel name -> total device microseconds, from the profiler's device-side events."""
    out: Dict[str, float] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            out[evt.name] = out.get(evt.name, 0.0) + float(evt.device_time_total if hasattr(evt, "device_time_total")
                                                         else evt.cuda_time_total)
    return out


def format_summary(label: str, summary: Dict[str, object]) -> str:
    """One line: wall, kernel time, idle share and the three largest categories."""
    cats = summary["kernel_ms_by_category"]
    top = ", ".join(f"{k} {v:.1f}" for k, v in list(cats.items())[:6])  # type: ignore[union-attr]
    idle = summary["idle_fraction"]
    idle_s = "n/a" if idle is None else f"{100 * idle:.1f}%"
    return (f"profile {label}: wall {summary['wall_ms']:.1f} ms, kernels {summary['kernel_ms']:.1f} ms, "
            f"idle {idle_s}; by category (ms): {top}")


@contextlib.contextmanager
def profiled(out_dir: Optional[str], label: str, device: torch.device, write: bool = True) -> Iterator[dict]:
    """Profile the body with ``torch.profiler`` (CPU and, on CUDA, device activity); on exit write
    the trace, the operator table and the summary under ``out_dir`` (when ``write``) and fill the
    yielded dict with the summary. The body is synchronized on both ends, so the wall time is the
    body's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result: dict = {}
    # Python stacks (for idle.txt, written only where ``write``) slow every host call: only there.
    with profile(activities=activities, record_shapes=False, with_stack=bool(write and out_dir) and device.type == "cuda") as prof:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        yield result
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    result.update(summarize_kernels(_device_kernels(prof), wall))
    result["label"] = label
    if write and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        trace = os.path.join(out_dir, "trace.json")
        prof.export_chrome_trace(trace)
        if device.type == "cuda":
            with open(os.path.join(out_dir, "idle.txt"), "w") as f:
                f.write(idle_report(trace))
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(os.path.join(out_dir, "ops.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(result, f, indent=2)


def profiled_call(fn, *args, out_dir: str, label: str, device: torch.device, rank: int, log) -> object:
    """``fn(*args)`` under ``profiled``: rank 0 writes ``out_dir``; ``log`` gets the summary line."""
    with profiled(out_dir, label, device, write=rank == 0) as summary:
        result = fn(*args)
    log(format_summary(f"{label} (rank {rank})", summary) + f"; files in {out_dir}")
    return result


def _merged(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _innermost(frames: List[Tuple[float, float, str]], a: float, b: float) -> List[Tuple[float, str]]:
    """Split ``[a, b)`` at the frames' edges; each piece charged to the shortest frame covering it."""
    edges = sorted({a, b} | {t for s, e, _ in frames for t in (s, e) if a < t < b})
    out = []
    for lo, hi in zip(edges, edges[1:]):
        mid = (lo + hi) / 2
        covering = [(e - s, name) for s, e, name in frames if s <= mid < e]
        out.append((hi - lo, min(covering)[1] if covering else "(no Python frame)"))
    return out


def idle_report(trace_path: str, min_gap_us: float = 20.0, top: int = 30) -> str:
    """Where the device waited, from a Chrome trace exported with Python stacks: the idle time
    between device kernels (gaps over ``min_gap_us``) charged to the innermost Python frame on the
    host, and to the innermost ``ds_infcl``/``deepspeed`` frame."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    device, frames = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        elif cat == "python_function":
            frames.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "?"))))
    busy = _merged(device)
    if not busy:
        return "no device kernels in the trace\n"
    gaps = [(b0[1], b1[0]) for b0, b1 in zip(busy, busy[1:]) if b1[0] - b0[1] >= min_gap_us]
    frames.sort()
    by_frame: Dict[str, float] = {}
    by_owner: Dict[str, float] = {}
    # One sweep over the gaps in time order: ``active`` holds the frames that started before the
    # gap's end and had not ended before an earlier gap's start; a frame that ends before this
    # gap's start ends before every later gap's too, so it is dropped for good.
    active: List[Tuple[float, float, str]] = []
    nxt = 0
    for a, b in gaps:
        while nxt < len(frames) and frames[nxt][0] < b:
            active.append(frames[nxt])
            nxt += 1
        active = [f for f in active if f[1] > a]
        for us, name in _innermost(active, a, b):
            by_frame[name] = by_frame.get(name, 0.0) + us
        for us, name in _innermost([f for f in active if "ds_infcl/" in f[2] or "deepspeed/" in f[2]], a, b):
            by_owner[name] = by_owner.get(name, 0.0) + us
    span = busy[-1][1] - busy[0][0]
    idle = sum(b - a for a, b in gaps)
    lines = [f"device span {span / 1e3:.1f} ms, idle in {len(gaps)} gaps of >= {min_gap_us:.0f} us: {idle / 1e3:.1f} ms",
             "", "idle ms  innermost Python frame"]
    lines += [f"{us / 1e3:8.2f}  {name}" for name, us in sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", "idle ms  innermost ds_infcl / deepspeed frame"]
    lines += [f"{us / 1e3:8.2f}  {name}" for name, us in sorted(by_owner.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines) + "\n"
