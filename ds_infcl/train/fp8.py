"""``model.fp8``: the towers' linear layers in float8 through torchao's float8 training.

``torchao.float8.convert_to_float8_training`` swaps chosen ``nn.Linear`` modules for its
``Float8Linear``: the weights stay in the towers' dtype (bf16 under DeepSpeed's bf16, float32 master
weights in the optimizer as before), and each forward casts input and weight to float8 with a
scale computed from their current absolute maximum (dynamic scaling), multiplies them with
``torch._scaled_mm`` on the GPU's float8 tensor cores, and does the same for the two matmuls of the
backward. ``fp8_recipe`` picks torchao's recipe: ``"tensorwise"`` (one scale per tensor, cuBLAS)
or ``"rowwise"`` (one scale per row, CUTLASS; more accurate, slower per matmul).

Which layers (``fp8_layer_names``):

- only ``nn.Linear`` modules inside the towers' repeated blocks (``model.find_blocks``: the transformer
  layers). The patch embedding, the poolers and the final projections to the embedding (CLIP's
  ``visual_projection`` / ``text_projection``, OpenCLIP's ``proj``) stay in the towers' dtype, as
  torchao advises for a model's output layer: their error goes straight into the features;
- both weight dimensions multiples of 16 (``torch._scaled_mm`` needs it);
- trainable (a frozen, locked tower keeps its loaded weights' precision);
- not the ``out_proj`` of an ``nn.MultiheadAttention`` (OpenCLIP's blocks): that module reads
  ``out_proj.weight`` itself and never calls ``out_proj``, so a swap would change nothing;
- ``fp8_layers: "auto"`` keeps only the shapes that gained in torchao's H100 measurements for the
  recipe (tensorwise: not both ``in <= 4096`` and ``out <= 1024``; rowwise: ``out > 2048``,
  ``in > 1024``, and not both ``out <= 4096`` and ``in <= 2048``; the thresholds of torchao's
  ``_auto_filter_for_recipe``). At ViT-B/16 widths that leaves little (see docs/training.md);
  ``"blocks"`` (the default) takes every layer the rules above allow.

The backward's weight gradient contracts over the tokens of the micro-batch, which
``torch._scaled_mm`` also needs to be a multiple of 16: with a micro-batch (GradCache chunk) whose
rows are not a multiple of 16, torchao pads that dimension with zeros (``pad_inner_dim``, a copy
per matmul), and the log says so.

Requirements (``check_fp8``, at load): torchao installed (the ``gpu`` extra), a CUDA GPU of compute
capability 8.9 or newer (Ada, Hopper, Blackwell), ``model.compile`` on (torchao's casts are
elementwise kernels of their own in eager mode, where float8 is slower than bf16; compiled, they
fuse into the neighbouring kernels), and so not ZeRO stage 3.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ds_infcl.errors import ConfigError

__all__ = ["FP8_RECIPES", "FP8_LAYERS", "FP8_MIN_CAPABILITY", "validate_fp8_config", "fp8_layer_names", "convert_to_fp8",
           "check_fp8", "check_fp8_stage"]

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_LAYERS = ("blocks", "auto")
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
_INSTALL = "pip install \"ds_infcl[gpu]\" (torchao)"


def validate_fp8_config(model_config) -> None:
    """The run config's ``model.fp8*`` keys (``ds_infcl.train.config``): ``fp8`` needs ``compile``;
    ``fp8_recipe`` and ``fp8_layers`` take their allowed values, and only with ``fp8``."""
    for key, allowed in (("fp8_recipe", FP8_RECIPES), ("fp8_layers", FP8_LAYERS)):
        value = getattr(model_config, key)
        if value not in allowed:
            raise ConfigError(f"model.{key}: {value!r} is not allowed; choose one of {list(allowed)}")
        if not model_config.fp8 and value != allowed[0]:
            raise ConfigError(f"model.{key}: only used with model.fp8 true; set model.fp8 true or remove it")
    if model_config.fp8 and model_config.compile is False:
        raise ConfigError(
            "model.fp8: needs model.compile \"blocks\": without it torchao's float8 casts run as kernels of their "
            "own and a float8 step is slower than bf16; set model.compile \"blocks\" or model.fp8 false")


def _gains_in_torchao_tables(weight_shape, recipe: str) -> bool:
    """Whether a linear of ``weight_shape`` (``[out, in]``) is among the shapes that ran faster in
    float8 than in bf16 in torchao's H100 tables for ``recipe`` (their thresholds)."""
    out_dim, in_dim = weight_shape
    if recipe == "tensorwise":
        return not (in_dim <= 4096 and out_dim <= 1024)
    return out_dim > 2048 and in_dim > 1024 and not (out_dim <= 4096 and in_dim <= 2048)


def fp8_layer_names(blocks: Sequence[Tuple[str, nn.Module]], layers: str = "blocks",
                    recipe: str = "tensorwise") -> List[str]:
    """Qualified names (in the towers' ``named_modules()``) of the linear layers ``model.fp8``
    converts, from the towers' repeated ``blocks`` (``ds_infcl.train.model.find_blocks``: ``(name,
    block)``); the rules are in the module docstring. Needs no torchao (and works on meta tensors)."""
    if layers not in FP8_LAYERS:
        raise ConfigError(f"model.fp8_layers: {layers!r} is not allowed; choose one of {list(FP8_LAYERS)}")
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"model.fp8_recipe: {recipe!r} is not allowed; choose one of {list(FP8_RECIPES)}")
    names = []
    for block_name, block in blocks:
        skipped = {id(m.out_proj) for m in block.modules() if isinstance(m, nn.MultiheadAttention)}
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear) or id(module) in skipped:
                continue
            shape = tuple(module.weight.shape)
            if shape[0] % 16 or shape[1] % 16 or not module.weight.requires_grad:
                continue
            if layers == "auto" and not _gains_in_torchao_tables(shape, recipe):
                continue
            names.append(f"{block_name}.{name}" if name else block_name)
    return names


def _import_float8():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(f"model.fp8: needs torchao ({_INSTALL}); import failed: {e}") from None
    return float8


def convert_to_fp8(towers: nn.Module, blocks: Sequence[Tuple[str, nn.Module]], model_config,
                   micro_batch_size: Optional[int] = None, log: Callable[[str], None] = print, *,
                   emulate: bool = False) -> List[str]:
    """Swap the layers ``fp8_layer_names(blocks, ...)`` chooses (``blocks``: the towers'
    ``find_blocks``) for torchao's ``Float8Linear``, in place: the parameters keep their names, so
    checkpoints load either way. Returns the layers' names and logs how many.

    Args:
        micro_batch_size: the rows of one micro-batch (GradCache chunk); not a multiple of 16
            turns on torchao's ``pad_inner_dim``.
        emulate: torchao's float8 emulation in float32 (CPU tests; no speed-up).

    Raises:
        ConfigError: no layer of the towers qualifies, or torchao missing.
    """
    import dataclasses

    names = fp8_layer_names(blocks, model_config.fp8_layers, model_config.fp8_recipe)
    if not names:
        auto = model_config.fp8_layers == "auto"
        shape, fix = (", of a shape torchao gains at", 'try model.fp8_layers "blocks", or ') if auto else ("", "")
        raise ConfigError(
            f"model.fp8: no linear layer of the towers ({type(towers).__name__}) qualifies (inside the repeated "
            f"blocks, trainable, both dimensions multiples of 16{shape}); {fix}set model.fp8 false")
    float8 = _import_float8()
    pad = micro_batch_size is not None and micro_batch_size % 16 != 0
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(model_config.fp8_recipe),
                                 pad_inner_dim=pad, emulate=emulate)
    chosen = set(names)
    float8.convert_to_float8_training(towers, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    converted = [n for n, m in towers.named_modules() if type(m).__name__ == "Float8Linear"]
    if converted != names:  # a torchao whose traversal or filter contract changed
        raise RuntimeError(f"model.fp8: torchao converted {len(converted)} layers, {len(names)} were chosen")
    total = sum(isinstance(m, nn.Linear) for m in towers.modules())
    log(f"model.fp8: {len(names)} of {total} linear layers in float8 ({model_config.fp8_recipe} scaling, "
        f"fp8_layers {model_config.fp8_layers!r}): {names[0]} .. {names[-1]}")
    if pad:
        log(f"model.fp8: the micro-batch's {micro_batch_size} rows are not a multiple of 16: each float8 matmul pads "
            "its inner dimension with zeros (a copy); a chunk size that is a multiple of 16 avoids it")
    return names


def check_fp8_stage(zero_stage: int) -> None:
    """``ConfigError`` for ``model.fp8`` with ZeRO stage 3."""
    if zero_stage >= 3:
        raise ConfigError("model.fp8: not supported with ZeRO stage 3 (float8 needs model.compile, which ZeRO-3 "
                          "excludes, and torchao's float8 layers are untested under ZeRO-3's partitioned "
                          "parameters); use ZeRO stage 0-2, or set model.fp8 false")


def check_fp8(model_config, zero_stage: int, device_type: str) -> None:
    """``model.fp8`` against this machine and run (before anything is built).

    Raises:
        ConfigError: ZeRO stage 3, torchao missing, no CUDA device, or a GPU without float8
            tensor cores (named, with its compute capability).
    """
    if not model_config.fp8:
        return
    check_fp8_stage(zero_stage)
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"model.fp8: needs torchao, which is not installed: {_INSTALL}; or set model.fp8 false")
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"model.fp8: float8 matmuls need a CUDA GPU of compute capability "
                          f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (H100, H200, L4, RTX 4090, "
                          f"B200); this run is on {device_type}. Set model.fp8 false")
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ConfigError(f"model.fp8: {torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]}) "
                          f"has no float8 tensor cores; they need {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or "
                          "newer (H100, H200, L4, RTX 4090, B200). Set model.fp8 false")
    _import_float8()
