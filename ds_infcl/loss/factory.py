"""One factory from a loss name to its ``nn.Module``: ``build_loss(impl, **settings)``.

The name is looked up in the registry (``loss/registry.py``), where every implementation registered
itself once: a functional implementation (``infcl``, ``vanilla``, ``local``, ``disco``) becomes a
``ContrastiveLoss``; a loss module (``siglip``, the FastCLIP losses, ``retrieval``) is made by its own
builder. The trainer's tasks supply defaults only (``Task.loss_defaults()``); the run config's
``loss`` section overrides them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

from torch import nn

from ds_infcl.loss.registry import LossSettings, get_loss_builder

__all__ = ["build_loss", "check_loss", "loss_settings"]

# ContrastiveLoss keyword arguments a run config overrides (the task's defaults give the rest).
_CONTRASTIVE_KEYS = ("symmetric", "init_logit_scale", "max_logit_scale", "learnable_scale")


def loss_settings(
    impl: str,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    sample_index_bound: Optional[Callable[[], Optional[int]]] = None,
    owner: str = "task",
    **settings: Any,
) -> LossSettings:
    """The ``LossSettings`` a builder gets; ``settings`` whose value is ``None`` count as unset."""
    return LossSettings(
        impl=impl,
        config={key: value for key, value in settings.items() if value is not None},
        defaults=dict(defaults or {}),
        sample_index_bound=sample_index_bound,
        owner=owner,
    )


def build_loss(
    impl: str,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    sample_index_bound: Optional[Callable[[], Optional[int]]] = None,
    owner: str = "task",
    **settings: Any,
) -> nn.Module:
    """The loss module registered as ``impl``.

    Args:
        impl: a name of ``available_loss_modules()``.
        defaults: the task's defaults (``ContrastiveLoss`` keywords for the functional
            implementations); ``settings`` override them.
        sample_index_bound: callable giving the task's sample index bound (FastCLIP's tables).
        owner: the task's name, for error messages.
        **settings: the run config's ``loss`` fields (``backend``, ``tile_size``, ``symmetric``,
            ``init_logit_scale``, ``max_logit_scale``, ``learnable_scale``, ``init_logit_bias``,
            ``matryoshka_dims``, ``matryoshka_weights``, ``args``); ``None`` means unset.

    Raises:
        ValueError: unknown ``impl`` (the valid names listed) or settings the module rejects.
        ConfigError: settings that name a run config key (``loss.args.num_samples``, ...).
    """
    spec = loss_settings(impl, defaults=defaults, sample_index_bound=sample_index_bound, owner=owner, **settings)
    builder, check = get_loss_builder(impl)
    if check is not None:
        check(spec)
    return (builder or _contrastive_loss)(spec)


def check_loss(
    impl: str,
    *,
    defaults: Optional[Mapping[str, Any]] = None,
    sample_index_bound: Optional[Callable[[], Optional[int]]] = None,
    owner: str = "task",
    **settings: Any,
) -> None:
    """What ``build_loss`` checks before it builds, without building (no per-sample tables are
    allocated, no model is loaded): the run's ``--check``."""
    builder, check = get_loss_builder(impl)
    if check is not None:
        check(loss_settings(impl, defaults=defaults, sample_index_bound=sample_index_bound, owner=owner, **settings))


def _contrastive_loss(spec: LossSettings) -> nn.Module:
    """``ContrastiveLoss(impl=spec.impl)`` from the task's defaults overridden by the config."""
    from ds_infcl.errors import ConfigError
    from ds_infcl.loss.module import ContrastiveLoss

    if spec.config.get("matryoshka_dims"):
        raise ConfigError(f"loss.matryoshka_dims: task {spec.owner!r} does not support it (the retrieval task does)")
    kwargs: Dict[str, Any] = dict(spec.defaults)
    kwargs.update({key: spec.config[key] for key in _CONTRASTIVE_KEYS if key in spec.config})
    return ContrastiveLoss(impl=spec.impl, **spec.placement(), **kwargs)
