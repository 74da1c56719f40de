"""Compile the LSE kernels for Hopper on a machine without a GPU and summarize their SASS.

    python -m ds_infcl.bench.triton_sass                       # the default tiles, bf16, c % 64 == 0
    python -m ds_infcl.bench.triton_sass --kernels fwd --configs 128,128,64,8,3 256,128,32,8,4
    python -m ds_infcl.bench.triton_sass --all-variants   # every flag combination; exit 1 on a failure

Triton compiles ahead of time for any target (``GPUTarget("cuda", 90, 32)``) with the ``ptxas``
and ``nvdisasm`` of its wheel, so registers, spills (local-memory bytes), shared memory and an
instruction histogram of each kernel come out on the CPU machine, before any device time is
spent. The integer arguments are declared divisible by 16, as the JIT specializes them at
b = 65,536, c = 512 (without that the loads are not pipelined and the numbers mean nothing).
Configs are "BM,BN,BK,warps,stages[,maxnreg]" as in ``DS_INFCL_TRITON_FWD`` / ``_BWD``.
The compiler here is the one installed (CI's), which may allocate registers differently from
the GPU image's (``ds_infcl.bench.triton_tune`` reports what that one did). ``--all-variants``
is also a test (``tests/ops/test_triton_compile.py``): the CPU interpreter runs code that the
compiler rejects (a value whose type differs between the branches of an ``if``, for one), and
this catches it without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

DIV16 = {"b", "m", "c", "stride_q", "stride_k", "num_qblocks", "num_kblocks", "rows", "cols", "i0", "j0"}
FLOAT_PTRS = {"row_part_ptr", "row_max_ptr", "row_sum_ptr", "col_max_ptr", "col_sum_ptr", "scale_ptr", "r_ptr",
              "a_ptr", "cl_ptr", "w_ptr", "p_ptr", "rng_ptr", "v_ptr"}
DEFAULTS = {"fwd": ["128,128,64,8,3"], "fwd_rows": ["128,128,64,8,3"], "fwd_redo": ["128,128,64,8,3"],
            "bwd": ["128,256,64,8,3"],
            "bwd_gluon": ["128,128,32,4,2"], "fwd_gluon": ["128,128,64,3,1"]}


def _kernel(name):
    from ds_infcl.ops import triton_lse_kernels as K

    return {"fwd": K._lse_fwd_kernel, "fwd_rows": K._lse_fwd_rows_kernel, "fwd_redo": K._lse_fwd_cols_redo_kernel,
            "bwd": K._lse_bwd_g_kernel}[name]


# The flag combinations the launchers use, beyond the default (one per line of --all-variants):
# excluded positives with and without labels, fp32 operands, and the backward's one-sided calls.
VARIANTS = {
    "fwd": [dict(EXCLUDE=True), dict(EXCLUDE=True, HAS_LABELS=True), dict(dtype="fp32", EVEN_K=False)],
    "fwd_rows": [dict(EXCLUDE=True, HAS_LABELS=True), dict(dtype="fp32")],
    # The Gluon forward's exact second pass (16-bit inputs, as the Gluon forward).
    "fwd_redo": [dict(EXCLUDE=True, HAS_LABELS=True)],
    "bwd": [dict(EXCLUDE=True, HAS_LABELS=True), dict(HAS_COL=False, HAS_POS=False),
            dict(HAS_ROW=False, HAS_POS=False), dict(ONE_EXP=False), dict(dtype="fp16", EVEN_K=False),
            dict(dtype="fp32")],
    # The Gluon backward (bf16/fp16 only): labels with exclusion, one-sided, two exponentials.
    "bwd_gluon": [dict(EXCLUDE=True, HAS_LABELS=True), dict(HAS_COL=False, HAS_POS=False),
                  dict(HAS_ROW=False, HAS_POS=False), dict(ONE_EXP=False), dict(dtype="fp16")],
    "fwd_gluon": [dict(EXCLUDE=True), dict(EXCLUDE=True, HAS_LABELS=True), dict(dtype="fp16")],
}


def compile_for_hopper(name: str, config: str, dtype: str = "bf16", **flags):
    """``triton.compile`` of one LSE kernel for sm_90 (no GPU needed); ``flags`` override the
    constexpr defaults (the common bf16 case: no exclusion, both directions, one exponential)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if name in ("bwd_gluon", "fwd_gluon"):
        return compile_gluon_for_hopper(config, dtype, forward=name == "fwd_gluon", **flags)
    fn = _kernel(name)
    bm, bn, bk, warps, stages, *rest = (int(v) for v in config.split(","))
    if dtype == "fp32":
        bk = min(bk, 32)  # as _pick_config: fp32 operands take twice the shared memory
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, PRECISION=1 if dtype == "fp32" else 0,
                 UPCAST=False, EXACT_MUL=True, EXCLUDE=False, HAS_LABELS=False, FMA_EXP=dtype != "fp32")
    if name == "bwd":
        const.update(HAS_ROW=True, HAS_COL=True, HAS_POS=True, ONE_EXP=True)
    if name == "fwd_redo":
        del const["FMA_EXP"]
    const.update(flags)
    sig = {}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg == "redo_ptr":
            sig[arg] = "*i32"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32" if arg in FLOAT_PTRS else f"*{dtype}"
        else:
            sig[arg] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg.endswith("_ptr") or arg in DIV16}
    opts = dict(num_warps=warps, num_stages=stages)
    if rest and rest[0]:
        opts["maxnreg"] = rest[0]
    return triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def compile_gluon_for_hopper(config: str, dtype: str = "bf16", forward: bool = False, **flags):
    """``triton.compile`` of the Gluon backward (``gluon_lse_kernels._lse_bwd_g_hopper_kernel``)
    or, with ``forward``, the Gluon forward (``gluon_lse_forward._lse_fwd_hopper_kernel``) for sm_90; ``config`` is
    "BM,BN,BK,stages,consumers[,consumer_regs,producer_regs,maxnreg]" as ``DS_INFCL_GLUON_TILES``
    (the forward: "BM,BN,BK,stages,pingpong[,consumer_regs,producer_regs,maxnreg]" as
    ``DS_INFCL_GLUON_FWD_TILES``), ``flags`` the epilogue switches (backward default: both
    directions, the positive term, one exponential; forward: no exclusion)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from ds_infcl.ops import gluon_lse_forward as F
    from ds_infcl.ops import gluon_lse_kernels as G

    (bm, bn, bk, stages, fifth), regs = G.gluon_config(config)
    if forward:
        consumers = 2
        switches, fn = dict(PINGPONG=bool(fifth), **flags), F._lse_fwd_hopper_kernel
    else:
        consumers = fifth
        switches = dict(HAS_ROW=True, HAS_COL=True, HAS_POS=True, ONE_EXP=True)
        switches.update(flags)
        fn = G._lse_bwd_g_hopper_kernel
    gdtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def desc(shape):
        layout = gl.NVMMASharedLayout.get_default_for(shape, gdtype)
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{layout!r}>"

    const = dict(STAGES=stages, FLAGS=G.g_flags(F.FLAG_BITS if forward else G.FLAG_BITS, **switches),
                 CONSUMER_REGS=regs["consumer_regs"], PRODUCER_REGS=regs["producer_regs"])
    if not forward:
        const["NCONS"] = consumers
    sig = {}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg.endswith("_desc") and forward:
            sig[arg] = desc({"q_desc": [bm, bk], "k_desc": [bn, bk]}[arg])
        elif arg.endswith("_desc"):
            sig[arg] = desc({"q_desc": [bm, bk], "k_desc": [bn, bk], "g_desc": [bm, bn]}[arg])
        elif arg.endswith("_ptr"):
            sig[arg] = {"lab_ptr": "*i64", "redo_ptr": "*i32"}.get(arg, "*fp32")
        else:
            sig[arg] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg.endswith("_ptr")}
    opts = dict(num_warps=4)
    if consumers == 2:
        opts["maxnreg"] = regs["maxnreg"]
    return triton.compile(GluonASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


def summarize(compiled) -> str:
    """Registers, local memory (spills), shared memory and the most frequent SASS opcodes."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    hist = collections.Counter(ops).most_common(12)
    return (f"regs {regs.group(1) if regs else '?'}, local (spill) bytes {stack.group(1) if stack else '?'}, "
            f"shared {compiled.metadata.shared} B, {len(ops)} SASS instructions: "
            + ", ".join(f"{op} {n}" for op, n in hist))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["fwd", "fwd_rows", "fwd_redo", "bwd", "bwd_gluon", "fwd_gluon"],
                    choices=sorted(DEFAULTS))
    ap.add_argument("--configs", nargs="+", default=None,
                    help="BM,BN,BK,warps,stages[,maxnreg] (bwd_gluon: BM,BN,BK,stages,consumers[,regs...]; "
                         "default: ours)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--all-variants", action="store_true",
                    help="also compile the other flag combinations the launchers use (exclusion, labels, "
                         "fp16/fp32, one-sided backward); exit 1 if any fails")
    args = ap.parse_args(argv)
    failed = 0
    for name in args.kernels:
        for cfg in args.configs or DEFAULTS[name]:
            if name.endswith("_gluon") and args.dtype == "fp32":
                continue  # the Gluon kernels take 16-bit operands only
            cases = [dict(dtype=args.dtype)] + (VARIANTS[name] if args.all_variants else [])
            for case in cases:
                case = dict(case)
                label = " ".join(f"{k}={v}" for k, v in case.items())
                try:
                    line = summarize(compile_for_hopper(name, cfg, case.pop("dtype", args.dtype), **case))
                except Exception as err:  # a config or variant the compiler rejects
                    failed += 1
                    line = f"failed: {type(err).__name__}: {str(err)[:300]}"
                print(f"{name:8s} {cfg:18s} {label:30s} {line}", flush=True)
    return 1 if failed and args.all_variants else 0


if __name__ == "__main__":
    sys.exit(main())
