"""Registry of loss implementations, selectable by name (``impl=`` in the loss API, ``loss.impl``
in a run config).

Two kinds of entries, each registered once, where the implementation is defined:

- **Functional implementations** (``register_loss_impl``: ``infcl``, ``vanilla``, ``local``,
  ``disco``). Each computes the same global InfoNCE loss and keeps the contract of DESIGN.md
  section 3.1; they differ in how they communicate and how much memory they hold. An
  implementation is a callable::

      fn(query, key, scale, labels, *, symmetric, backend, group, tile_size) -> loss

  called with validated inputs, where ``scale`` is a 0-dim float tensor (it may require grad) and
  ``labels`` an int64 tensor of local indices or ``None`` for the diagonal (query i's positive is
  key i; ``ds_infcl.ops.labels_or_diagonal`` makes the tensor where one is needed). It returns the
  global loss (the same value on every rank of ``group``), and after the data-parallel mean of
  gradients over ``group`` every gradient equals the single-device gradient on the global batch.
  ``ds_infcl.loss.build_loss`` wraps it in ``ContrastiveLoss`` unless the registration gives a
  builder.
- **Loss modules** (``register_loss_module``: ``siglip``, the FastCLIP losses, ``retrieval``): a
  builder ``builder(settings: LossSettings) -> nn.Module`` and optionally a ``check(settings)``
  that validates the settings without building anything (``--check``).

Each registration also declares the loss's **features**, which the tasks and the run config's
checks ask for instead of comparing names (``loss_features``, ``losses_with``):

- ``"directed"``: the loss has a query-to-key direction (``loss.symmetric`` applies);
- ``"logit_bias"``: it trains a logit bias (``loss.init_logit_bias`` applies; an export carries it);
- ``"multi_positive"``: a query may have several positives (ids instead of one label);
- ``"args"``: it takes ``loss.args`` (FastCLIP's per-sample state);
- ``"retrieval"``: the retrieval loss (false-negative masking, hard negatives, Matryoshka) is built
  on its op;
- ``"run_config"``: a run config may name it in ``loss.impl`` (every loss but the retrieval task's
  own module, which the retrieval task builds itself).

``ds_infcl.loss.build_loss(impl, ...)`` (``loss/factory.py``) is the one place that turns a name
into an ``nn.Module``. This module imports none of the implementations: they register themselves
when their modules are imported, which ``ds_infcl.loss`` (the package) does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterable, Optional, Tuple

__all__ = [
    "LossSettings",
    "register_loss_impl",
    "register_loss_module",
    "get_loss_impl",
    "get_loss_builder",
    "available_loss_impls",
    "available_loss_modules",
    "loss_features",
    "losses_with",
    "FEATURES",
]

FEATURES = ("directed", "logit_bias", "multi_positive", "args", "retrieval", "run_config")

_IMPLS: Dict[str, Callable] = {}
# name -> (builder or None for "ContrastiveLoss around the functional impl", check or None)
_BUILDERS: Dict[str, Tuple[Optional[Callable], Optional[Callable]]] = {}
_FEATURES: Dict[str, FrozenSet[str]] = {}


@dataclass
class LossSettings:
    """What a loss builder gets.

    Attributes:
        impl: the registered name being built.
        config: the run config's ``loss`` section with the unset (``None``) keys left out:
            ``backend``, ``tile_size``, ``symmetric``, ``init_logit_scale``, ``max_logit_scale``,
            ``learnable_scale``, ``init_logit_bias``, ``matryoshka_dims``, ``matryoshka_weights``,
            ``args``. These override ``defaults``.
        defaults: the task's defaults (``Task.loss_defaults()``).
        sample_index_bound: the task's ``sample_index_bound`` (a callable giving one more than the
            largest global sample index, or ``None`` when it cannot tell); losses with per-sample
            state size their tables with it.
        owner: who asks (the task's name), for error messages.
    """

    impl: str
    config: Dict[str, Any] = field(default_factory=dict)
    defaults: Dict[str, Any] = field(default_factory=dict)
    sample_index_bound: Optional[Callable[[], Optional[int]]] = None
    owner: str = "task"

    def placement(self) -> Dict[str, Any]:
        """``backend`` and ``tile_size`` where the config sets them (every module takes both)."""
        return {key: self.config[key] for key in ("backend", "tile_size") if key in self.config}


def _claim(name: str, entry, features: Iterable[str]) -> None:
    features = frozenset(features)
    unknown = sorted(features - set(FEATURES))
    if unknown:
        raise ValueError(f"loss implementation {name!r}: unknown features {unknown}; choose from {list(FEATURES)}")
    if name in _BUILDERS and (_BUILDERS[name], _FEATURES[name]) != (entry, features):
        raise ValueError(f"loss implementation {name!r} is already registered")
    _BUILDERS[name] = entry
    _FEATURES[name] = features


def register_loss_impl(name: str, *, builder: Optional[Callable] = None, check: Optional[Callable] = None,
                       features: Iterable[str] = ("directed", "run_config")) -> Callable[[Callable], Callable]:
    """Decorator: register the functional implementation ``fn`` under ``name`` (names are
    unique). ``build_loss(name)`` gives ``ContrastiveLoss(impl=name)`` unless ``builder`` is given.
    ``features``: see the module docstring."""

    def deco(fn: Callable) -> Callable:
        if name in _IMPLS and _IMPLS[name] is not fn:
            raise ValueError(f"loss implementation {name!r} is already registered")
        _claim(name, (builder, check), features)
        _IMPLS[name] = fn
        return fn

    return deco


def register_loss_module(name: str, builder: Callable, *, check: Optional[Callable] = None,
                         features: Iterable[str] = ("run_config",)) -> None:
    """Register a loss that exists only as a module: ``builder(settings: LossSettings) ->
    nn.Module``; ``check(settings)`` (optional) validates the settings without building;
    ``features``: see the module docstring."""
    _claim(name, (builder, check), features)


def loss_features(name: str) -> FrozenSet[str]:
    """The features registered for ``name``; ``ValueError`` listing the valid names if none."""
    get_loss_builder(name)
    return _FEATURES[name]


def losses_with(feature: str) -> Tuple[str, ...]:
    """The registered names that have ``feature``, sorted."""
    if feature not in FEATURES:
        raise ValueError(f"unknown loss feature {feature!r}; choose from {list(FEATURES)}")
    return tuple(sorted(name for name, features in _FEATURES.items() if feature in features))


def available_loss_impls() -> tuple:
    """Names of the registered functional implementations (``contrastive_loss(impl=...)``), sorted."""
    return tuple(sorted(_IMPLS))


def available_loss_modules() -> tuple:
    """Every name ``build_loss`` accepts (functional implementations and loss modules), sorted."""
    return tuple(sorted(_BUILDERS))


def get_loss_impl(name: str) -> Callable:
    """The implementation registered as ``name``; ``ValueError`` listing the valid names if none."""
    if name not in _IMPLS:
        raise ValueError(f"unknown loss implementation {name!r}; choose one of {sorted(_IMPLS)}")
    return _IMPLS[name]


def get_loss_builder(name: str) -> Tuple[Optional[Callable], Optional[Callable]]:
    """``(builder, check)`` registered for ``name`` (``builder`` ``None``: ``ContrastiveLoss``
    around the functional implementation); ``ValueError`` listing the valid names if none."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown loss implementation {name!r}; choose one of {sorted(_BUILDERS)}")
    return _BUILDERS[name]
