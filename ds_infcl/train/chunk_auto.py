"""``batch.chunk_size: "auto"``: measure the towers and pick the GradCache chunk before the engine
is built.

GradCache's speed depends on the chunk: small chunks leave the GPU idle between kernels, large
ones cost activation memory (one chunk's activations are alive at a time) without running faster
once the matmuls are big enough. ``resolve_auto_chunk`` builds a second copy of the task's towers
on this rank's device in the run's dtype and times, for each candidate chunk ``c``, what pass 1
and pass 3 of GradCache do with one chunk (a forward without gradients, then a forward and a
backward), over a chunk of the task's own first batch. Candidates are the powers of two that
divide the local batch, up to ``MAX_CHUNK`` and the local batch (plus the local batch itself when
it is not a power of two); the probe starts at ``START_CHUNK`` (or the largest candidate below
it), goes up while the chunk fits the memory budget, and goes down when the first one does not.

Memory (CUDA only; a CPU run is timed but has no device memory to budget): a chunk fits when the
probe's peak allocation (the towers, their gradients and one chunk's activations) plus an
estimate of what the engine adds fits ``batch.memory_budget_gib`` (default: 85% of the device's
free memory when the probe starts). The estimate is the cached features of the whole local batch
(in the run's dtype, plus three float32 copies: the loss's inputs, their gradients, the cached
gradients), the optimizer's float32 master weights, gradients and Adam moments (16 bytes a
parameter with bf16/fp16, 8 in float32; divided by the world size under ZeRO 1-2) and ZeRO 1-2's
reduce bucket; with ZeRO-3's step gathering the parameters once (``batch.gather_params``), its
float32 gradient buffers (4 bytes a trainable parameter).

Choice: every rank probes its own device, the timings are all-gathered, and every rank takes the
same chunk: among the chunks that fit on every rank, the largest whose slowest rank runs within
``TOLERANCE`` (3%) of the fastest chunk's (fewer micro-steps cost less engine overhead, which the
probe does not see). The probe runs the towers eagerly (before ``model.compile``: compiling every
candidate would take minutes); compiled blocks use less activation memory, not more, so the budget
holds. The chosen value is logged and replaces ``"auto"`` in the run config the run writes
(``<output_dir>/run_config.json``).
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ds_infcl.errors import ConfigError

__all__ = ["ChunkTiming", "candidate_chunks", "probe_chunks", "choose_chunk", "run_dtype", "engine_extra_bytes",
           "gathers_params", "resolve_auto_chunk", "MAX_CHUNK", "START_CHUNK", "TOLERANCE"]

MAX_CHUNK = 2048
START_CHUNK = 64
TOLERANCE = 0.03
BUDGET_FRACTION = 0.85


@dataclass
class ChunkTiming:
    """One probed chunk: samples/s of one GradCache chunk (forward without gradients, forward and
    backward), the probe's peak device memory (``None`` on CPU), whether it ran out of memory, and
    whether it fits the budget."""

    chunk: int
    samples_per_s: float = 0.0
    peak_bytes: Optional[int] = None
    oom: bool = False
    fits: bool = False


def candidate_chunks(local_batch: int, max_chunk: int = MAX_CHUNK) -> List[int]:
    """The chunks ``"auto"`` may pick, ascending: powers of two that divide ``local_batch`` and are
    at most ``min(local_batch, max_chunk)``, plus ``local_batch`` itself when it is at most
    ``max_chunk`` (one chunk). Never empty (1 divides everything)."""
    if local_batch < 1:
        raise ValueError(f"local_batch must be >= 1, got {local_batch}")
    out = []
    c = 1
    while c <= min(local_batch, max_chunk):
        if local_batch % c == 0:
            out.append(c)
        c *= 2
    if local_batch <= max_chunk and local_batch not in out:
        out.append(local_batch)
    return out


def probe_chunks(
    candidates: Sequence[int],
    measure: Callable[[int], ChunkTiming],
    fits: Callable[[ChunkTiming], bool],
    start: int = START_CHUNK,
) -> List[ChunkTiming]:
    """Measure candidates from ``start`` (or the largest candidate below it) upwards until one does
    not fit; when the first does not fit, downwards until one does. Returns the measured ones,
    ascending, each with ``fits`` set."""
    cands = sorted(candidates)
    above = [c for c in cands if c >= start]
    first = above[0] if above else cands[-1]
    i0 = cands.index(first)
    results: Dict[int, ChunkTiming] = {}

    def run(c: int) -> bool:
        t = measure(c)
        t.fits = (not t.oom) and bool(fits(t))
        results[c] = t
        return t.fits

    if run(first):
        for c in cands[i0 + 1:]:
            if not run(c):
                break
    else:
        for c in reversed(cands[:i0]):
            if run(c):
                break
    return [results[c] for c in sorted(results)]


def choose_chunk(per_rank: Sequence[Sequence[ChunkTiming]], tolerance: float = TOLERANCE) -> Optional[int]:
    """The chunk every rank takes (see the module docstring): among chunks that fit on all ranks,
    scored by the slowest rank's samples/s, the largest within ``tolerance`` of the best score;
    ``None`` when no chunk fits everywhere.

    A rank that did not measure a chunk counts it as fitting when a larger chunk fit there (one
    chunk's activations grow with the chunk): a rank with less free memory walks down from the
    start chunk while the others walk up, and the ranks then share no fitting chunk they all
    measured. Such a chunk is scored by the ranks that measured it."""
    by_rank = [{t.chunk: t for t in timings} for timings in per_rank]

    def fits_on(r, c: int) -> bool:
        return r[c].fits if c in r else any(t.fits and t.chunk > c for t in r.values())

    measured = set().union(*by_rank) if by_rank else set()
    scores = {c: min(r[c].samples_per_s for r in by_rank if c in r)
              for c in measured if all(fits_on(r, c) for r in by_rank)}
    if not scores:
        return None
    best = max(scores.values())
    return max(c for c, s in scores.items() if s >= (1 - tolerance) * best)


def run_dtype(ds_config: Dict[str, Any]) -> torch.dtype:
    """The dtype DeepSpeed gives the towers: bfloat16 or float16 when that block is enabled, else float32."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (ds_config.get(key) or {}).get("enabled") is True:
            return dtype
    return torch.float32


def gathers_params(cfg, ds_config: Dict[str, Any], model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the run's GradCache step will gather the parameters once per step
    (``ds_infcl.train.zero3_gather.rule``, from the configs and the probe's whole model before the
    engine exists)."""
    from ds_infcl.train.zero3_gather import rule

    zero = ds_config.get("zero_optimization") or {}
    return rule(cfg.batch.gather_params, grad_cache=cfg.batch.grad_cache, stage=int(zero.get("stage", 0)),
                fp16=(ds_config.get("fp16") or {}).get("enabled") is True,
                nvme_params=str((zero.get("offload_param") or {}).get("device", "")).endswith("nvme"),
                model=model, device=device)[0]


def engine_extra_bytes(num_params: int, local_batch: int, rows_per_example: int, feature_dim: int,
                       dtype: torch.dtype, ds_config: Dict[str, Any], world_size: int,
                       gather_params: bool = False) -> int:
    """What the engine holds beyond the probe's towers, gradients and one chunk (module docstring);
    with ``gather_params`` (ZeRO-3's step with the parameters gathered once) also its float32
    gradient buffers, 4 bytes a trainable parameter."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    features = local_batch * rows_per_example * feature_dim * (itemsize + 12)
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    shards = world_size if stage >= 1 else 1
    optimizer = num_params * (16 if dtype != torch.float32 else 8) // shards
    bucket = int(float(zero.get("reduce_bucket_size", 5e8))) * itemsize if stage in (1, 2) else 0
    buffers = 4 * num_params if gather_params and stage >= 3 else 0
    return features + optimizer + bucket + buffers


def _gather(obj) -> list:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        out = [None] * tdist.get_world_size()
        tdist.all_gather_object(out, obj)
        return out
    return [obj]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_chunk(model, chunk, device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds of one GradCache chunk (no-grad encode, then encode + backward), the mean of ``repeats``."""
    def once():
        with torch.no_grad():
            model("encode", chunk.query_inputs, chunk.key_inputs)
        q, k = model("encode", chunk.query_inputs, chunk.key_inputs)
        (q.float().sum() + k.float().sum()).backward()

    for _ in range(warmup):
        once()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def _measure(model, batch, device: torch.device, c: int, warmup: int, repeats: int) -> ChunkTiming:
    from ds_infcl.train.steps import move_batch

    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    timing = ChunkTiming(c)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        chunk = move_batch(batch.slice(0, c), device)
        seconds = _time_chunk(model, chunk, device, warmup, repeats)
        timing.samples_per_s = c / seconds if seconds > 0 else float("inf")
    except oom_types:
        timing.oom = True
    chunk = None
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        timing.peak_bytes = int(torch.cuda.max_memory_allocated(device))
        gc.collect()
        torch.cuda.empty_cache()
    return timing


def resolve_auto_chunk(cfg, ds_config: Dict[str, Any], world_size: int, rank: int, device: torch.device,
                       log: Callable[[str], None] = print, *, warmup: int = 1, repeats: int = 2,
                       gather: Callable[[Any], list] = _gather):
    """A copy of the run config ``cfg`` with ``batch.chunk_size: "auto"`` replaced by the measured
    choice (module docstring); every rank calls it (the timings are all-gathered). A global batch
    that does not divide over the ranks is returned unchanged (``resolve_deepspeed_config`` says
    why).

    Raises:
        ConfigError: no candidate chunk fits the memory budget on every rank.
    """
    from ds_infcl.tasks.base import as_batch, build_loss, get_task
    from ds_infcl.train.model import ContrastiveModel

    B = cfg.batch.global_batch_size
    if cfg.batch.chunk_size != "auto" or B % world_size:
        return cfg
    local = B // world_size
    candidates = candidate_chunks(local)
    dtype = run_dtype(ds_config)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = (cfg.batch.memory_budget_gib * 2**30 if cfg.batch.memory_budget_gib
                  else BUDGET_FRACTION * free)
    else:
        budget = None
        log("batch.chunk_size auto: on CPU the chunks are timed only (no device memory to budget)")

    t0 = time.time()
    torch.manual_seed(cfg.train.seed)
    task = get_task(cfg.task.name, cfg.task.args, cfg.task.module)  # the run builds its own afterwards
    model = ContrastiveModel(task.build_towers(), build_loss(task, cfg.loss)).to(device=device, dtype=dtype)
    model.train()
    data = task.batches(rank=rank, world_size=world_size, local_batch_size=candidates[-1], start_step=0,
                        seed=cfg.train.seed)
    batch = as_batch(next(data))
    if hasattr(data, "close"):
        data.close()
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = 1 + batch.keys_per_query
    with torch.no_grad():
        one = batch.slice(0, 1)
        from ds_infcl.train.steps import move_batch

        one = move_batch(one, device)
        feature_dim = int(model("encode_query", one.query_inputs).shape[-1])
    extra = engine_extra_bytes(num_params, local, rows, feature_dim, dtype, ds_config, world_size,
                               gather_params=gathers_params(cfg, ds_config, model, device))

    def fits(t: ChunkTiming) -> bool:
        return budget is None or (t.peak_bytes or 0) + extra <= budget

    mine = probe_chunks(candidates, lambda c: _measure(model, batch, device, c, warmup, repeats), fits)
    model = batch = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    per_rank = gather(mine)
    chosen = choose_chunk(per_rank)
    gib = 2**-30
    for t in mine:
        mem = "" if t.peak_bytes is None else f", peak {t.peak_bytes * gib:.2f} GiB + {extra * gib:.2f} GiB engine estimate"
        what = "out of memory" if t.oom else f"{t.samples_per_s:,.0f} samples/s{mem}"
        log(f"batch.chunk_size auto: chunk {t.chunk}: {what}{'' if t.fits else ' (does not fit)'}")
    if chosen is None:
        smallest = min(mine, key=lambda t: t.chunk)
        raise ConfigError(
            f"batch.chunk_size: \"auto\" found no chunk among {candidates} that fits the memory budget "
            f"({(budget or 0) * gib:.1f} GiB) on every rank; the smallest probed, {smallest.chunk}, "
            f"{'ran out of memory' if smallest.oom else f'needs {((smallest.peak_bytes or 0) + extra) * gib:.1f} GiB'}. "
            "Lower batch.global_batch_size, raise batch.memory_budget_gib, or give batch.chunk_size"
        )
    log(f"batch.chunk_size auto -> {chosen} (local batch {local}, {dtype}, "
        f"{'budget %.1f GiB' % (budget * gib) if budget else 'CPU'}; probe took {time.time() - t0:.1f} s)")
    out = copy.deepcopy(cfg)
    out.batch.chunk_size = chosen
    return out
