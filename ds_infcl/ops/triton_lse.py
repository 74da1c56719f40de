# Over 500 lines on purpose: the forward and backward launchers share one config, grid and chunking logic.
"""Triton kernels of the contrastive LSE op: one pass forward, one recompute backward.

Maths (DESIGN.md section 2). Logits ``x_ij = s * q_i . k_j`` for queries ``q [b, c]`` and keys
``k [m, c]``; with ``exclude_positive`` the pair ``(i, labels_i)`` is ``-inf``.

    forward    row_lse_i = log sum_j exp(x_ij)            col_lse_j = log sum_i exp(x_ij)
    backward   G_ij = a_i exp(x_ij - row_lse_i) + b_j exp(x_ij - col_lse_j)
               dq = s * G @ k        dk = s * G^T @ q        ds = sum_ij G_ij (q_i . k_j)

with ``a = dL/d row_lse`` and ``b = dL/d col_lse`` (either may be absent). A statistic of ``-inf``
(every entry of that row/column excluded) gives probability 0, never NaN.

Kernels (in ``ds_infcl.ops.triton_lse_kernels``) and launchers (here), in reading order:

* ``_lse_fwd_kernel``: a persistent grid of ``G x S`` programs. Program ``(g, s)`` takes the key
  blocks of split ``s`` one by one and walks the query blocks ``g, g + G, g + 2G, ...`` under
  each. Each ``[BLOCK_M, BLOCK_N]`` tile is one GEMM (fp32 accumulation, K-loop over ``c``). Its
  epilogue shifts every row by the row's own maximum (a reduction inside one warp), so one
  exponential per logit gives the row sums, merged into the program's own slot of ``[S, b]``
  (max, sum) buffers (read-modify-write without atomics: no other program touches it), and feeds
  a register accumulator of the columns that is reduced across threads only once per key block,
  into the program's slot of ``[G, m]`` (max, sum) buffers (exact when a column's sum is at
  least 2^-80 of its shift; a key block that fails takes its columns again with per-tile
  shifts). ``_lse_fwd_rows_kernel`` is the row-only variant (``compute_col=False``): row
  statistics kept in registers across the key blocks of a split, LSEs in ``[S, b]``.
  ``_merge_stats_kernel`` merges the partials in one launch. Scratch is ``2 (G m + S b)`` floats
  with ``G * S`` at most one program per SM (``_forward_grid``: one wave), so it stays linear in ``b + m`` (never
  ``b * m / tile``), and splitting the keys into ``S`` parts keeps a small ``b`` (1,024) busy on
  every SM.
* On Hopper, for bf16/fp16 inputs and at least 2 x #SMs 128-tiles, the statistics come from
  ``_lse_fwd_hopper_kernel`` instead (``ds_infcl.ops.gluon_lse_forward``, Gluon): the same
  ``[S, b]`` / ``[G, m]`` partials from ``G x S`` programs, two per SM (one per consumer
  warpgroup, each with its own TMA producer warp; the warpgroups take turns at the tensor cores),
  the column accumulator folded over each thread's own rows. Key blocks that fail the 2^-80
  check are marked and taken again exactly by ``_lse_fwd_cols_redo_kernel`` (Triton).
* ``_lse_bwd_g_kernel``: recomputes one tile of logits (once) and writes ``G`` (weights
  pre-scaled by a power of two in fp16, which would underflow) for a bounded block of
  ``CHUNK_ROWS x CHUNK_COLS`` pairs; both directions take one exponential per logit (per-row and
  per-column factors, range-checked per tile from per-block ranges that ``_bwd_prep_kernel``
  forms once per backward, with the column factors); the loss's positive terms are added to
  ``G`` at each row's positive. The two products ``dq += G @ k`` and ``dk += G^T @ q`` of that block run
  on the vendor GEMM with fp32 accumulation into fp32 (the first product into a slice overwrites
  it: no zero fills). Why not accumulate ``dq``/``dk`` inside the tile kernel: with ``c`` up to
  1,024 neither ``[BLOCK, c]`` accumulator fits in registers, so a fused kernel must add
  ``(BLOCK_M + BLOCK_N) * c`` fp32 values to global memory per tile (atomics or
  read-modify-write), 137 GB of traffic at b = m = 65,536, c = 512 with 128 x 128 tiles, against
  ~30 GB (write ``G`` once, read it twice) for the chunked form (docs/kernels.md).
* On Hopper, for bf16/fp16 inputs, ``G`` comes from ``_lse_bwd_g_hopper_kernel`` instead
  (``ds_infcl.ops.gluon_lse_kernels``, Gluon): the same maths over a persistent grid with TMA
  producer warps, two consumer warpgroups taking turns at the tensor cores, and TMA stores of
  ``G`` (``_use_gluon``; ``DS_INFCL_GLUON=0`` keeps the Triton kernels, forward and backward).
* ``_scale_out_kernel``: a float32 accumulator times ``scale`` into the output dtype, with the
  shares of ``ds = sum_ij G_ij q_i.k_j = sum_i q_i . (G k)_i`` from the same read.
* ``_positive_kernel``: the positive logits ``x_{i, labels_i}``, or directly each block's share
  of the InfoNCE value (``infonce_forward_triton``).

The scale is read by the kernels through a pointer (a learnable scale costs no host sync), and a
loss step launches nothing that waits for the GPU: it can be captured in a CUDA graph.

fp32 inputs follow torch's rule for a float32 matmul (``ds_infcl.ops.precision.tf32_allowed``):
``tl.dot`` uses TF32 where ``torch.backends.cuda.matmul.allow_tf32`` is true (or
``DS_INFCL_ALLOW_TF32=1`` pins it), full-precision fp32 otherwise; the backward's ``torch.mm``
products follow the torch flag by themselves. Under ``TRITON_INTERPRET=1`` (CPU tests)
bf16 operands are upcast to fp32 before ``tl.dot``, which the interpreter gets wrong otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import NamedTuple, Optional, Tuple, Union

import torch
import triton

from ds_infcl.ops import gluon_lse_forward, gluon_lse_kernels
from ds_infcl import settings
from ds_infcl.ops.precision import autocast_off, tf32_allowed
from ds_infcl.ops.triton_lse_kernels import (
    _bwd_prep_kernel,
    _lse_bwd_g_kernel,
    _lse_fwd_cols_redo_kernel,
    _lse_fwd_kernel,
    _lse_fwd_rows_kernel,
    _merge_stats_kernel,
    _positive_kernel,
    _scale_out_kernel,
)

__all__ = [
    "lse_forward_triton",
    "lse_backward_triton",
    "positive_logits_triton",
    "infonce_forward_triton",
    "unscaled_share",
    "allow_tf32",
]

# Backward scratch: the block of G written at once is at most CHUNK_ROWS x CHUNK_COLS elements
# (8192 x 8192 in bf16 = 128 MiB). Large square blocks minimise the fp32 read-modify-write of
# dq/dk ((1/CHUNK_ROWS + 1/CHUNK_COLS) * 8 b m c bytes in total) and give the two GEMMs enough
# output tiles (8192 x c) to fill the GPU. Tests shrink these to exercise several blocks.
CHUNK_ROWS = 8192
CHUNK_COLS = 8192
# fp32 G costs twice the bytes: halve the rows to keep the same scratch.
CHUNK_ROWS_FP32 = 4096
# When the gradients are written in the inputs' dtype (the single-device loss), the backward's
# whole scratch (the float32 accumulator of one side, the chunk accumulator of the other and the
# block of G) stays within this budget where it can: the columns of G shrink (balanced blocks,
# at least MIN_CHUNK_COLS) before the scratch grows past it. 240 MiB keeps b = m = 65,536 at
# c = 512 under 0.25 GiB (issue 3's memory target) with 8192 x 6144 blocks.
SCRATCH_BUDGET = 240 * 2**20
MIN_CHUNK_COLS = 4096


def allow_tf32() -> bool:
    """True when fp32 inputs use TF32 dot products (``ds_infcl.ops.precision.tf32_allowed``: torch's
    ``torch.backends.cuda.matmul.allow_tf32``, or ``DS_INFCL_ALLOW_TF32`` when set)."""
    return tf32_allowed()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------
# Configuration (documented heuristic, see docs/kernels.md)
# --------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    maxnreg: int = 0  # 0: no register cap
    programs_per_sm: int = 0  # persistent forward grid; 0: PROGRAMS_PER_SM

    def launch_opts(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts


# The compiled kernels of the last launches (registers, spills, shared memory: for profiling).
_LAST_KERNELS: dict = {}

# Programs of the persistent forward grid per SM. Its kernel takes ~255 registers per thread,
# so one program fits an SM; a second one per SM only queues (measured 27% slower on H200).
PROGRAMS_PER_SM = 1
# Round the logits with an explicit mul.rn (no FMA contraction) so forward and backward agree.
EXACT_MUL = settings.get("DS_INFCL_TRITON_EXACT_MUL")
# One exponential per logit in the backward of both directions (range check, exact fallback).
ONE_EXP = settings.get("DS_INFCL_TRITON_ONE_EXP")
# 16-bit inputs: each exponent's argument is one fused multiply-add (``_exp_shifted``).
FMA_EXP = settings.get("DS_INFCL_TRITON_FMA_EXP")


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs, enough to exercise the splits and groups
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _tuning_ints(name: str, text: str, sep: str, form: str, counts: Tuple[int, int]) -> Tuple[int, ...]:
    """The integers of the tuning setting ``name`` (``text`` split at ``sep``): ``counts[0]``
    required ones, positive, then up to ``counts[1]`` in all, the optional ones >= 0 (0: the
    default); otherwise an error naming the variable and its form."""
    try:
        values = tuple(int(v) for v in text.split(sep))
    except ValueError:
        values = ()
    n = counts[0]
    if not n <= len(values) <= counts[1] or min(values[:n]) <= 0 or min(values[n:], default=0) < 0:
        raise ValueError(f"{name} must be {form!r} (integers, the required ones positive), got {text!r}")
    return values


def _env_config(name: str) -> Optional[_Config]:
    """``DS_INFCL_TRITON_FWD`` / ``_BWD`` = "BM,BN,BK,warps,stages[,maxnreg[,programs_per_sm]]"
    overrides (tuning)."""
    val = settings.get(name)
    if not val:
        return None
    return _Config(*_tuning_ints(name, val, ",", "BM,BN,BK,warps,stages[,maxnreg[,programs_per_sm]]", (5, 7)))


def _pick_config(kind: str, b: int, m: int, c: int, dtype: torch.dtype, device: torch.device) -> _Config:
    """Tiles for Hopper (H100/H200), measured in docs/kernels.md; correct on any CUDA GPU.

    128 x 128 tiles with a 64-wide K step (32 for fp32, whose operands take twice the shared
    memory), 8 warps, 3 pipeline stages; 64 x 128 with 4 warps for the 16-bit backward (three
    programs fit an SM); 64 x 64 tiles with 4 warps when the problem has fewer 128-tiles than two
    per SM (small per-rank batches). The interpreter gets 32 x 32 tiles so that small test shapes still span several
    tiles. Measured sweeps: ``python -m ds_infcl.bench.triton_tune``.
    """
    env = _env_config("DS_INFCL_TRITON_" + kind.upper())
    if env is not None:
        return env
    if device.type != "cuda":
        return _Config(32, 32, 32, 4, 1)
    bk = 32 if dtype == torch.float32 else 64
    tiles = triton.cdiv(b, 128) * triton.cdiv(m, 128)
    if tiles < 2 * _num_sms(device):
        return _Config(64, 64, bk, 4, 3)
    if kind == "bwd" and dtype != torch.float32:
        # 128 x 256 with 8 warps: each tile reads its operands from L2 once for twice the logits
        # of 128 x 128 (docs/kernels.md: backward 25.7 ms against 27.9 ms for 64 x 128 with 4
        # warps at b = 65,536, c = 512, 0.40 against 0.52 ms at 8,192, on H200). Its register
        # spills sit in the out-of-range branch (two exponentials), which in-range tiles skip.
        return _Config(128, 256, 64, 8, 3)
    # 128 x 128, 8 warps: one program per SM (255 registers, no spills); the key-major forward
    # takes 11.6 ms at b = 65,536, c = 512 on H200. 256 x 128 and 128 x 256 spill and gained 3%
    # at most (docs/kernels.md, "Tile choices").
    return _Config(128, 128, bk, 8, 3)


def _kernel_flags(query: torch.Tensor, c: int, block_k: int) -> dict:
    upcast = query.dtype == torch.bfloat16 and _interpreting()
    return dict(
        EVEN_K=(c % block_k == 0),
        # 0: 16-bit operands (tensor cores); 1: full fp32; 2: TF32 (torch's float32 matmul rule,
        # ds_infcl.ops.precision). The interpreter's bf16 operands are upcast, hence fp32 there.
        PRECISION=(2 if allow_tf32() else 1) if query.dtype == torch.float32 else (1 if upcast else 0),
        UPCAST=upcast,
        EXACT_MUL=(query.device.type == "cuda" and EXACT_MUL),
    )


# The Gluon G kernel's tiles: BLOCK_M, BLOCK_N, BLOCK_K, stages per ring, consumer warpgroups
# (2 rings x 4 x 16 KiB and 2 x 32 KiB of G staging; measured against 64-row, 64-column, 2-3
# stage and single-consumer variants, docs/kernels.md).
GLUON_TILES = "128,128,32,4,2"
# The Gluon forward's tiles: BLOCK_M, BLOCK_N, BLOCK_K, stages per ring (two consumer warpgroups,
# each with its ring of 3 x 32 KiB), and 1 for the warpgroups taking turns at the tensor cores
# (measured against 32-wide K steps with 4 or 6 stages, 2 stages, no turns: docs/kernels.md).
GLUON_FWD_TILES = "128,128,64,3,1"


def _gluon_tiles(env: str, default: str) -> Tuple[Tuple[int, ...], dict]:
    """A Gluon kernel's ``(tiles, regs)`` (``gluon_lse_kernels.gluon_config``): ``default``, or the
    environment variable ``env`` for tuning (``DS_INFCL_GLUON_TILES="BM,BN,BK,stages,consumers[,
    consumer_regs,producer_regs,maxnreg]"``, ``DS_INFCL_GLUON_FWD_TILES="BM,BN,BK,stages,turns[,
    ...]"``)."""
    text = settings.get(env)
    if text:
        form = "BM,BN,BK,stages,{}[,consumer_regs,producer_regs,maxnreg]".format(
            "turns" if env.endswith("FWD_TILES") else "consumers")
        _tuning_ints(env, text, ",", form, (5, 8))
    return gluon_lse_kernels.gluon_config(text or default)


# Why a Gluon kernel ("forward" / "backward") could not be built in this process
# (``DS_INFCL_GLUON=auto``); absent while it can.
_GLUON_FAILED: dict = {}


def _gluon_build_errors() -> tuple:
    """What a Triton release raises when it cannot build a kernel (the Gluon API is experimental:
    a later release may reject this one)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return (CompilationError, OutOfResources, PTXASError)


def _gluon_failed(err: Exception, kernel: str) -> None:
    """Record (and say, once) that the Gluon ``kernel`` cannot be built here: its Triton
    counterpart runs from then on, in this process; with ``DS_INFCL_GLUON=1`` re-raise instead."""
    if settings.get("DS_INFCL_GLUON") == "1":
        raise err
    first = (str(err).strip().splitlines() or [""])[-1][:200]
    _GLUON_FAILED[kernel] = f"{type(err).__name__}: {first}"
    instead = "the Triton kernel writes G" if kernel == "backward" else "the Triton forward runs"
    warnings.warn(
        f"ds_infcl: the Gluon {kernel} kernel could not be built with Triton {triton.__version__} "
        f"({_GLUON_FAILED[kernel]}); {instead} instead, for the rest of this process "
        "(DS_INFCL_GLUON=0 skips the attempt, DS_INFCL_GLUON=1 makes it an error)",
        settings.FastPathWarning, stacklevel=3)


def _use_gluon(query: torch.Tensor, key: torch.Tensor, kernel: str = "backward") -> bool:
    """Whether the Gluon ``kernel`` (``gluon_lse_kernels``: the backward's ``G``, or the
    forward's statistics) runs: ``DS_INFCL_GLUON=auto`` (default) on a Hopper GPU for 16-bit
    inputs whose rows are 16-byte aligned (TMA), with Gluon in the installed Triton; ``0`` never;
    ``1`` requires it (an error names what is missing). Under ``auto`` on a Hopper GPU whose Triton
    has no usable Gluon, 16-bit inputs get a ``FastPathWarning`` that says so, once per process."""
    mode = settings.get("DS_INFCL_GLUON")
    if mode == "0":
        return False
    why = None
    if kernel in _GLUON_FAILED:
        why = f"it could not be built earlier in this process ({_GLUON_FAILED[kernel]})"
    elif not gluon_lse_kernels.AVAILABLE:
        why = (f"this Triton ({triton.__version__}) has no usable Gluon Hopper API "
               f"({gluon_lse_kernels.UNAVAILABLE_WHY})")
        if mode == "auto" and _on_hopper(query) and _fma_exp(query):  # (16-bit inputs: Gluon's)
            settings.warn_once("gluon_unavailable", f"ds_infcl: the Gluon kernels are not used on this Hopper GPU: "
                               f"{why}; the Triton kernels run instead (set DS_INFCL_GLUON=0 to silence)")
    elif query.device.type != "cuda" or _interpreting():
        why = "the inputs are not on a CUDA GPU (or TRITON_INTERPRET=1)"
    elif torch.cuda.get_device_capability(query.device)[0] != 9:
        why = f"the GPU is not Hopper (capability {torch.cuda.get_device_capability(query.device)})"
    elif not _fma_exp(query):
        why = f"{query.dtype} inputs (or DS_INFCL_TRITON_FMA_EXP=0): the Gluon kernels take 16-bit operands"
    elif (query.shape[1] * query.element_size()) % 16 or query.data_ptr() % 16 or key.data_ptr() % 16:
        why = "the feature rows are not 16-byte aligned (TMA needs c a multiple of 8 and aligned storage)"
    if why is not None and mode == "1":
        raise RuntimeError(f"DS_INFCL_GLUON=1, but the Gluon {kernel} cannot run: {why}")
    return why is None


def _on_hopper(query: torch.Tensor) -> bool:
    """Whether ``query`` is on a Hopper GPU (compiled kernels, not the interpreter)."""
    return (query.device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(query.device)[0] == 9)


def _fma_exp(query: torch.Tensor) -> bool:
    """Whether the LSE kernels take each exponent's argument as one fused multiply-add (16-bit
    inputs, ``FMA_EXP``); float32 inputs keep the exact form."""
    return FMA_EXP and query.dtype in (torch.float16, torch.bfloat16)


def _check_inputs(query: torch.Tensor, key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if query.dim() != 2 or key.dim() != 2 or query.shape[1] != key.shape[1]:
        raise ValueError(f"query [b, c] and key [m, c] expected, got {tuple(query.shape)} and {tuple(key.shape)}")
    if query.dtype != key.dtype or query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"query and key must share one dtype of float32, float16, bfloat16; got {query.dtype} and {key.dtype}"
        )
    return query.contiguous(), key.contiguous()


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU, whatever the current device is."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _labels_arg(query: torch.Tensor, labels: Optional[torch.Tensor], needed: bool):
    """Integer labels for the kernels (int32/int64 as they are), or (unused pointer, False) for
    the diagonal / no labels."""
    if needed and labels is not None:
        dtype = labels.dtype if labels.dtype in (torch.int32, torch.int64) else torch.int64
        return labels.to(device=query.device, dtype=dtype).contiguous(), True
    return query, False  # unused pointer


def _scale_arg(scale, device: torch.device) -> torch.Tensor:
    """The scale as a 1-element float32 tensor on ``device``, read by the kernels through a
    pointer: a learnable (device) scale never costs a host synchronization."""
    if torch.is_tensor(scale):
        return scale.detach().reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), device=device, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Forward launcher
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _forward_grid(num_qblocks: int, num_kblocks: int, b: int, m: int, programs: int) -> Tuple[int, int]:
    """``(G, S)``: query groups x key splits of the persistent forward grid, at most ``programs``
    (one wave: a program more than fit runs after the others, and the kernel takes twice as
    long). Minimises the tiles of the busiest program, ``ceil(qblocks / G) * ceil(kblocks / S)``,
    then the scratch ``G * m + S * b``; only split counts that divide the key blocks evenly
    into ``ceil(kblocks / S)`` are candidates, as the launcher rounds them."""
    programs = max(1, min(programs, num_qblocks * num_kblocks))
    best = None
    for splits in range(1, min(num_kblocks, programs) + 1):
        per_split = triton.cdiv(num_kblocks, splits)
        if triton.cdiv(num_kblocks, per_split) != splits:
            continue  # the launcher would round this split count down
        groups = min(num_qblocks, programs // splits)
        key = (triton.cdiv(num_qblocks, groups) * per_split, groups * m + splits * b)
        if best is None or key < best[0]:
            best = (key, groups, splits)
    return best[1], best[2]


def lse_forward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    compute_col: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row LSE ``[b]`` and (if ``compute_col``) column LSE ``[m]``, float32, from one pass.

    Same contract as ``ds_infcl.ops.tiled.lse_forward_torch``: all-excluded rows/columns and empty
    inputs give ``-inf``. ``scale`` is a number or a one-element tensor (read on the device).
    Two launches: the tile kernel and the merge of its partial statistics.
    """
    query, key = _check_inputs(query, key)
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    if b == 0 or m == 0 or c == 0:  # no GEMM to run: the tiled path handles the corner cases
        from ds_infcl.ops.tiled import lse_forward_torch

        return lse_forward_torch(query, key, scale, labels=labels, exclude_positive=exclude_positive,
                                 compute_col=compute_col)
    cfg = _pick_config("fwd", b, m, c, query.dtype, device)
    gluon = (compute_col and cfg.block_m == 128 and _env_config("DS_INFCL_TRITON_FWD") is None
             and _use_gluon(query, key, "forward"))
    if gluon:  # the Gluon kernel's tiles; the Triton kernel's K step and warps for its redo pass
        (gbm, gbn, gbk, stages, pingpong), gregs = _gluon_tiles("DS_INFCL_GLUON_FWD_TILES", GLUON_FWD_TILES)
        cfg = cfg._replace(block_m=gbm, block_n=gbn)
    num_qblocks = triton.cdiv(b, cfg.block_m)
    num_kblocks = triton.cdiv(m, cfg.block_n)
    # The Gluon kernel runs two programs of the grid per SM (one per consumer warpgroup).
    programs = (2 if gluon else cfg.programs_per_sm or PROGRAMS_PER_SM) * _num_sms(device)
    groups, splits = _forward_grid(num_qblocks, num_kblocks, b, m, programs)
    kblocks_per_split = triton.cdiv(num_kblocks, splits)
    splits = triton.cdiv(num_kblocks, kblocks_per_split)
    # Every slot is written by the kernel (each program starts its slots itself).
    row_part = torch.empty((splits, b), device=device, dtype=torch.float32)
    row_sum = torch.empty((splits, b), device=device, dtype=torch.float32) if compute_col else row_part
    if compute_col:
        col_max = torch.empty((groups, m), device=device, dtype=torch.float32)
        col_sum = torch.empty((groups, m), device=device, dtype=torch.float32)
    lab, has_labels = _labels_arg(query, labels, exclude_positive)
    s_t = _scale_arg(scale, device)
    with _on_device(query):
        common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      EXCLUDE=exclude_positive, HAS_LABELS=has_labels, **cfg.launch_opts(),
                      **_kernel_flags(query, c, cfg.block_k))
        if gluon:
            # Key blocks whose columns fail the kernel's 2^-80 check are marked here and taken
            # again, exactly, by the redo kernel (one program per (group, key block); the others
            # read their mark and return).
            redo = torch.empty((groups * num_kblocks,), device=device, dtype=torch.int32)
            try:
                _LAST_KERNELS["fwd"] = gluon_lse_forward.launch_fwd_hopper(
                    gluon_lse_kernels.make_desc(query, (gbm, gbk)), gluon_lse_kernels.make_desc(key, (gbn, gbk)),
                    lab, row_part, row_sum, col_max, col_sum, redo, s_t, b, m, num_qblocks, kblocks_per_split,
                    num_kblocks, groups, splits, c,
                    gluon_lse_kernels.g_flags(gluon_lse_forward.FLAG_BITS, EXCLUDE=exclude_positive,
                                              HAS_LABELS=has_labels, PINGPONG=bool(pingpong)),
                    stages, **gregs)
            except _gluon_build_errors() as err:  # built at the first launch: nothing ran yet
                _gluon_failed(err, "forward")
                return lse_forward_triton(query, key, scale, labels=labels, exclude_positive=exclude_positive)
            _lse_fwd_cols_redo_kernel[(groups, num_kblocks)](
                query, key, lab, redo, col_max, col_sum, s_t,
                b, m, c, query.stride(0), key.stride(0), num_qblocks, num_kblocks, **common,
            )
        elif compute_col:
            _LAST_KERNELS["fwd"] = _lse_fwd_kernel[(groups, splits)](
                query, key, lab, row_part, row_sum, col_max, col_sum, s_t,
                b, m, c, query.stride(0), key.stride(0), num_qblocks, kblocks_per_split, num_kblocks,
                FMA_EXP=_fma_exp(query), **common,
            )
        else:
            col_max = col_sum = row_part  # unused pointers
            _LAST_KERNELS["fwd"] = _lse_fwd_rows_kernel[(groups, splits)](
                query, key, lab, row_part, s_t,
                b, m, c, query.stride(0), key.stride(0), num_qblocks, kblocks_per_split, num_kblocks,
                FMA_EXP=_fma_exp(query), **common,
            )
        if splits == 1 and not compute_col:
            return row_part[0], None
        row = torch.empty((b,), device=device, dtype=torch.float32)
        col = torch.empty((m,), device=device, dtype=torch.float32) if compute_col else row
        block = 32 if device.type != "cuda" else 256
        row_blocks = triton.cdiv(b, block)
        grid = row_blocks + (triton.cdiv(m, block) if compute_col else 0)
        _merge_stats_kernel[(grid,)](
            row_part, row_sum, splits, b, row, col_max, col_sum, groups, m, col, row_blocks,
            BLOCK=block, COMPUTE_COL=compute_col, ROW_HAS_SUM=compute_col, num_warps=4,
        )
    return row, (col if compute_col else None)


def _positive_launch(query, key, scale_t, labels, row=None, col=None, weight=0.0, mode=0) -> torch.Tensor:
    """Launch ``_positive_kernel``; returns the positive logits ``[b]`` (``mode`` 0) or the loss
    shares of its row blocks (``mode`` 1/2, see the kernel)."""
    b, c = query.shape
    lab, has_labels = _labels_arg(query, labels, True)
    block_m, block_k = (32, 32) if query.device.type != "cuda" else (64, 128)
    block_k = min(block_k, max(16, triton.next_power_of_2(c)))
    blocks = triton.cdiv(b, block_m)
    out = torch.empty((b if mode == 0 else blocks,), device=query.device, dtype=torch.float32)
    if b:
        with _on_device(query):
            _positive_kernel[(blocks,)](
                query, key, lab, out, scale_t, row if row is not None else out,
                col if col is not None else out, b, c, query.stride(0), key.stride(0), weight,
                BLOCK_M=block_m, BLOCK_K=block_k, HAS_LABELS=has_labels,
                EXACT_MUL=_kernel_flags(query, c, block_k)["EXACT_MUL"], MODE=mode, num_warps=4,
            )
    return out


def positive_logits_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[b]`` float32 positive logits ``scale * q_i . k_{labels_i}`` (default labels: the
    diagonal, which needs ``m >= b``), rounded like the tile logits; no autograd."""
    query, key = _check_inputs(query, key)
    return _positive_launch(query, key, _scale_arg(scale, query.device), labels)


def infonce_forward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    symmetric: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(loss [], row_lse [b], col_lse [m] or None)``: the InfoNCE of ``ds_infcl.ops.infonce`` on
    one device in four launches (tiles, merge, positive logits with the loss's block shares,
    their sum)."""
    query, key = _check_inputs(query, key)
    s_t = _scale_arg(scale, query.device)
    row, col = lse_forward_triton(query, key, s_t, compute_col=symmetric)
    shares = _positive_launch(query, key, s_t, labels, row, col, (0.5 if symmetric else 1.0) / query.shape[0],
                              2 if symmetric else 1)
    return shares.sum(), row, col


# --------------------------------------------------------------------------------------------
# Backward launcher
# --------------------------------------------------------------------------------------------

_ADDMM_OUT_DTYPE: Optional[bool] = None  # does torch.addmm(..., beta=0, out_dtype=float32, out=acc) work here?


def _addmm_out_dtype_works(device: torch.device) -> bool:
    """Probe (once per process) for cuBLAS products of 16-bit operands accumulated into float32
    in place, with ``beta=0`` ignoring the (uninitialized) accumulator."""
    global _ADDMM_OUT_DTYPE
    if _ADDMM_OUT_DTYPE is None:
        try:
            a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
            w = torch.randn(32, 16, device=device, dtype=torch.bfloat16)
            acc = torch.randn(64, 16, device=device, dtype=torch.float32)
            want = acc + a.float() @ w.float()
            torch.addmm(acc, a, w, out_dtype=torch.float32, out=acc)
            ok = torch.allclose(acc, want, rtol=1e-4, atol=1e-4)
            acc.fill_(float("nan"))
            torch.addmm(acc, a, w, beta=0, out_dtype=torch.float32, out=acc)
            _ADDMM_OUT_DTYPE = bool(ok and torch.allclose(acc, a.float() @ w.float(), rtol=1e-4, atol=1e-4))
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_OUT_DTYPE = False
    return _ADDMM_OUT_DTYPE


def _addmm_f32(acc: torch.Tensor, a: torch.Tensor, w: torch.Tensor, first: bool) -> None:
    """``acc = a @ w`` (``first``: ``acc`` is uninitialized and ignored) or ``acc += a @ w``, with
    fp32 accumulation and fp32 ``acc`` whatever the dtype of ``a``, ``w``."""
    beta = 0 if first else 1
    if a.dtype == torch.float32:
        torch.addmm(acc, a, w, beta=beta, out=acc)
    elif acc.device.type == "cuda" and _addmm_out_dtype_works(acc.device):
        torch.addmm(acc, a, w, beta=beta, out_dtype=torch.float32, out=acc)
    elif acc.device.type == "cuda":
        prod = torch.mm(a, w, out_dtype=torch.float32)
        if first:
            acc.copy_(prod)
        else:
            acc.add_(prod)
    else:
        torch.addmm(acc, a.float(), w.float(), beta=beta, out=acc)


def _grad_scale(*weights: Optional[torch.Tensor]) -> torch.Tensor:
    """Power of two that brings the largest upstream weight to ~1 (no host sync): keeps G in the
    fp16 range (its entries are weights times probabilities <= 1, and 1/B underflows fp16 fast)."""
    mx = torch.stack([w.abs().max() for w in weights if w is not None and w.numel()]).max()
    mx = torch.where(torch.isfinite(mx) & (mx > 0), mx, torch.ones_like(mx))
    return torch.exp2(-torch.ceil(torch.log2(mx)))


def _chunks(align: int) -> Tuple[int, int, bool]:
    """``(rows, cols, given)``: the block of ``G`` written at once (``DS_INFCL_TRITON_CHUNK="RxC"``
    overrides the module constants, for tuning: ``given``), rounded up to multiples of ``align``:
    a block must start where a forward tile starts, so that the recomputed logits are
    bit-identical to the forward's (the same tile position runs the same dot-product order)."""
    env = settings.get("DS_INFCL_TRITON_CHUNK")
    r, c = _tuning_ints("DS_INFCL_TRITON_CHUNK", env.lower(), "x", "RxC", (2, 2)) if env else (CHUNK_ROWS, CHUNK_COLS)
    return triton.cdiv(r, align) * align, triton.cdiv(c, align) * align, bool(env)


def _fit_budget(b: int, m: int, c: int, rows: int, cols: int, g_dtype: torch.dtype, align: int) -> Tuple[int, int]:
    """Narrow the column blocks of G (balanced, multiples of ``align``, at least
    ``MIN_CHUNK_COLS``) until the backward's scratch fits ``SCRATCH_BUDGET``, where that is within
    reach; beyond it the blocks keep their full size (speed). With rows outer
    (``m <= b``) the whole float32 accumulator is ``dk`` (``m c``) and the chunk one ``rows c``;
    otherwise the roles swap, and the rows of G are the narrowed side."""
    full, chunk_side = (m, rows) if m <= b else (b, cols)
    fixed = (full + chunk_side) * c * 4
    per_elem = torch.finfo(g_dtype).bits // 8
    inner, inner_len = (cols, m) if m <= b else (rows, b)
    other = rows if m <= b else cols
    if fixed + other * min(inner, MIN_CHUNK_COLS) * per_elem > SCRATCH_BUDGET:
        return rows, cols  # out of reach (the whole accumulator alone is too large): keep speed
    pieces = triton.cdiv(inner_len, inner)
    while inner > MIN_CHUNK_COLS and fixed + rows * cols * per_elem > SCRATCH_BUDGET:
        pieces += 1
        inner = max(MIN_CHUNK_COLS, triton.cdiv(triton.cdiv(inner_len, pieces), align) * align)
        rows, cols = (rows, inner) if m <= b else (inner, cols)
    return rows, cols


def _scale_out(acc, factor, out, own, ds_parts, ds_offset, block_r, add=None, add_factor=None):
    """``out = acc * factor`` (cast to ``out``'s dtype) and, with ``own``, the scale-gradient shares
    ``sum(acc * own)`` of each ``block_r`` rows at ``ds_parts[ds_offset:]``; with ``add`` (float32),
    ``acc + add * add_factor`` in place of ``acc`` in both."""
    rows, c = acc.shape
    with _on_device(acc):
        _scale_out_kernel[(triton.cdiv(rows, block_r),)](
            acc, factor, out, own if own is not None else acc,
            ds_parts if ds_parts is not None else acc, add if add is not None else acc,
            add_factor if add is not None else acc, rows, c, own.stride(0) if own is not None else c,
            add.stride(0) if add is not None else c, ds_offset,
            BLOCK_R=block_r, BLOCK_C=min(128, max(16, triton.next_power_of_2(c))), HAS_DOT=own is not None,
            HAS_ADD=add is not None, num_warps=4,
        )


def unscaled_share(sums: torch.Tensor, query: torch.Tensor, scale, weight: torch.Tensor, out=None):
    """``(dq, dscale)`` of ``dq`` sums from ``lse_backward_triton(unscaled=True)`` times ``weight``
    (a 0-dim tensor, their factor included): ``sums * weight`` (into ``out`` when given) and
    ``sum(sums * query) * weight / scale``."""
    s = scale.reshape(()) if torch.is_tensor(scale) else scale
    dq = torch.mul(sums, weight, out=out)
    return dq, (sums * query.float()).sum() * (weight / s)


def _weight_arg(w: torch.Tensor, gs: Optional[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """A float32 weight vector (stride 0 allowed: one weight for all) and its stride."""
    w = w.float()
    if gs is not None:
        w = w * gs
    if w.dim() != 1:
        raise ValueError(f"upstream gradients must be 1-D, got shape {tuple(w.shape)}")
    return w, w.stride(0)


@autocast_off  # (its products are torch.addmm; the gather path calls it directly)
def lse_backward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: Union[float, torch.Tensor],
    row_lse: torch.Tensor,
    col_lse: Optional[torch.Tensor],
    grad_row: Optional[torch.Tensor],
    grad_col: Optional[torch.Tensor],
    *,
    labels: Optional[torch.Tensor] = None,
    exclude_positive: bool = False,
    grad_pos: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    dq_add: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    unscaled: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [b, c], dk [m, c], dscale [])`` of
    ``sum(grad_row * row_lse) + sum(grad_col * col_lse) + sum(grad_pos * pos)``, where ``pos_i``
    is the logit of query i with its positive key ``labels_i`` (default the diagonal).

    ``row_lse`` / ``col_lse`` may be global statistics of a larger matrix (ring blocks); each
    tile is recomputed once. The upstream gradients may be expanded (stride-0) vectors.
    ``dq`` / ``dk`` are float32 (what the ring accumulates across blocks), or ``out_dtype`` when
    given: then the smaller side keeps a whole float32 accumulator and the other side a float32
    accumulator of one chunk, written out in ``out_dtype`` when its chunk is done. Scratch: one
    ``CHUNK_ROWS x CHUNK_COLS`` block of ``G`` and that chunk accumulator.

    ``unscaled=True`` (no ``out_dtype``): ``(dq sums, dk sums, factor)``, the float32 sums
    ``G @ key`` and ``G^T @ query`` before their scaling pass and the 0-dim factor that pass would
    apply (``dq = sums * factor``; the scale gradient is ``sum(dq sums * query) * factor / scale``).
    ``dq_add=(out [b, c], add [b, c], weight [], add_factor [])`` (no ``out_dtype``): ``add`` is
    another block's ``dq`` sums with their factor (``unscaled=True``), weighted by ``weight``
    (0-dim tensors); ``dq`` comes back in ``out`` (any float dtype) as this block's plus ``weight``
    times that one, and ``dscale`` covers both, from the pass that scales ``dq`` (one rounding; the
    gather path adds its own block so, ``ds_infcl.loss.gather_blocks``).
    """
    query, key = _check_inputs(query, key)
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    f32 = torch.float32
    res_dtype = out_dtype or f32
    has_row, has_col, has_pos = grad_row is not None, grad_col is not None, grad_pos is not None
    if (dq_add is not None or unscaled) and out_dtype is not None:
        raise ValueError("lse_backward_triton: dq_add= and unscaled=True need the float32 gradients (out_dtype=None)")
    if dq_add is not None and unscaled:
        raise ValueError("lse_backward_triton: dq_add= writes the scaled dq; it cannot go with unscaled=True")
    if b == 0 or m == 0 or c == 0 or not (has_row or has_col or has_pos):
        dq, dk = (torch.zeros((n, c), device=device, dtype=res_dtype) for n in (b, m))
        if unscaled:
            return dq, dk, _scale_arg(scale, device).reshape(()).clone()
        dscale = torch.zeros((), device=device, dtype=f32)
        if dq_add is not None:  # only the other block's share
            out, add, weight, add_factor = dq_add
            dq, dscale = unscaled_share(add, query, _scale_arg(scale, device), weight * add_factor, out=out)
        return dq, dk, dscale
    s_t = _scale_arg(scale, device)
    # fp16 G needs its weights brought near 1 (1/B underflows fp16); bf16 and fp32 have the range.
    gs = _grad_scale(grad_row, grad_col, grad_pos) if query.dtype == torch.float16 else None
    r2 = a = cl2 = w = p = s_t  # placeholders for absent terms (never read)
    sa = sw = sp = 0
    if has_row:
        r2 = row_lse.float().contiguous()
        a, sa = _weight_arg(grad_row, gs)
    if has_col:
        cl2 = col_lse.float().contiguous()
        w, sw = _weight_arg(grad_col, gs)
    if has_pos:
        p, sp = _weight_arg(grad_pos, gs)
    lab, has_labels = _labels_arg(query, labels, exclude_positive or has_pos)
    use_gluon = _use_gluon(query, key)
    if use_gluon:  # the Triton kernel takes the same tiles where a block's rows are not aligned
        (gbm, gbn, gbk, stages, consumers), gregs = _gluon_tiles("DS_INFCL_GLUON_TILES", GLUON_TILES)
        cfg = _Config(gbm, gbn, gbk, 8, 3)
        gflags = gluon_lse_kernels.g_flags(HAS_ROW=has_row, HAS_COL=has_col, HAS_POS=has_pos, EXCLUDE=exclude_positive,
                                           HAS_LABELS=has_labels, ONE_EXP=ONE_EXP)
        # TMA descriptors: made once per backward for the operands and once per shape of G (the
        # blocks reuse one buffer), which keeps the host's cost per block near a plain launch.
        descs = {"q": gluon_lse_kernels.make_desc(query, (gbm, gbk)), "k": gluon_lse_kernels.make_desc(key, (gbn, gbk))}
    else:
        cfg = _pick_config("bwd", b, m, c, query.dtype, device)
    flags = _kernel_flags(query, c, cfg.block_k)
    # The one-exponential backward's per-block ranges and column factors (one small launch).
    rng = v = s_t
    n_rb, n_cb = triton.cdiv(b, cfg.block_m), triton.cdiv(m, cfg.block_n)
    if has_row and has_col and ONE_EXP:
        rng = torch.empty((n_rb + 2 * n_cb,), device=device, dtype=f32)
        v = torch.empty((m,), device=device, dtype=f32)
        with _on_device(query):
            _bwd_prep_kernel[(n_rb + n_cb,)](r2, b, cl2, w, sw, m, rng, v, n_rb, n_cb,
                                             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=4)

    def launch_g(g, i0, j0, rows, cols, block):
        if i0 % cfg.block_m or j0 % cfg.block_n:
            raise AssertionError(f"block of G at ({i0}, {j0}) is not aligned to the {cfg.block_m} x {cfg.block_n} tiles")
        if use_gluon and "backward" not in _GLUON_FAILED and (cols * g.element_size()) % 16 == 0:
            gkey = (g.data_ptr(), rows, cols)
            if gkey not in descs:
                descs[gkey] = gluon_lse_kernels.make_desc(g, (gbm, gbn))
            try:
                _LAST_KERNELS["bwd"] = gluon_lse_kernels.launch_g_hopper(
                    descs["q"], descs["k"], descs[gkey], c, i0, j0, lab, r2, a, cl2, w, p, s_t, rng, v, sa, sw, sp,
                    n_rb, n_cb, gflags, stages, _num_sms(device), consumers=consumers, **gregs)
                return
            except _gluon_build_errors() as err:  # built at the first launch: nothing ran yet
                _gluon_failed(err, "backward")  # this block and the rest take the Triton kernel (same tiles)
        grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(cols, cfg.block_n))
        _LAST_KERNELS["bwd"] = _lse_bwd_g_kernel[grid](
            query, key, lab, r2, a, cl2, w, p, g, s_t, rng, v,
            i0, j0, rows, cols, c, query.stride(0), key.stride(0), sa, sw, sp, n_rb, n_cb,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EXCLUDE=exclude_positive, HAS_LABELS=has_labels, HAS_ROW=has_row, HAS_COL=has_col,
            HAS_POS=has_pos, ONE_EXP=ONE_EXP, FMA_EXP=_fma_exp(query), **cfg.launch_opts(), **flags,
        )

    factor = s_t / gs if gs is not None else s_t
    if unscaled:
        dq, dk, _ = chunked_g_products(query, key, factor, launch_g, None, flags["UPCAST"], scaled=False)
        return dq, dk, factor.reshape(()).clone()  # (not a view of the scale: callers save it for autograd)
    dq, dk, dscale = chunked_g_products(query, key, factor, launch_g, out_dtype, flags["UPCAST"], dq_add=dq_add)
    return dq, dk, (dscale / gs if gs is not None else dscale)


def chunk_blocks(b: int, m: int, c: int, out_dtype: Optional[torch.dtype], g_dtype: torch.dtype,
                 device: torch.device, *, accumulate: bool = False) -> Tuple[int, int]:
    """The ``(rows, cols)`` of the block of ``G`` written at once by ``chunked_g_products``
    (``accumulate``: the caller owns the accumulators, and the block of ``G`` is the whole scratch:
    at most ``MIN_CHUNK_COLS`` columns, 64 MiB with the default constants)."""
    align = 256 if device.type == "cuda" else 32  # every forward/backward tile edge divides it
    chunk_rows, chunk_cols, chunks_given = _chunks(align)
    if g_dtype == torch.float32:
        chunk_rows = min(chunk_rows, triton.cdiv(CHUNK_ROWS_FP32, align) * align)
    if accumulate and not chunks_given:
        chunk_cols = min(chunk_cols, triton.cdiv(MIN_CHUNK_COLS, align) * align)
    chunk_rows, chunk_cols = min(b, chunk_rows), min(m, chunk_cols)
    if out_dtype is not None and not chunks_given:
        chunk_rows, chunk_cols = _fit_budget(b, m, c, chunk_rows, chunk_cols, g_dtype, align)
    return chunk_rows, chunk_cols


def chunked_g_products(
    query: torch.Tensor,
    key: torch.Tensor,
    factor: torch.Tensor,
    launch_g,
    out_dtype: Optional[torch.dtype],
    upcast: bool,
    *,
    with_dscale: bool = True,
    accumulate: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    dq_add: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    scaled: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The backward's products over bounded blocks of ``G`` (shared by the InfoNCE and SigLIP ops).

    ``launch_g(g, i0, j0, rows, cols, block)`` writes the block ``[i0, i0 + rows) x [j0, j0 + cols)``
    of ``G`` into ``g [rows, cols]`` (``block`` counts the blocks from 0). Returns
    ``(factor * G @ key, factor * G^T @ query, sum_ij G_ij q_i.k_j)``: the feature gradients in
    float32, or ``out_dtype`` when given (then the smaller side keeps a whole float32 accumulator
    and the other side one of a chunk, written out when its chunk is done), and the scale-gradient
    sum before ``factor`` (``None`` without ``with_dscale``). Scratch: one block of ``G`` and that chunk accumulator.

    ``accumulate=(dq_acc [b, c], dk_acc [m, c])`` (float32; needs ``out_dtype=None`` and
    ``with_dscale=False``): ``G @ key`` and ``G^T @ query`` are *added* into the caller's
    accumulators, without ``factor`` (the caller scales once when its sums are complete), and
    returned; the scratch is one block of ``G`` (see ``chunk_blocks``).

    ``dq_add=(out, add, weight, add_factor)`` (needs ``out_dtype=None``): ``dq`` comes back in
    ``out`` as ``factor * (G @ key) + weight * add_factor * add`` and the scale gradient covers
    ``add`` too, from the same pass (``lse_backward_triton``). ``scaled=False`` (needs
    ``out_dtype=None``): the float32 sums before their scaling pass, and ``None`` for ``dscale``.
    """
    b, c = query.shape
    m = key.shape[0]
    device = query.device
    f32 = torch.float32
    res_dtype = out_dtype or f32
    if accumulate is not None and (out_dtype is not None or with_dscale):
        raise ValueError("chunked_g_products: accumulate= needs out_dtype=None and with_dscale=False")
    if (dq_add is not None or not scaled) and (out_dtype is not None or accumulate is not None):
        raise ValueError("chunked_g_products: dq_add= and scaled=False need out_dtype=None and no accumulate=")
    # G in the operands' dtype so the products run on the tensor cores; fp32 for bf16 under the
    # interpreter, whose bf16 dot is wrong.
    g_dtype = f32 if upcast else query.dtype
    chunk_rows, chunk_cols = chunk_blocks(b, m, c, out_dtype, g_dtype, device,
                                          accumulate=accumulate is not None)
    g_buf = torch.empty(chunk_rows * chunk_cols, device=device, dtype=g_dtype)
    # Loop order: the outer side is the one whose accumulator is chunked (with out_dtype).
    rows_outer = out_dtype is None or m <= b
    full_q = out_dtype is None or not rows_outer
    full_k = out_dtype is None or rows_outer
    fresh = accumulate is None  # the first product into a slice overwrites it
    if accumulate is not None:
        dq, dk = accumulate
    else:
        dq = torch.empty((b, c), device=device, dtype=f32 if full_q else out_dtype)
        dk = torch.empty((m, c), device=device, dtype=f32 if full_k else out_dtype)
    n_outer, n_inner = (b, m) if rows_outer else (m, b)
    step_outer, step_inner = (chunk_rows, chunk_cols) if rows_outer else (chunk_cols, chunk_rows)
    part = None if out_dtype is None else torch.empty((step_outer, c), device=device, dtype=f32)
    # dscale = sum_ij G_ij q_i.k_j = sum_i q_i . (G k)_i = sum_j k_j . (G^T q)_j: shares of
    # block_r rows of the float32 accumulator before it is scaled, on the side whose rows are
    # complete first (the chunked side; dq when both are whole), summed once at the end.
    block_r = 32
    ds_parts = torch.empty((triton.cdiv(max(b, m), block_r),), device=device, dtype=f32)
    block = 0
    for o0 in range(0, n_outer, step_outer):
        on = min(step_outer, n_outer - o0)
        acc = part[:on] if part is not None else None
        for x0 in range(0, n_inner, step_inner):
            xn = min(step_inner, n_inner - x0)
            i0, rows, j0, cols = (o0, on, x0, xn) if rows_outer else (x0, xn, o0, on)
            g = g_buf[: rows * cols].view(rows, cols)
            with _on_device(query):
                launch_g(g, i0, j0, rows, cols, block)
            block += 1
            q_op, k_op = query[i0:i0 + rows], key[j0:j0 + cols]
            if upcast:
                q_op, k_op = q_op.float(), k_op.float()
            # The first product into a slice overwrites it (beta = 0): no zero fills.
            if full_q:
                _addmm_f32(dq[i0:i0 + rows], g, k_op, first=fresh and j0 == 0)
            else:
                _addmm_f32(acc, g, k_op, first=(x0 == 0))
            if full_k:
                _addmm_f32(dk[j0:j0 + cols], g.t(), q_op, first=fresh and i0 == 0)
            else:
                _addmm_f32(acc, g.t(), q_op, first=(x0 == 0))
        if part is not None:
            out, own = (dq, query) if rows_outer else (dk, key)
            _scale_out(acc, factor, out[o0:o0 + on], own[o0:o0 + on] if with_dscale else None, ds_parts,
                       o0 // block_r, block_r)
    if accumulate is not None or not scaled:
        return dq, dk, None
    # The whole accumulators: scaled into res_dtype (in place for float32); with both whole, the
    # scale gradient comes from dq.
    if full_q:
        own = query if (out_dtype is None and with_dscale) else None
        if dq_add is None:
            dq = _scale_out_whole(dq, factor, res_dtype, block_r, own, ds_parts)
        else:  # the other block's sums join before the scale: weight * add_factor / factor
            out, add, weight, add_factor = dq_add
            _scale_out(dq, factor, out, own, ds_parts, 0, block_r, add, (weight * add_factor / factor).float())
            dq = out
    if full_k:
        dk = _scale_out_whole(dk, factor, res_dtype, block_r)
    if not with_dscale:
        return dq, dk, None
    dscale = ds_parts[: triton.cdiv(b if (out_dtype is None or rows_outer) else m, block_r)].sum()
    return dq, dk, dscale


def _scale_out_whole(acc, factor, dtype, block_r, own=None, ds_parts=None) -> torch.Tensor:
    """``(acc * factor).to(dtype)`` in one launch (in place when ``dtype`` is float32), with the
    scale-gradient shares of ``own`` as in ``_scale_out``."""
    out = acc if dtype == acc.dtype else torch.empty(acc.shape, device=acc.device, dtype=dtype)
    _scale_out(acc, factor, out, own, ds_parts, 0, block_r)
    return out
