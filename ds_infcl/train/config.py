"""The run config: every setting of a training run that is not DeepSpeed's.

A run is described by two JSON files: the DeepSpeed config (ZeRO stage, precision, optimizer,
scheduler; see ``ds_configs/``) and this run config (task, loss, batch and GradCache chunking,
data, evaluation, logging, checkpoints). ``load_run_config`` validates the run config at start:
an unknown key, a wrong type or a value outside its allowed set raises ``ConfigError`` naming the
key (``batch.chunk_size``) and what is allowed (``ds_infcl.train.ds_config`` cross-checks the
DeepSpeed JSON). Example run config (every section is optional except ``batch.global_batch_size`` and
``train.num_steps``; see docs/training.md for all keys)::

    {
      "task": {"name": "synthetic", "args": {"input_dim": 32}},
      "loss": {"impl": "infcl"},
      "batch": {"global_batch_size": 256, "grad_cache": true, "chunk_size": 32},
      "train": {"num_steps": 100, "seed": 0},
      "logging": {"every_steps": 10},
      "checkpoint": {"every_steps": 50},
      "output_dir": "runs/demo"
    }
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ds_infcl.errors import ConfigError  # re-exported: its home before ds_infcl.errors
from ds_infcl.train.fp8 import validate_fp8_config

__all__ = [
    "ConfigError", "TaskConfig", "LossConfig", "BatchConfig", "ModelConfig", "DataConfig", "TrainConfig",
    "EvalConfig", "LoggingConfig", "CheckpointConfig", "DistConfig", "RunConfig", "load_run_config",
    "run_config_from_dict", "apply_overrides",
]


_REQUIRED = object()


@dataclass
class TaskConfig:
    """``task``: what is trained. ``name`` is looked up in the task registry; ``module`` (a Python
    import path) is imported first so that plug-in tasks can register themselves; ``args`` go to
    the task's constructor."""

    name: str = "synthetic"
    module: Optional[str] = None
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LossConfig:
    """``loss``: the ``ContrastiveLoss`` module (it owns the learnable logit scale). ``None`` means
    the task's default (CLIP is symmetric with a learnable scale, retrieval one-directional with
    a fixed scale of 20). ``impl`` may also name a FastCLIP loss (``fastclip_v0`` .. ``fastclip_v3``,
    ``sogclr``, ``isogclr``): ``FastCLIPLoss`` built with ``args`` (``num_samples`` from the task's data when it can tell,
    e.g. ``steps_per_epoch``); ``args`` is only used by those. ``impl: siglip`` is SigLIP's sigmoid
    loss (``SigLIPLoss``: learnable scale and bias, init ``log 10`` and ``init_logit_bias`` -10;
    ``learnable_scale: false`` fixes both; ``symmetric`` does not apply). ``matryoshka_dims`` (with
optional ``matryoshka_weights``, default 1 each): the retrieval task's loss over nested prefixes of
the embedding (for example ``[768, 512, 256, 128, 64]``), each an exact global InfoNCE, weighted and
summed as sentence-transformers' ``MatryoshkaLoss``."""

    impl: str = "infcl"
    backend: str = "auto"
    tile_size: Optional[int] = None
    symmetric: Optional[bool] = None
    init_logit_scale: Optional[float] = None
    max_logit_scale: Optional[float] = None
    learnable_scale: Optional[bool] = None
    init_logit_bias: Optional[float] = None
    matryoshka_dims: Optional[List[int]] = None
    matryoshka_weights: Optional[List[float]] = None
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchConfig:
    """``batch``: the global batch of one optimizer step (all ranks together; the contrastive loss
    sees all of it) and its GradCache chunking. With ``grad_cache`` the local batch is encoded
    ``chunk_size`` examples at a time (one DeepSpeed micro-step per chunk); ``chunk_size: "auto"``
    measures the towers before the engine is built and takes the fastest power of two whose memory
    fits ``memory_budget_gib`` (default: 85% of the free device memory; ``ds_infcl.train.chunk_auto``).
    ``grad_cache: "auto"``: the first ``keep_chunks`` chunks keep their graph, the rest are
    replayed (``ds_infcl.train.keep_chunks`` measures the number when not given)."""

    global_batch_size: int = _REQUIRED  # type: ignore[assignment]
    grad_cache: Union[bool, str] = False  # true, false or "auto" (ds_infcl.train.keep_chunks)
    keep_chunks: Optional[int] = None  # grad_cache "auto": chunks per step that keep their graph
    chunk_size: Optional[Union[int, str]] = None  # an integer, or "auto" (ds_infcl.train.chunk_auto)
    verify_replay: bool = False
    memory_budget_gib: Optional[float] = None  # chunk_size / grad_cache "auto": device memory a run may use
    # ZeRO-3 + GradCache: gather every parameter once per step, chunks outside ZeRO-3's hooks
    # ("auto": where it fits a quarter of the device; ds_infcl.train.zero3_gather)
    gather_params: Union[bool, str] = "auto"


@dataclass
class ModelConfig:
    """``model``: how the task's towers run. ``compile``: ``false`` (eager), ``"blocks"`` (or ``true``):
    each repeated block (every child of an ``nn.ModuleList`` in the towers) compiled in place with
    ``torch.compile(dynamic=False)``, parameter names and checkpoints unchanged; ``"towers"``:
    ``encode_query``/``encode_key`` each compiled whole. ``compile_mode``: ``torch.compile``'s
    ``mode``, ``default`` or ``max-autotune-no-cudagraphs`` (the CUDA-graph modes are refused:
    per-block graphs overwrite outputs still in use). Not with ZeRO stage 3 (hooks in the blocks); see
    ``ds_infcl.train.model.compile_towers``. ``fp8``, ``fp8_recipe`` (``"tensorwise"``, ``"rowwise"``),
    ``fp8_layers`` (``"blocks"``, ``"auto"``): torchao float8 linears, ``train/fp8.py``."""

    compile: Union[bool, str] = False
    compile_mode: str = "default"
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    fp8_layers: str = "blocks"


@dataclass
class DataConfig:
    """``data``: where the local batch lives. ``offload`` keeps it in CPU memory and moves one chunk
    at a time to the device; ``pin_memory`` (``"auto"`` = when CUDA is used) pins it.
    ``copy_stream`` (GradCache on CUDA): copy the next chunk on a side stream while the current
    one is encoded, so that host-to-device copies overlap compute (they overlap only from pinned
    memory); false copies each chunk on the compute stream right before its forward (to debug).
    """

    offload: bool = True
    pin_memory: Union[bool, str] = "auto"
    copy_stream: bool = True


@dataclass
class TrainConfig:
    """``train``: length and seed of the run."""

    num_steps: int = _REQUIRED  # type: ignore[assignment]
    seed: int = 0


@dataclass
class EvalConfig:
    """``eval``: call the task's ``evaluate`` hook every ``every_steps`` steps (0 = never) and, with
    ``at_end``, after the last step."""

    every_steps: int = 0
    at_end: bool = True


@dataclass
class LoggingConfig:
    """``logging``: metrics every ``every_steps`` steps to ``<output_dir>/metrics.csv``, TensorBoard
    (``<output_dir>/tensorboard``) and a progress bar on rank 0. ``peak_tflops``: the device's
    dense bf16/fp16 peak per GPU for the model-FLOPs utilization (``mfu``); ``None`` takes it from
    a table of known GPUs (H100, H200, A100, ...), else MFU is not reported. ``profile_step``
    (1-based, 0 = off): profile that step with ``torch.profiler`` and write its trace, operator
    table and device-time split to ``<output_dir>/profile/`` (``ds_infcl/train/profiling.py``)."""

    every_steps: int = 1
    csv: bool = True
    tensorboard: bool = True
    progress_bar: bool = True
    peak_tflops: Optional[float] = None
    profile_step: int = 0


@dataclass
class CheckpointConfig:
    """``checkpoint``: DeepSpeed checkpoints (engine, optimizer, loss module) plus the run state
    (step, data position, RNG) every ``every_steps`` steps (0 = never) and at the end; ``dir``
    defaults to ``<output_dir>/checkpoints``; ``keep_last`` (0 = all) deletes older ones. With
    ``export_final`` a task that has ``save_pretrained(folder, towers, logit_scale)`` writes the
    final model to ``<output_dir>/final_model`` (a folder its adapter loads), its weights taken from
    the optimizer's float32 masters and written in ``export_dtype`` (``float32``, ``bfloat16`` or
    ``float16``; the logit scale and bias stay float32). ``keep_last`` removes only this run's
    older tags (by step). ``overwrite`` (``--fresh``): a run without ``--resume`` may start in a
    ``dir`` that holds complete checkpoints (refused otherwise) and rewrite tags of the same name.
    ``on_signal``: on SIGTERM, SIGINT or SIGHUP every rank saves a checkpoint at the step boundary
    before it exits with 128 + the signal's number (``train/signals.py``)."""

    dir: Optional[str] = None
    every_steps: int = 0
    at_end: bool = True
    keep_last: int = 0
    export_final: bool = True
    export_dtype: str = "float32"
    overwrite: bool = False
    on_signal: bool = True


@dataclass
class DistConfig:
    """``dist``: the process group. ``timeout_s`` bounds how long a rank waits in a collective for
    a peer that stopped answering (a hung or partitioned process) before the run ends with an
    error naming the failure (default 1800 s, torch's own default; a dead peer is usually seen at
    once). Set it above the longest wait of your run: a checkpoint write, an evaluation."""

    timeout_s: int = 1800


@dataclass
class RunConfig:
    """The whole run config; see the module docstring."""

    batch: BatchConfig
    train: TrainConfig
    task: TaskConfig = field(default_factory=TaskConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    output_dir: str = "runs/default"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def checkpoint_dir(self) -> str:
        import os

        return self.checkpoint.dir or os.path.join(self.output_dir, "checkpoints")


_SECTIONS = {
    "task": TaskConfig,
    "loss": LossConfig,
    "batch": BatchConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "dist": DistConfig,
}


# ----------------------------------------------------------------------------------------------
# Parsing with key-naming errors
# ----------------------------------------------------------------------------------------------


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (dict, Dict):
        return "object"
    if tp is type(None):
        return "null"
    return {int: "integer", float: "number", bool: "true/false", str: "string"}.get(tp, str(tp))


def _check_type(key: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union:
        for arg in typing.get_args(tp):
            try:
                return _check_type(key, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif origin in (dict, Dict):
        if isinstance(value, dict):
            return dict(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a field type this parser does not know
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _parse_section(name: str, cls, raw: Any):
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected an object, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]}: unknown key; allowed keys of '{name}' are {sorted(fields)}"
        )
    kwargs = {}
    for fname, f in fields.items():
        key = f"{name}.{fname}"
        if fname in raw:
            kwargs[fname] = _check_type(key, raw[fname], hints[fname])
        elif f.default is _REQUIRED:
            raise ConfigError(f"{key}: required key is missing")
    return cls(**kwargs)


# torch.compile modes that wrap the compiled code in CUDA graphs (refused, see validate).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _allowed(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {list(allowed)}")


def _positive(key: str, value: Optional[int], *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key}: must be {'>= 0' if zero_ok else '>= 1'}, got {value}")


def run_config_from_dict(raw: Dict[str, Any]) -> RunConfig:
    """Parse and validate a run config given as a dict (see ``load_run_config``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the run config must be a JSON object, got {type(raw).__name__}")
    allowed_top = sorted(list(_SECTIONS) + ["output_dir"])
    unknown = sorted(set(raw) - set(allowed_top))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; allowed keys are {allowed_top}")
    sections = {}
    for name, cls in _SECTIONS.items():
        if name in raw:
            sections[name] = _parse_section(name, cls, raw[name])
        elif name in ("batch", "train"):
            raise ConfigError(f"{name}: required section is missing")
    cfg = RunConfig(**sections)
    if "output_dir" in raw:
        cfg.output_dir = _check_type("output_dir", raw["output_dir"], str)
    _validate(cfg)
    return cfg


def _validate(cfg: RunConfig) -> None:
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard: true needs the tensorboard package (pip install tensorboard, or "
                          "the ds_infcl[train] extra); install it or set logging.tensorboard false")
    _validate_loss(cfg)
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _allowed("checkpoint.export_dtype", cfg.checkpoint.export_dtype, ("float32", "bfloat16", "float16"))
    _positive("batch.global_batch_size", cfg.batch.global_batch_size)
    if isinstance(cfg.batch.chunk_size, str):
        if cfg.batch.chunk_size != "auto":
            raise ConfigError(f"batch.chunk_size: {cfg.batch.chunk_size!r} is not allowed; give an integer >= 1 or \"auto\"")
    else:
        _positive("batch.chunk_size", cfg.batch.chunk_size)
    _validate_grad_cache(cfg)
    if cfg.batch.memory_budget_gib is not None:
        if cfg.batch.chunk_size != "auto" and cfg.batch.grad_cache != "auto":
            raise ConfigError("batch.memory_budget_gib: only used with batch.chunk_size \"auto\" or batch.grad_cache "
                              "\"auto\"; remove it or set one of them to \"auto\"")
        if not cfg.batch.memory_budget_gib > 0:
            raise ConfigError(f"batch.memory_budget_gib: must be > 0, got {cfg.batch.memory_budget_gib}")
    _allowed("model.compile", cfg.model.compile, (False, True, "blocks", "towers"))
    if cfg.model.compile_mode in _CUDA_GRAPH_MODES:
        raise ConfigError(
            f"model.compile_mode: {cfg.model.compile_mode!r} captures each compiled block in a CUDA graph, and a block's "
            "graph reuses its output buffers on every replay while the previous replay's outputs are still in use (the "
            "next block's input, GradCache's saved activations): the run fails at step 1 with 'accessing tensor output "
            "of CUDAGraphs that has been overwritten' (H200, torch 2.11). Use 'default' or 'max-autotune-no-cudagraphs'")
    _allowed("model.compile_mode", cfg.model.compile_mode, ("default", "max-autotune-no-cudagraphs"))
    validate_fp8_config(cfg.model)
    if cfg.batch.grad_cache and cfg.batch.chunk_size is None:
        raise ConfigError(f"batch.chunk_size: required when batch.grad_cache is {json.dumps(cfg.batch.grad_cache)}")
    if not cfg.batch.grad_cache and cfg.batch.chunk_size is not None:
        raise ConfigError("batch.chunk_size: only used with GradCache; set batch.grad_cache to true or remove it")
    _allowed("data.pin_memory", cfg.data.pin_memory, ["auto", True, False])
    _allowed("batch.gather_params", cfg.batch.gather_params, ["auto", True, False])
    _positive("train.num_steps", cfg.train.num_steps)
    _positive("train.seed", cfg.train.seed, zero_ok=True)
    _positive("eval.every_steps", cfg.eval.every_steps, zero_ok=True)
    _positive("logging.every_steps", cfg.logging.every_steps)
    if not 0 <= cfg.logging.profile_step <= cfg.train.num_steps:  # 0: no profile
        raise ConfigError(f"logging.profile_step: {cfg.logging.profile_step} is not a step of this run (1..train.num_steps = {cfg.train.num_steps}, or 0 for no profile)")
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps, zero_ok=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last, zero_ok=True)
    if not cfg.output_dir:
        raise ConfigError("output_dir: must be a non-empty path")


def _validate_grad_cache(cfg: RunConfig) -> None:
    """``batch.grad_cache`` is true, false or "auto"; ``batch.keep_chunks`` (>= 0) only with "auto"."""
    _allowed("batch.grad_cache", cfg.batch.grad_cache, [True, False, "auto"])
    keep = cfg.batch.keep_chunks
    if keep is not None and cfg.batch.grad_cache != "auto":
        raise ConfigError(f"batch.keep_chunks: only used with batch.grad_cache \"auto\" (it is "
                          f"{json.dumps(cfg.batch.grad_cache)}); remove it or set batch.grad_cache to \"auto\"")
    _positive("batch.keep_chunks", keep, zero_ok=True)


def _validate_loss(cfg: RunConfig) -> None:
    """The ``loss`` section: a known ``impl`` and only the keys it uses (the features each loss
    registered, ``ds_infcl.loss.loss_features``)."""
    from ds_infcl.loss import loss_features, losses_with
    from ds_infcl.ops import BACKENDS

    def named(feature: str) -> str:
        return " or ".join(repr(n) for n in losses_with(feature))

    impl = cfg.loss.impl
    _allowed("loss.impl", impl, losses_with("run_config"))
    features = loss_features(impl)
    if "directed" not in features and cfg.loss.symmetric is not None:
        raise ConfigError(f"loss.symmetric: not used by loss.impl {impl!r} (its pairwise loss has no direction)")
    if "logit_bias" not in features and cfg.loss.init_logit_bias is not None:
        raise ConfigError(f"loss.init_logit_bias: only used by loss.impl {named('logit_bias')}; loss.impl is {impl!r}")
    if "args" in features:
        n = cfg.loss.args.get("num_samples")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"loss.args.num_samples: must be an integer >= 1, got {n!r}")
    elif cfg.loss.args:
        raise ConfigError(f"loss.args: only used by the FastCLIP losses {list(losses_with('args'))}; loss.impl is {impl!r}")
    dims, weights = cfg.loss.matryoshka_dims, cfg.loss.matryoshka_weights
    if dims is not None:
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ConfigError(f"loss.matryoshka_dims: a non-empty list of positive integers, got {dims!r}")
        if "retrieval" not in features:
            raise ConfigError(f"loss.matryoshka_dims: used with loss.impl {named('retrieval')} (the retrieval task); "
                              f"loss.impl is {impl!r}")
    if weights is not None and (dims is None or len(weights) != len(dims)):
        raise ConfigError(f"loss.matryoshka_weights: one weight per entry of loss.matryoshka_dims, got {weights!r} for {dims!r}")
    _allowed("loss.backend", cfg.loss.backend, BACKENDS)
    _positive("loss.tile_size", cfg.loss.tile_size)
    if (
        cfg.loss.init_logit_scale is not None
        and cfg.loss.max_logit_scale is not None
        and cfg.loss.init_logit_scale > cfg.loss.max_logit_scale
    ):
        raise ConfigError(
            f"loss.init_logit_scale: {cfg.loss.init_logit_scale} exceeds loss.max_logit_scale "
            f"{cfg.loss.max_logit_scale}"
        )

def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string such as runs/x


def apply_overrides(
    raw: Dict[str, Any], overrides: List[str], *, what: str = "--set", delete_on_null: bool = False
) -> Dict[str, Any]:
    """Apply ``key.sub=value`` overrides (value parsed as JSON, else a string) to a nested dict.

    ``what`` names the flag in error messages; with ``delete_on_null`` a value of ``null`` removes
    the key (``--ds-set scheduler=null``). Returns a new dict.
    """
    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"{what} {item!r}: expected KEY=VALUE, e.g. batch.chunk_size=16")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"{what} {item!r}: empty key")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{what} {item!r}: {p} is not an object")
            node = nxt
        parsed = _parse_value(value)
        if parsed is None and delete_on_null:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = parsed
    return out


def read_json_file(path: str, flag: str) -> Dict[str, Any]:
    """The JSON object in ``path``; a ``ConfigError`` naming the command-line ``flag`` if the file
    is missing or not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{flag}: file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag}: {path} is not valid JSON: {e}") from None


def load_run_config(path: Optional[str], overrides: Optional[List[str]] = None) -> RunConfig:
    """Read, override and validate a run config JSON file (``path`` may be ``None``: overrides only)."""
    raw: Dict[str, Any] = read_json_file(path, "--config") if path else {}
    return run_config_from_dict(apply_overrides(raw, overrides or []))
