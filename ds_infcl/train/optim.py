"""Optimizers from the DeepSpeed JSON, made to work on every accelerator.

The ``optimizer`` block of the DeepSpeed config is what users write (``AdamW``, ``Lamb``,
``Lion``, ``SGD`` ...). DeepSpeed builds most of them from fused CUDA ops, which a CPU machine
cannot load or has to JIT-compile; ``prepare_optimizer`` adjusts the config so that the same JSON
runs everywhere, and says what it changed:

| ``optimizer.type`` | CUDA | CPU accelerator (what this module does) |
| --- | --- | --- |
| ``Adam``, ``AdamW`` | DeepSpeed ``FusedAdam`` (``DeepSpeedCPUAdam`` with optimizer offload); ``torch.optim`` with ``fused=True`` unless FusedAdam is prebuilt or ``torch_adam`` is false (then DeepSpeed JIT-builds it) | sets ``torch_adam: true`` (``torch.optim.Adam/AdamW``, ``foreach=True``) instead of JIT-building the CPU Adam op (~90 s) |
| ``Lamb`` | DeepSpeed ``FusedLamb`` (CUDA op, JIT-built) | CUDA-only op: uses ``ds_infcl.train.optim.Lamb`` (same maths, pure PyTorch) |
| ``Lion`` | DeepSpeed ``FusedLion`` (``DeepSpeedCPULion`` with offload) | CUDA-only op: uses ``ds_infcl.train.optim.Lion`` (pure PyTorch) |
| ``SGD`` (any ``torch.optim`` name) | ``torch.optim.<name>`` | same |

ZeRO (stage >= 1) only accepts the optimizers DeepSpeed has tested (Adam/AdamW/Adagrad/Lion and
its fused/CPU versions); anything else needs ``"zero_allow_untested_optimizer": true``. A
substitute chosen here sets it itself (with a log line); a user's choice (``SGD``, ``Lamb``
on CUDA) without it is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ds_infcl.train.config import ConfigError

__all__ = ["Lion", "Lamb", "prepare_optimizer"]


class _PerParameterOptimizer(torch.optim.Optimizer):
    """The one step both CPU substitutes share: every parameter that has a gradient is updated by
    ``_update(p, state, group)`` (its own maths), without gradients, after the optional closure."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        raise NotImplementedError


class Lion(_PerParameterOptimizer):
    """Lion (Chen et al., 2023), as DeepSpeed's ``FusedLion``: ``c = b1*m + (1-b1)*g``,
    ``p <- p*(1 - lr*wd) - lr*sign(c)``, ``m <- b2*m + (1-b2)*g``."""

    def __init__(self, params, lr: float = 1e-4, betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        g = p.grad
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
        m = state["exp_avg"]
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        update = m.mul(b1).add_(g, alpha=1 - b1).sign_()
        p.add_(update, alpha=-group["lr"])
        m.mul_(b2).add_(g, alpha=1 - b2)


class Lamb(_PerParameterOptimizer):
    """LAMB (You et al., 2020), as DeepSpeed's ``FusedLamb``: the Adam direction
    ``u = m_hat / (sqrt(v_hat) + eps) + wd * p`` scaled by the trust ratio
    ``clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 where a norm is 0)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)

    def _update(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        g = p.grad.float()
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if group["bias_correction"]:
            m_hat = m / (1 - b1 ** state["step"])
            v_hat = v / (1 - b2 ** state["step"])
        else:
            m_hat, v_hat = m, v
        if group["eps_inside_sqrt"]:
            u = m_hat / (v_hat + group["eps"]).sqrt()
        else:
            u = m_hat / (v_hat.sqrt() + group["eps"])
        if group["weight_decay"]:
            u.add_(p.float(), alpha=group["weight_decay"])
        w_norm, u_norm = p.float().norm(), u.norm()
        if w_norm > 0 and u_norm > 0:
            ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        else:
            ratio = torch.ones((), device=p.device)
        p.add_((u * ratio).to(p.dtype), alpha=-group["lr"])


# Names DeepSpeed builds itself (lower case) and the ones ZeRO accepts without the opt-in flag.
_DS_NAMES = {"adam", "adamw", "lamb", "lion", "adagrad", "muadam", "muadamw", "musgd", "muon"}
_ZERO_TESTED = {"adam", "adamw", "adagrad", "lion"}


def prepare_optimizer(
    ds_config: Dict[str, Any], accelerator: str
) -> Tuple[Dict[str, Any], Optional[Callable[[Any], torch.optim.Optimizer]], List[str]]:
    """Make the DeepSpeed config's optimizer work on ``accelerator``.

    Returns:
        ``(ds_config, client_optimizer, notes)``: the (copied) config, a factory
        ``params -> Optimizer`` to pass to ``deepspeed.initialize`` (or ``None``: DeepSpeed builds
        the optimizer from the config), and human-readable notes of every change.

    Raises:
        ConfigError: no ``optimizer`` block, an unknown type, or an optimizer ZeRO has not tested
            without ``zero_allow_untested_optimizer``.
    """
    cfg = copy.deepcopy(ds_config)
    notes: List[str] = []
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict) or "type" not in opt:
        raise ConfigError(
            "DeepSpeed config: an \"optimizer\" block with a \"type\" is required "
            "(AdamW, Adam, Lamb, Lion, SGD or another torch.optim name)"
        )
    params = dict(opt.get("params", {}))
    name = str(opt["type"])
    lname = name.lower()
    zero_stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
    on_cpu = accelerator == "cpu"

    if lname not in _DS_NAMES:
        # DeepSpeed falls back to getattr(torch.optim, type): accept any capitalization.
        match = [n for n in dir(torch.optim) if n.lower() == lname and isinstance(getattr(torch.optim, n), type)]
        if not match:
            raise ConfigError(
                f"DeepSpeed config: optimizer.type {name!r} is unknown; use one of AdamW, Adam, "
                f"Lamb, Lion, or a torch.optim class such as SGD"
            )
        if match[0] != name:
            notes.append(f"optimizer.type {name!r} -> {match[0]!r} (torch.optim name)")
            opt["type"] = match[0]

    client = None
    if on_cpu and lname in ("adam", "adamw") and "torch_adam" not in params:
        params["torch_adam"] = True
        notes.append(f"optimizer {name}: torch_adam=true on CPU (no JIT build of DeepSpeed's CPU Adam)")
    elif lname in ("adam", "adamw") and "torch_adam" not in params and not _fused_adam_buildable(cfg):
        params["torch_adam"] = True
        notes.append(
            f"optimizer {name}: DeepSpeed's FusedAdam is not prebuilt; using torch.optim (torch_adam=true: "
            "the same update, fused, with no JIT build). Set optimizer.params.torch_adam=false to JIT-build "
            "FusedAdam (needs nvcc), or install DeepSpeed with DS_BUILD_FUSED_ADAM=1"
        )
    if lname in ("adam", "adamw"):
        notes.append(_adam_choice(name, lname, params, cfg, on_cpu))
    if on_cpu and lname in ("lamb", "lion"):
        cls = Lamb if lname == "lamb" else Lion
        allowed = set(cls.__init__.__code__.co_varnames[2 : cls.__init__.__code__.co_argcount])
        dropped = sorted(set(params) - allowed)
        kwargs = {k: v for k, v in params.items() if k in allowed}
        if dropped:
            notes.append(f"optimizer {name}: ignoring params {dropped} not used by the CPU {cls.__name__}")
        client = lambda p, _cls=cls, _kw=kwargs: _cls(p, **_kw)  # noqa: E731
        del cfg["optimizer"]
        notes.append(
            f"optimizer {name}: DeepSpeed's version is a CUDA op; using ds_infcl.train.optim.{cls.__name__} on CPU"
        )
        if zero_stage >= 1 and not cfg.get("zero_allow_untested_optimizer", False):
            cfg["zero_allow_untested_optimizer"] = True
            notes.append("zero_allow_untested_optimizer=true for the CPU substitute optimizer")
        return cfg, client, notes

    opt["params"] = params
    if zero_stage >= 1 and lname not in _ZERO_TESTED and not cfg.get("zero_allow_untested_optimizer", False):
        raise ConfigError(
            f"DeepSpeed config: optimizer.type {name!r} with zero_optimization.stage {zero_stage} needs "
            f"\"zero_allow_untested_optimizer\": true (ZeRO has only tested Adam, AdamW, Adagrad and Lion)"
        )
    return cfg, client, notes


def _adam_choice(name: str, lname: str, params: Dict[str, Any], cfg: Dict[str, Any], on_cpu: bool) -> str:
    """Pick the Adam implementation's kernel mode in ``params`` (changed in place) and say which.

    With ``torch_adam`` DeepSpeed builds ``torch.optim.AdamW`` (``Adam`` with ``adam_w_mode``
    false) from ``params``; unless the user chose ``fused`` or ``foreach``, the optimizer states on
    a GPU use ``fused=True`` (one kernel for all parameters) and on the CPU (the CPU accelerator,
    or ``offload_optimizer``) ``foreach=True``."""
    offload = (cfg.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    on_host = on_cpu or offload in ("cpu", "nvme")
    if not params.get("torch_adam"):
        ds_cls = "DeepSpeedCPUAdam (optimizer offload)" if on_host else "FusedAdam"
        return f"optimizer {name}: DeepSpeed's {ds_cls}"
    if "fused" not in params and "foreach" not in params:
        params["fused" if not on_host else "foreach"] = True
    cls = "AdamW" if lname == "adamw" or params.get("adam_w_mode", True) else "Adam"
    mode = ", ".join(f"{k}={params[k]}" for k in ("fused", "foreach") if k in params)
    return f"optimizer {name}: torch.optim.{cls}({mode})"


def _fused_adam_buildable(cfg: Dict[str, Any]) -> bool:
    """Whether DeepSpeed's Adam is there without a JIT build of a CUDA op: prebuilt (optimizer
    offload uses the CPU Adam, built with the host compiler). A JIT build of FusedAdam is not
    chosen by default: it takes a minute per fresh machine and fails outright on some images
    (DeepSpeed 0.19.8 cannot parse a ``TORCH_CUDA_ARCH_LIST`` entry such as ``9.0a``: seen on the
    H100 image, 2026-11-25), while ``torch.optim.AdamW(fused=True)`` is the same update in one
    kernel; ``torch_adam: false`` still asks for it."""
    offload = (cfg.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    if offload in ("cpu", "nvme"):
        return True
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("fused_adam"):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False
