"""What an ``--impls`` entry of ``ds_infcl.bench.engine`` means: ``LOSS[+option ...]``, each option
a set of run-config overrides (``IMPL_OPTIONS``; ``chunkN`` sets that case's GradCache chunk), and
the row's label."""

from __future__ import annotations

from typing import Dict, List

__all__ = ["IMPL_OPTIONS", "parse_impl", "impl_label"]


# ``+option`` of an impl: run-config overrides (the decoder ones are bench_decoder's task arguments)
IMPL_OPTIONS = {"compile": "model.compile=blocks", "towers": "model.compile=towers", "auto": "batch.chunk_size=auto", "gcauto": "batch.grad_cache=auto",
                "liger": "task.args.liger=true", "packing": "task.args.packing=true",
                "nockpt": "task.args.gradient_checkpointing=false",
                "ckptauto": "task.args.gradient_checkpointing=auto",
                "lora": 'task.args.lora={"r": 16, "alpha": 32}',
                "fp8": "model.fp8=true", "fp8row": ("model.fp8=true", "model.fp8_recipe=rowwise"),
                "fp8auto": ("model.fp8=true", "model.fp8_layers=auto")}


def parse_impl(spec: str):
    """``"infcl+compile+auto"`` -> ``("infcl", ["model.compile=blocks", "batch.chunk_size=auto"])``;
    ``chunkN`` sets the GradCache chunk of that case to ``N`` (``infcl+nockpt+chunk16``)."""
    loss, *options = spec.split("+")
    unknown = [o for o in options if o not in IMPL_OPTIONS and not (o.startswith("chunk") and o[5:].isdigit())]
    if not loss or unknown:
        raise ValueError(f"--impls {spec!r}: expected LOSS[+option ...] with options {sorted(IMPL_OPTIONS)} "
                         "or chunkN")
    out: List[str] = []
    for o in options:
        value = IMPL_OPTIONS[o] if o in IMPL_OPTIONS else f"batch.chunk_size={int(o[5:])}"
        out.extend(v for v in ((value,) if isinstance(value, str) else value) if v not in out)
    return loss, out


def impl_label(impl: str, run: Dict) -> str:
    """The row's name of ``impl``: the spec, plus ``+gcauto`` when ``--set`` made the case's
    ``batch.grad_cache`` "auto" (or ``+plain`` when it turned GradCache off)."""
    grad_cache = run["batch"].get("grad_cache")
    if grad_cache == "auto" and "gcauto" not in impl.split("+"):
        return impl + "+gcauto"
    return impl + "+plain" if grad_cache is False else impl
