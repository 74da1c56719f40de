"""The module handed to ``deepspeed.initialize``: the task's towers plus the loss module.

Every use of a parameter goes through ``forward`` (the DeepSpeed engine's ``__call__``), so ZeRO-3
gathers and releases parameters as usual. ``forward`` is steered by ``mode``:

- ``"loss"``: encode queries and keys, return ``(global loss, query features, key features)``
  (the uncached step); ``loss_kwargs`` (labels and the batch's extra loss inputs) go to the loss.
- ``"encode"``, ``"encode_query"``, ``"encode_key"``: features only (GradCache's first pass;
  evaluation, whose ``"encode_query"`` / ``"encode_key"`` run compiled blocks eagerly).
- ``"logit_scale"``: the current ``logit_scale`` value, detached (for logging).
- ``"loss_params"``: detached copies of the loss module's own parameters (``logit_scale``, and
  ``logit_bias`` for SigLIP), in ``loss_param_names`` order (GradCache computes the loss outside
  the engine on copies of them).
- ``"gradients"``: ``param_grads`` holds one tensor (or ``None``) per trainable parameter, in
  ``parameters()`` order; returns a zero whose backward gives each parameter that gradient (the
  ZeRO-3 GradCache step, ``ds_infcl.train.zero3_gather``, hands its summed chunk gradients to the
  engine this way, under gathered parameters).
- ``"surrogate"``: re-encode one chunk and return
  ``(sum(q * dL/dq) + sum(k * dL/dk) + sum_p p * dL/dp, q, k)`` over the loss parameters ``p``: the
  gradient of the first with respect to every parameter is that chunk's share of the exact
  gradient (GradCache's second pass); the detached features let the caller verify the RNG replay.
- ``"kept_surrogate"``: the same surrogate for a chunk whose features ``query_inputs`` and
  ``key_inputs`` still carry the autograd graph of their first forward (``grad_cache: "auto"``'s
  kept chunks, ``ds_infcl.train.keep_chunks``): nothing is re-encoded; its backward runs through
  that graph. Returns the surrogate alone.

``Encoder`` (what ``Task.evaluate`` gets) calls the evaluation modes through the engine.

The loss parameters belong to the loss submodule; ``"loss_params"`` and ``"surrogate"`` read them
from this module's own forward, so they are registered as external parameters and ZeRO-3 gathers
them there too. A 0-dim parameter is re-registered with shape ``[1]`` (DeepSpeed cannot broadcast
0-dim parameters); the loss module's maths is unchanged.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ds_infcl.tasks.base import tree_map

__all__ = ["ContrastiveModel", "Encoder", "loss_with_params", "loss_param_names", "find_blocks", "compile_blocks",
           "compile_encoders", "compile_towers", "check_compile_stage", "eager_blocks"]

MODES = ("loss", "encode", "encode_query", "encode_key", "logit_scale", "loss_params", "surrogate", "kept_surrogate",
         "gradients")


def loss_param_names(loss_module: nn.Module) -> Tuple[str, ...]:
    """Names of the loss module's own learnable parameters (``logit_scale``, SigLIP's
    ``logit_bias``), in registration order."""
    return tuple(name for name, _ in loss_module.named_parameters(recurse=False))


def loss_with_params(loss_module: nn.Module, params: Optional[Dict[str, torch.Tensor]], query, key, **loss_kwargs):
    """``loss_module(query, key, **loss_kwargs)`` with ``params`` (name -> a fresh
    ``nn.Parameter`` leaf; ``None`` keeps the module's own) in place of the module's parameters.

    The module's ``forward`` is called directly, not through ``__call__``: no hooks run, so under
    ZeRO-3 the swapped-in leaves are never taken for partitioned parameters. The swap is undone on
    exit.
    """
    forward = type(loss_module).forward
    if not params:
        return forward(loss_module, query, key, **loss_kwargs)
    registered = loss_module._parameters
    original = {name: registered[name] for name in params}
    registered.update(params)
    try:
        return forward(loss_module, query, key, **loss_kwargs)
    finally:
        registered.update(original)


def find_blocks(towers: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of the repeated blocks of ``towers``: every child of an ``nn.ModuleList``
    (HF ``encoder.layers`` / ``encoder.layer``, ``blocks``, ``resblocks`` ...), outermost lists
    only (a block's own inner lists stay inside the compiled block), in module order."""
    out: List[Tuple[str, nn.Module]] = []
    taken: List[str] = []
    for name, module in towers.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        out.extend((f"{name}.{i}", child) for i, child in enumerate(module))
    return out


def compile_blocks(towers: nn.Module, *, mode: str = "default") -> List[str]:
    """Compile each block of ``find_blocks(towers)`` in place (``module.compile``: the module's
    ``__call__`` goes through ``torch.compile(dynamic=False)``; parameters, their names and the
    ``state_dict`` keys are unchanged, so checkpoints load either way). Compilation happens at a
    block's first call for each new input shape: GradCache's chunks all have one shape, and the
    towers' blocks share their code, so the usual recompile limit of 8 (shared by every compiled
    block) is raised to 64 for the few shapes a run sees (pass 1 without gradients, pass 3 with,
    evaluation batches).

    Returns:
        the names of the compiled blocks (empty when the towers have no ``nn.ModuleList``).
    """
    blocks = find_blocks(towers)
    for _, block in blocks:
        block.compile(dynamic=False, mode=None if mode == "default" else mode)
    if blocks:
        _raise_recompile_limit()
    return [name for name, _ in blocks]


_ENCODERS = ("encode_query", "encode_key")
_COMPILED_MARK = "_ds_infcl_compiled_encoders"


def compile_encoders(towers: nn.Module, *, mode: str = "default") -> List[str]:
    """Compile the towers' ``encode_query`` and ``encode_key`` whole: each bound method is replaced,
    on this instance only, by ``torch.compile(method, dynamic=False)``. Each tower is then one graph
    forward and one backward (embeddings, blocks, pooling and projection fused where inductor can),
    instead of one per block plus the eager parts between them. On ViT-B/16 this was no faster than
    ``compile_blocks`` (docs/bench/compile_towers_h100_2026-12-07_twentieth.md); it is meant for
    towers whose eager parts between the blocks are heavier. Parameters, their names and the ``state_dict``
    keys are unchanged. Code dynamo cannot trace (a host read, a generator) splits the graph there
    and runs eagerly, with the same results.

    Returns:
        the names of the compiled methods (empty when they were compiled before).
    """
    if getattr(towers, _COMPILED_MARK, False):
        return []
    for name in _ENCODERS:
        setattr(towers, name, torch.compile(getattr(towers, name), dynamic=False,
                                            mode=None if mode == "default" else mode))
    setattr(towers, _COMPILED_MARK, True)
    _raise_recompile_limit()
    return list(_ENCODERS)


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, key, max(getattr(config, key), 64))


def check_compile_stage(zero_stage: int) -> None:
    """``ConfigError`` for ``model.compile`` with ZeRO stage 3 (checked at load by
    ``preflight.check_compile`` and again when the towers are compiled)."""
    from ds_infcl.errors import ConfigError

    if zero_stage >= 3:
        raise ConfigError(
            "model.compile: not supported with ZeRO stage 3 (its hooks gather each module's parameters "
            "inside the blocks that would be compiled); use ZeRO stage 0-2, or set model.compile false"
        )


def compile_towers(towers: nn.Module, model_config, zero_stage: int, log: Callable[[str], None] = print,
                   micro_batch_size: Optional[int] = None) -> nn.Module:
    """Apply the run config's ``model`` section (``fp8``, ``compile``, ``compile_mode``) to the
    task's towers before ``deepspeed.initialize``; returns ``towers`` (converted and compiled in
    place) and logs what it did. ``compile``: ``"blocks"`` (or ``True``) compiles each repeated
    block (``compile_blocks``), ``"towers"`` the two encode methods whole (``compile_encoders``).

    ``fp8`` first swaps the blocks' linear layers for torchao's float8 ones
    (``ds_infcl.train.fp8.convert_to_fp8``; ``micro_batch_size``, the rows of one micro-batch,
    tells it whether the matmuls need padding), so that the compiled blocks trace the float8 casts
    and fuse them into their neighbours.

    Dropout in compiled blocks draws its masks from seeds taken from torch's default generator at
    each call, so GradCache's RNG replay (restore the state, re-encode) reproduces pass 1's masks
    (tests/train/test_compile.py checks it); the masks differ from eager mode's, as with any
    compiled dropout.

    Raises:
        ConfigError: compile with ZeRO stage 3 (its per-module parameter gathering hooks would run
            inside the compiled blocks), with Liger-Kernel's patches (``apply_liger``: they crashed
            inside compiled blocks), or towers without repeated blocks to compile; fp8 with
            ZeRO stage 3, without torchao, or without a layer to convert.
    """
    from ds_infcl.errors import ConfigError

    if getattr(model_config, "fp8", False):
        from ds_infcl.train.fp8 import check_fp8_stage, convert_to_fp8

        check_fp8_stage(zero_stage)
        convert_to_fp8(towers, find_blocks(towers), model_config, micro_batch_size, log)
    setting = model_config.compile
    if setting is False:
        return towers
    check_compile_stage(zero_stage)
    from ds_infcl.adapters.decoder_step import LIGER_MARK, LIGER_WITH_COMPILE

    if any(getattr(m, LIGER_MARK, None) for m in towers.modules()):
        raise ConfigError(LIGER_WITH_COMPILE)
    if setting == "towers":
        compile_encoders(towers, mode=model_config.compile_mode)
        log(f"model.compile: towers compiled whole (torch.compile dynamic=False, mode {model_config.compile_mode!r}): "
            f"{type(towers).__name__}.encode_query, .encode_key; the first step includes the compilation")
        return towers
    names = compile_blocks(towers, mode=model_config.compile_mode)
    if not names:
        raise ConfigError(
            f"model.compile: the towers ({type(towers).__name__}) have no nn.ModuleList of blocks to compile; "
            "set model.compile false"
        )
    log(f"model.compile: {len(names)} blocks compiled (torch.compile dynamic=False, mode "
        f"{model_config.compile_mode!r}): {names[0]} .. {names[-1]}; the first step includes the compilation")
    return towers


def eager_blocks():
    """Compiled blocks run eagerly inside this context (``torch.compiler.set_stance``): evaluation
    batches come in other shapes than the training chunks, and compiling each (tens of seconds on
    a GPU, counted against the recompile limit) would cost more than it saves. Also needed around
    any call under a ``TorchDispatchMode`` (the trainer's FLOP count): dynamo cannot trace under
    such a mode and marks the blocks' code as skipped for good, so every later chunk would run
    eagerly (measured on an H100 before this was found: the compiled run was as slow as eager)."""
    return torch.compiler.set_stance("force_eager")


class ContrastiveModel(nn.Module):
    """Towers (``encode_query`` / ``encode_key``) plus the loss module that owns the scale.

    Args:
        towers: module with ``encode_query(inputs)`` and ``encode_key(inputs)``.
        loss: the loss module (``ContrastiveLoss`` or one with its contract, see
            ``Task.build_loss``); its ``group`` is set to the engine's data-parallel group after
            ``deepspeed.initialize``.
    """

    def __init__(self, towers: nn.Module, loss: nn.Module):
        super().__init__()
        for name in ("encode_query", "encode_key"):
            if not callable(getattr(towers, name, None)):
                raise TypeError(f"the task's towers must have a method {name}(inputs)")
        self.towers = towers
        self.loss = loss
        self.loss_param_names = loss_param_names(loss)
        for name in self.loss_param_names:
            param = getattr(loss, name)
            if param.dim() == 0:
                # DeepSpeed 0.19.8 broadcasts parameters as p.data.view(torch.uint8), which fails on
                # a 0-dim tensor ("self.dim() cannot be 0 to view Float as Byte"): hold it as [1].
                param = nn.Parameter(param.detach().reshape(1).clone())
                setattr(loss, name, param)
            import deepspeed

            deepspeed.zero.register_external_parameter(self, param)

    @property
    def learnable_scale(self) -> bool:
        return isinstance(self.loss.logit_scale, nn.Parameter)

    def _input_dtype(self) -> torch.dtype:
        for p in self.towers.parameters():
            if p.dtype.is_floating_point:
                return p.dtype
        return torch.float32

    def _cast(self, inputs):
        dtype = self._input_dtype()
        return tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)

    def encode_query(self, inputs):
        return self.towers.encode_query(self._cast(inputs))

    def encode_key(self, inputs):
        return self.towers.encode_key(self._cast(inputs))

    def forward(
        self,
        mode: str,
        query_inputs=None,
        key_inputs=None,
        loss_kwargs: Optional[dict] = None,
        query_grad: Optional[torch.Tensor] = None,
        key_grad: Optional[torch.Tensor] = None,
        param_grads: Optional[Sequence[torch.Tensor]] = None,
    ):
        if mode == "loss":
            q = self.encode_query(query_inputs)
            k = self.encode_key(key_inputs)
            return self.loss(q, k, **(loss_kwargs or {})), q.detach(), k.detach()
        if mode == "encode":
            return self.encode_query(query_inputs), self.encode_key(key_inputs)
        if mode in ("encode_query", "encode_key"):  # evaluation: eager, see eager_blocks
            with eager_blocks():
                return self.encode_query(query_inputs) if mode == "encode_query" else self.encode_key(key_inputs)
        if mode == "logit_scale":
            return self.loss.logit_scale.detach().clone()
        if mode == "loss_params":
            return tuple(getattr(self.loss, name).detach().clone() for name in self.loss_param_names)
        if mode == "surrogate":
            q = self.encode_query(query_inputs)
            k = self.encode_key(key_inputs)
            return self._surrogate(q, k, query_grad, key_grad, param_grads), q.detach(), k.detach()
        if mode == "kept_surrogate":
            return self._surrogate(query_inputs, key_inputs, query_grad, key_grad, param_grads)
        if mode == "gradients":
            params = [p for p in self.parameters() if p.requires_grad]
            if len(param_grads) != len(params):
                raise ValueError(f"gradients: {len(param_grads)} gradients for {len(params)} trainable parameters")
            pairs = [(p, g) for p, g in zip(params, param_grads) if g is not None]
            if not pairs:
                raise ValueError("gradients: no gradient given")
            return _GivenGradients.apply([g for _, g in pairs], *[p for p, _ in pairs])
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")

    def _surrogate(self, q, k, query_grad, key_grad, param_grads):
        """``sum(q * dL/dq) + sum(k * dL/dk) + sum_p p * dL/dp`` over the loss parameters ``p``
        (float32 products: the cached gradients are float32)."""
        out = (q.float() * query_grad).sum() + (k.float() * key_grad).sum()
        for name, grad in zip(self.loss_param_names, param_grads or ()):
            out = out + (getattr(self.loss, name).float() * grad).sum()
        return out


class _GivenGradients(torch.autograd.Function):
    """A zero whose backward gives ``params[i]`` the gradient ``grad_out * grads[i]`` (cast to the
    parameter's dtype): a micro-step that hands gradients computed elsewhere to the engine."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads, ctx.dtypes = grads, [p.dtype for p in params]
        return params[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        out = tuple((g * grad_out).to(dt) for g, dt in zip(ctx.grads, ctx.dtypes))
        ctx.grads = None
        return (None, *out)


class Encoder:
    """What ``Task.evaluate`` gets: the trained towers without gradients (all ranks call it)."""

    def __init__(self, engine, device: torch.device):
        self._engine = engine
        self.device = device

    def _run(self, mode: str, inputs):
        inputs = tree_map(lambda t: t.to(self.device), inputs)
        with torch.no_grad():
            if mode == "encode_query":
                return self._engine("encode_query", inputs)
            return self._engine("encode_key", None, inputs)

    def encode_query(self, inputs) -> torch.Tensor:
        return self._run("encode_query", inputs)

    def encode_key(self, inputs) -> torch.Tensor:
        return self._run("encode_key", inputs)
