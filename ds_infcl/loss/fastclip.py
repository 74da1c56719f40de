# Over 500 lines on purpose: FastCLIPLoss is one state machine (u tables, temperatures, ring pass) best read whole.
"""FastCLIP's global contrastive losses on the tiled LSE op: GCL, RGCL, RGCL-g (versions v0-v3,
SogCLR, iSogCLR), after Wei et al., "FastCLIP" (``seeds/003_*.txt``, Algorithm 1, Procs. 2-5,
Appendix B).

Maths. For image ``i`` and text ``j`` of the *global* batch (``N`` pairs over all ranks of
``group``) with similarities ``s_ij = q_i . k_j`` and temperature ``tau``, the inner functions of
the two directions are

    g1_i = 1/(N-1) sum_{j != i} exp((s_ij - s_ii) / tau)      (image i against all texts)
    g2_i = 1/(N-1) sum_{j != i} exp((s_ji - s_ii) / tau)      (text i against all images)

and they come straight from the tiled op with the positive pair excluded, in log space, so they
stay finite where ``exp`` overflows float32 (an exponent past ~88):

    log g1_i = row_lse_i - x_ii - log(N - 1)      log g2_i = col_lse_i - x_ii - log(N - 1)

with ``x = s / tau``. Each sample keeps running estimates ``u1_i, u2_i`` (indexed by its global
sample index), updated for the batch's samples with the inner learning rate ``gamma``:

    u_i <- (1 - gamma) u_i + gamma g_i        (kept as log u:  log u <- logaddexp(log(1-gamma) + log u, log gamma + log g))

A sample's first visit sets ``u_i = g_i`` (``log u = -inf`` marks "never seen"), as the
reference SogCLR/iSogCLR code does in epoch 0 and as the cosine schedule (gamma = 1 in epoch 0)
does anyway. The FCCO gradient estimator replaces ``1/(eps + g_i)`` by ``1/(eps + u_i)`` (with the
*updated* u): for any objective ``sum_i c_i f(g_i)`` it is ``sum_i c_i f'(u_i) grad g_i`` and, since
``grad g_i = g_i grad log g_i``, that is an *upstream weight on the LSE vectors*:

    weight_i = g_i / (eps + u_i) = exp(log g_i - logaddexp(log eps, log u_i))

so the op's backward (and the ring's) does all the work; nothing of size ``N x N`` exists.

Objectives (``S`` the data set, ``rho >= 0``, ``tau >= tau_min``):

- GCL (v0, v1, SogCLR):   ``tau / |S| sum_i [log(eps + g1_i) + log(eps + g2_i)]``
- RGCL (v2, iSogCLR):     ``1/|S| sum_i [tau1_i (log(eps + g1_i(tau1_i)) + rho) + tau2_i (log(eps + g2_i(tau2_i)) + rho)]``
- RGCL-g (v3):            ``tau / |S| sum_i [log(eps + g1_i) + log(eps + g2_i)] + 2 rho tau``

Gradients (mini-batch ``B``, u substituted as above; these are the exact gradients of the stated
objectives' FCCO estimators, Eqs. (2)-(10) of the appendix):

- model, v1/v3:  ``tau/N sum_i [w1_i grad log g1_i + w2_i grad log g2_i]``; v0 drops the leading tau
  (Eqs. 4-5); v2 uses ``tau1_i w1_i`` and ``tau2_i w2_i`` (Eqs. 6-7).
- temperature, v0 (unscaled GCL, Eq. 8): ``1/N sum_i [w1_i d log g1_i/d tau + w2_i d log g2_i/d tau]``.
- temperature, v3 (Eq. 10): ``1/N sum_i [log(eps + u1_i) + log(eps + u2_i)] + 2 rho
  + tau/N sum_i [w1_i d log g1_i/d tau + w2_i d log g2_i/d tau]``.
- temperature, v2 (Eq. 9), per sample and direction:
  ``log(eps + u1_i) + rho + tau1_i w1_i d log g1_i/d tau1_i = log(eps + u1_i) + rho - w1_i (E_P[x'_ij] - x'_ii)``,
  with ``x' = s / tau1_i`` and ``P`` the softmax of row i over its negatives. This is the gradient of
  sample i's own term; the literal ``1/|S|`` of Eq. (9) is a constant factor that the AdamW update
  (the paper's Proc. 4) divides out up to its epsilon.

The public code's temperature gradients differ from these (a factor 2 in v0, an extra
``tau * dh/dtau`` term in v3); this module implements the exact ones only.

The temperatures are updated by this module's own rule (Proc. 5: Proc. 4 with weight decay 0 and
the temperature's own learning rate), inside ``forward``, after the loss has been formed with the
current temperature (so the model gradient uses ``tau_t`` and ``tau_{t+1}`` comes from the gradient
at ``tau_t``, the order of Algorithm 1). The global temperature's gradient needs ``d/d scale`` of
the LSE vectors, which costs one extra backward of the op inside ``forward``; v2 needs one per
direction. Doing the update here keeps it independent of the engine's optimizer, its LR schedule,
fp16 loss scaling and GradCache: ``forward`` must run exactly once per optimizer step (GradCache
calls it once, on the cached features).

State and ranks. All per-sample state is *replicated* on every rank of ``group``: after each step
the batch's new values (sample index, log u1, log u2, and for v2 the temperature gradients) are
all-gathered and every rank applies the same deterministic update, so the state stays identical
everywhere. The model gradient never needs another rank's ``u`` (the ring carries the weights in
its backward). Memory per rank, float32: 8 bytes per sample for v0/v1/v3 (3.2 GB for 400M
samples), 36 bytes for v2 (u, temperatures, AdamW moments, step count: 14.4 GB for 400M);
``state_device="cpu"`` keeps it in host memory. State buffers are persistent (saved by
``state_dict``, hence in DeepSpeed's module checkpoint) and keep float32 even when the model is cast
to bf16/fp16.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ds_infcl.ops.lse import BACKENDS
from ds_infcl.ops.precision import follows_autocast
from ds_infcl.ops.validation import check_features
from ds_infcl.loss.registry import LossSettings, register_loss_module
from ds_infcl.loss.fastclip_estimators import _optimizer_step, inner_lr, log_eps_plus, log_inner, update_log_u
from ds_infcl.ring import (
    agree_on_input_errors, all_gather_nograd, comm_device, exchange_layout, global_sum_with_grad,
    group_size, resolve_group,
)

__all__ = [
    "FastCLIPLoss",
    "FASTCLIP_VERSIONS",
    "available_fastclip_losses",
    "build_fastclip_loss",
    "fastclip_num_samples",
    "inner_lr",
    "log_inner",
    "update_log_u",
    "log_eps_plus",
    "fastclip_reference",
]

_F32 = torch.float32

# Per-version defaults: the medium-scale settings of the paper's appendix (Tables 7-9 and the
# text of Appendix B). ``gamma_schedule`` "cosine" starts at 1 in epoch 0 and decays to
# ``gamma_min`` over ``gamma_decay_epochs``; "constant" uses ``gamma``.
FASTCLIP_VERSIONS: Dict[str, Dict] = {
    # GCL, learnable global temperature updated from the unscaled GCL gradient.
    "v0": dict(loss="gcl", temperature="global", learnable=True, init_temperature=0.03,
               temperature_lr=2e-4, rho=0.0, gamma_schedule="cosine"),
    # GCL, constant temperature 0.03.
    "v1": dict(loss="gcl", temperature="global", learnable=False, init_temperature=0.03,
               temperature_lr=0.0, rho=0.0, gamma_schedule="cosine"),
    # RGCL, individual temperatures per sample and direction (tau lr 1e-2, rho 7.0, Table 9).
    "v2": dict(loss="rgcl", temperature="individual", learnable=True, init_temperature=0.03,
               temperature_lr=1e-2, rho=7.0, gamma_schedule="cosine"),
    # RGCL-g, one learnable temperature (init 0.07, rho 6.5, tau lr 2e-4 decaying to 1/3 once
    # tau < 0.03).
    "v3": dict(loss="rgcl_g", temperature="global", learnable=True, init_temperature=0.07,
               temperature_lr=2e-4, rho=6.5, gamma_schedule="cosine"),
}
# Registry names the run config selects, with the version and schedule they imply.
_NAMES: Dict[str, Dict] = {
    "fastclip_v0": dict(version="v0"),
    "fastclip_v1": dict(version="v1"),
    "fastclip_v2": dict(version="v2"),
    "fastclip_v3": dict(version="v3"),
    "sogclr": dict(version="v1", gamma_schedule="constant", gamma=0.6),
    "isogclr": dict(version="v2", gamma_schedule="constant", gamma=0.6),
}
OPTIMIZERS = ("adamw", "lion", "sgdm")


class _KeepFP32(nn.Module):
    """Base that keeps the named state buffers float32 (and optionally on a fixed device) when
    the module is cast (``.half()``, ``.bfloat16()``, ``.to(device)`` by DeepSpeed)."""

    _fixed_buffers: Tuple[str, ...] = ()
    _state_device: Optional[torch.device] = None

    def _apply(self, fn, recurse=True):
        saved = {n: self._buffers[n] for n in self._fixed_buffers if n in self._buffers}
        super()._apply(fn, recurse)
        for name, old in saved.items():
            if self._state_device is not None:
                device = self._state_device
            else:
                device = fn(torch.empty(0, dtype=old.dtype, device=old.device)).device
            self._buffers[name] = old.to(device=device)
        return self


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


class FastCLIPLoss(_KeepFP32):
    """FastCLIP's global contrastive losses (symmetric image-text, square batch) on the tiled op.

    Args:
        num_samples: size of the data set; sample indices are ``0 .. num_samples - 1``.
        version: ``"v0"`` (GCL, learnable global tau from the unscaled GCL gradient), ``"v1"``
            (GCL, constant tau; SogCLR with a constant gamma), ``"v2"`` (RGCL, individual
            temperatures; iSogCLR with a constant gamma), ``"v3"`` (RGCL-g, one learnable tau).
        gamma_schedule: ``"cosine"`` (gamma 1 in epoch 0, cosine decay to ``gamma_min`` over
            ``gamma_decay_epochs`` epochs, constant after) or ``"constant"`` (``gamma``).
        gamma, gamma_min, gamma_decay_epochs: schedule settings (0.6; 0.2 and 18: the paper's
            medium-scale values).
        eps: the ``eps`` inside ``log(eps + g)`` (1e-14; the paper suggests 1e-6 at large scale).
        rho: RGCL / RGCL-g's ``rho`` (v2 7.0, v3 6.5 by default; unused by v0/v1).
        init_temperature: initial tau (0.03 for v0-v2, 0.07 for v3).
        temperature_lr: the temperature's own learning rate (v0 2e-4, v2 1e-2, v3 2e-4).
        min_temperature, max_temperature: the clamp of tau after each update (default [0.01, inf)
            for a global tau, [0.005, 0.05] for individual ones, iSogCLR's bounds).
        lr_decay_threshold, lr_decay_factor: v3 multiplies the temperature's learning rate by
            ``lr_decay_factor`` (1/3) for good once tau falls below ``lr_decay_threshold`` (0.03).
        temperature_optimizer: ``"adamw"`` (default; also what LAMB reduces to for tau with the
            paper's trust ratio 1), ``"lion"`` or ``"sgdm"``; use the model's optimizer family.
        betas, adam_eps, momentum: its hyperparameters (the paper's medium setting: 0.9, 0.999,
            1e-8; large: 0.9, 0.98, 1e-6).
        steps_per_epoch: if given, the epoch for gamma is ``num_updates // steps_per_epoch``;
            otherwise call ``set_epoch`` (or pass ``epoch=`` to ``forward``).
        backend, group, tile_size: as in ``ds_infcl.loss.lse``.
        state_device: where the per-sample state lives (``None``: with the module; ``"cpu"``).

    Inputs: ``image_features [b, c]``, ``text_features [b, c]`` (pairs, row i with row i; L2
    normalization is the caller's, as for CLIP), ``sample_index [b]`` int64 global indices (a
    sample that occurs twice in one global batch updates its state from its first occurrence in
    rank order).

    Returns: 0-dim float32 tensor, the same on every rank. Its *value* is the running estimate of
    the global objective (with the updated u); its *gradient* with respect to the features is the
    FCCO estimator above, with the data-parallel contract of ``ContrastiveLoss`` (after DeepSpeed's
    mean over ranks the gradients equal the single-device ones on the global batch).

    Relations: with gamma = 1 and eps -> 0 the v1 gradient equals ``tau`` times the gradient of the
    symmetric InfoNCE over the batch with positives excluded from the denominators; Inf-CL's
    ``ContrastiveLoss`` is the mini-batch loss FastCLIP replaces at small batch. Both share the op and
    the ring, so a global loss over a huge exact batch works too.

    Example::

        loss_fn = FastCLIPLoss(num_samples=len(dataset), version="v3", steps_per_epoch=steps)
        loss = loss_fn(image_features, text_features, batch.sample_index)
        loss.backward()     # the temperature was already updated by forward
    """

    # Trainers pass the batch's global sample indices to losses that declare this.
    needs_sample_index = True

    _STATE_GLOBAL = ("log_u1", "log_u2", "tau", "tau_m", "tau_v", "tau_count", "tau_lr_decayed",
                     "num_updates", "epoch")
    _STATE_INDIVIDUAL = ("tau1", "tau2", "tau1_m", "tau1_v", "tau2_m", "tau2_v", "tau_count_i")

    def __init__(
        self,
        num_samples: int,
        *,
        version: str = "v3",
        gamma_schedule: Optional[str] = None,
        gamma: float = 0.6,
        gamma_min: float = 0.2,
        gamma_decay_epochs: int = 18,
        eps: float = 1e-14,
        rho: Optional[float] = None,
        init_temperature: Optional[float] = None,
        temperature_lr: Optional[float] = None,
        min_temperature: Optional[float] = None,
        max_temperature: Optional[float] = None,
        lr_decay_threshold: float = 0.03,
        lr_decay_factor: float = 1.0 / 3.0,
        temperature_optimizer: str = "adamw",
        betas: Sequence[float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        momentum: float = 0.9,
        steps_per_epoch: Optional[int] = None,
        backend: str = "auto",
        group=None,
        tile_size: Optional[int] = None,
        state_device: Optional[str] = None,
    ):
        super().__init__()
        if version not in FASTCLIP_VERSIONS:
            raise ValueError(f"version must be one of {sorted(FASTCLIP_VERSIONS)}, got {version!r}")
        spec = FASTCLIP_VERSIONS[version]
        if int(num_samples) < 2:
            raise ValueError(f"num_samples must be >= 2, got {num_samples}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if temperature_optimizer not in OPTIMIZERS:
            raise ValueError(
                f"temperature_optimizer must be one of {OPTIMIZERS}, got {temperature_optimizer!r}"
            )
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        schedule = gamma_schedule or spec["gamma_schedule"]
        inner_lr(0, schedule=schedule)  # validates the name
        for name, value in (("gamma", gamma), ("gamma_min", gamma_min)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if steps_per_epoch is not None and int(steps_per_epoch) <= 0:
            raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")

        self.version = version
        self.loss_kind = spec["loss"]
        self.individual = spec["temperature"] == "individual"
        self.learnable = spec["learnable"]
        self.num_samples = int(num_samples)
        self.gamma_schedule = schedule
        self.gamma = float(gamma)
        self.gamma_min = float(gamma_min)
        self.gamma_decay_epochs = int(gamma_decay_epochs)
        self.eps = float(eps)
        self.rho = float(spec["rho"] if rho is None else rho)
        tau0 = float(spec["init_temperature"] if init_temperature is None else init_temperature)
        self.temperature_lr = float(spec["temperature_lr"] if temperature_lr is None else temperature_lr)
        default_min, default_max = (0.005, 0.05) if self.individual else (0.01, math.inf)
        self.min_temperature = float(default_min if min_temperature is None else min_temperature)
        self.max_temperature = float(default_max if max_temperature is None else max_temperature)
        if not 0 < self.min_temperature <= tau0 <= self.max_temperature:
            raise ValueError(
                f"need 0 < min_temperature <= init_temperature <= max_temperature, got "
                f"{self.min_temperature}, {tau0}, {self.max_temperature}"
            )
        self.lr_decay_threshold = float(lr_decay_threshold) if version == "v3" else None
        self.lr_decay_factor = float(lr_decay_factor)
        self.temperature_optimizer = temperature_optimizer
        self.betas = (float(betas[0]), float(betas[1]))
        self.adam_eps = float(adam_eps)
        self.momentum = float(momentum)
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.backend = backend
        self.group = group
        self.tile_size = tile_size
        self._state_device = None if state_device is None else torch.device(state_device)
        self.last_stats: Dict[str, object] = {}

        n = self.num_samples
        dev = self._state_device

        def buf(name, value):
            self.register_buffer(name, value.to(dev) if dev is not None else value)

        buf("log_u1", torch.full((n,), float("-inf"), dtype=_F32))
        buf("log_u2", torch.full((n,), float("-inf"), dtype=_F32))
        buf("tau", torch.tensor(tau0, dtype=_F32))
        buf("tau_m", torch.zeros((), dtype=_F32))
        buf("tau_v", torch.zeros((), dtype=_F32))
        buf("tau_count", torch.zeros((), dtype=_F32))
        buf("tau_lr_decayed", torch.zeros((), dtype=torch.bool))
        buf("num_updates", torch.zeros((), dtype=torch.int64))
        buf("epoch", torch.zeros((), dtype=torch.int64))
        fixed = list(self._STATE_GLOBAL)
        if self.individual:
            for name in ("tau1", "tau2"):
                buf(name, torch.full((n,), tau0, dtype=_F32))
            for name in ("tau1_m", "tau1_v", "tau2_m", "tau2_v", "tau_count_i"):
                buf(name, torch.zeros((n,), dtype=_F32))
            fixed += list(self._STATE_INDIVIDUAL)
        self._fixed_buffers = tuple(fixed)

    # ---- schedule and temperature ---------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch that selects gamma (when ``steps_per_epoch`` is not given)."""
        self.epoch.fill_(int(epoch))

    def current_epoch(self) -> int:
        if self.steps_per_epoch is not None:
            return int(self.num_updates.item()) // self.steps_per_epoch
        return int(self.epoch.item())

    def current_gamma(self, epoch: Optional[int] = None) -> float:
        """The inner learning rate of ``epoch`` (default: the current epoch)."""
        return inner_lr(
            self.current_epoch() if epoch is None else epoch, schedule=self.gamma_schedule,
            gamma=self.gamma, gamma_min=self.gamma_min, decay_epochs=self.gamma_decay_epochs,
        )

    def current_temperature_lr(self) -> float:
        """The temperature's learning rate now (v3: times ``lr_decay_factor`` once tau < 0.03)."""
        if self.lr_decay_threshold is not None and bool(self.tau_lr_decayed.item()):
            return self.temperature_lr * self.lr_decay_factor
        return self.temperature_lr

    @property
    def temperature(self) -> float:
        """The global tau (v0, v1, v3) or the mean individual tau (v2)."""
        if self.individual:
            return float(0.5 * (self.tau1.mean() + self.tau2.mean()))
        return float(self.tau.item())

    @property
    def logit_scale(self) -> torch.Tensor:
        """``log(1 / temperature)`` (0-dim, not a parameter): what trainers log as the scale."""
        return torch.tensor(-math.log(self.temperature), dtype=_F32, device=self.tau.device)

    # ---- forward ------------------------------------------------------------------------------

    @follows_autocast("image_features", "text_features")
    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        sample_index: Optional[torch.Tensor] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        epoch: Optional[int] = None,
        update: bool = True,
    ) -> torch.Tensor:
        """See the class docstring. ``labels`` (passed by the trainer) must be ``None`` or the
        diagonal ``arange(b)``: FastCLIP contrasts pairs. ``epoch`` sets the epoch first;
        ``update=False`` leaves every state and the temperature untouched (evaluation)."""
        from ds_infcl.loss.functional import lse  # the functional imports the registry

        q, k = image_features, text_features
        group = resolve_group(self.group)
        if sample_index is None:
            raise ValueError(
                "FastCLIPLoss needs sample_index (the global index of every pair): pass it to "
                "forward (the trainer passes the batch's sample_index)"
            )
        if not (torch.is_tensor(q) and torch.is_tensor(k)) or q.dim() != 2 or k.dim() != 2:
            raise ValueError("image_features and text_features must be 2-D tensors [b, c]")
        # A rank whose local checks fail announces it through the size exchange, so that every
        # rank raises instead of waiting in it.
        with agree_on_input_errors(group):
            error = self._input_error(q, k, sample_index, labels, allow_empty=group_size(group) > 1)
            if error is not None:
                raise ValueError(error)
        layout = exchange_layout(q, k, group, protocol="ring_lse")
        num_pairs = layout.num_queries
        if layout.num_keys != num_pairs or any(a != b for a, b in zip(layout.query_sizes, layout.key_sizes)):
            raise ValueError(
                "FastCLIPLoss needs paired features (as many texts as images on every rank), got "
                f"images per rank {list(layout.query_sizes)}, texts per rank {list(layout.key_sizes)}"
            )
        if num_pairs < 2:
            raise ValueError(f"FastCLIPLoss needs a global batch of at least 2 pairs, got {num_pairs}")
        if epoch is not None:
            self.set_epoch(epoch)
        gamma = self.current_gamma()
        idx_state = sample_index.to(device=self.log_u1.device, dtype=torch.long)
        dev = q.device
        opts = dict(exclude_positive=True, backend=self.backend, group=group, tile_size=self.tile_size,
                    check_finite=False)  # checked above
        sim_pos = (q.float() * k.float()).sum(dim=1)  # s_ii

        if self.individual:
            t1 = self.tau1[idx_state].to(dev)
            t2 = self.tau2[idx_state].to(dev)
            q1 = q / t1[:, None].to(q.dtype)
            k2 = k / t2[:, None].to(k.dtype)
            row1, _ = lse(q1, k, 1.0, compute_col=False, **opts)
            row2, _ = lse(k2, q, 1.0, compute_col=False, **opts)
            pos1, pos2 = sim_pos / t1, sim_pos / t2
            scale_t = None
        else:
            tau_now = self.tau.detach().to(dev).clone()
            scale_t = (1.0 / tau_now).requires_grad_(self.learnable and update)
            row1, row2 = lse(q, k, scale_t, compute_col=True, **opts)
            pos1 = pos2 = scale_t * sim_pos
        log_g1 = log_inner(row1, pos1, num_pairs)
        log_g2 = log_inner(row2, pos2, num_pairs)

        with torch.no_grad():
            lu1 = update_log_u(self.log_u1[idx_state].to(dev), log_g1.detach(), gamma)
            lu2 = update_log_u(self.log_u2[idx_state].to(dev), log_g2.detach(), gamma)
            le1, le2 = log_eps_plus(lu1, self.eps), log_eps_plus(lu2, self.eps)
            w1 = torch.exp(log_g1.detach() - le1)
            w2 = torch.exp(log_g2.detach() - le2)
        inv_n = 1.0 / num_pairs
        # Differentiable part: sum_i c_i * weight_i * log g_i (constants dropped).
        if self.individual:
            surrogate = inv_n * ((t1 * w1 * (row1 - pos1)).sum() + (t2 * w2 * (row2 - pos2)).sum())
            value = inv_n * ((t1 * (le1 + self.rho)).sum() + (t2 * (le2 + self.rho)).sum())
        else:
            weighted = inv_n * ((w1 * (row1 - pos1)).sum() + (w2 * (row2 - pos2)).sum())
            mean_le = inv_n * (le1.sum() + le2.sum())  # local share of mean_i [log(eps+u1)+log(eps+u2)]
            if self.loss_kind == "gcl" and self.learnable:  # v0: unscaled
                surrogate, value = weighted, mean_le
            else:
                surrogate = tau_now * weighted
                value = tau_now * mean_le
                if self.loss_kind == "rgcl_g":
                    value = value + 2 * self.rho * tau_now * (q.shape[0] * inv_n)
        share = value.detach() + (surrogate - surrogate.detach())
        loss = global_sum_with_grad(share, layout, group)

        stats = {"gamma": gamma, "epoch": self.current_epoch()}
        if update:
            tau_grad = None
            if self.individual:
                g1_tau, g2_tau = self._individual_tau_grads(q1, k, row1, pos1, k2, q, row2, pos2,
                                                           le1, le2, w1, w2, opts)
                extra = torch.stack([g1_tau, g2_tau], dim=1)
            else:
                extra = None
                if self.learnable:
                    tau_grad = self._global_tau_grad(weighted, scale_t, tau_now, mean_le, group,
                                                     layout.world)
            self._commit(idx_state, lu1, lu2, extra, layout, group)
            if tau_grad is not None:
                self._step_global_tau(tau_grad)
                stats["tau_grad"] = tau_grad
            if self.individual:
                stats["tau_grad_local"] = extra.detach().cpu()
            self.num_updates += 1
        stats["temperature"] = self.temperature
        stats["mean_log_g"] = float(0.5 * (log_g1.detach().mean() + log_g2.detach().mean())) if q.shape[0] else 0.0
        self.last_stats = stats
        return loss

    # ---- pieces of forward --------------------------------------------------------------------

    def _input_error(self, q, k, sample_index, labels, allow_empty) -> Optional[str]:
        """The message of the first problem with this rank's inputs, or ``None``."""
        try:
            check_features(q, k, check_finite=True, allow_empty=allow_empty)
        except ValueError as err:
            return str(err)
        if not torch.is_tensor(sample_index) or sample_index.dim() != 1:
            return "sample_index must be a 1-D tensor of global sample indices"
        if sample_index.dtype.is_floating_point or sample_index.dtype == torch.bool:
            return f"sample_index must be an integer tensor, got {sample_index.dtype}"
        if sample_index.shape[0] != q.shape[0] or k.shape[0] != q.shape[0]:
            return (
                f"FastCLIPLoss needs one sample index per image-text pair: got {q.shape[0]} "
                f"images, {k.shape[0]} texts, {sample_index.shape[0]} indices"
            )
        if sample_index.numel():
            lo, hi = int(sample_index.min()), int(sample_index.max())
            if lo < 0 or hi >= self.num_samples:
                return f"sample_index out of range [0, {self.num_samples}): min {lo}, max {hi}"
        if labels is not None:
            diag = torch.arange(q.shape[0], device=labels.device)
            if labels.shape != diag.shape or not torch.equal(labels.long(), diag):
                return ("FastCLIPLoss contrasts image-text pairs: labels must be None or "
                        "arange(b) (no hard negatives)")
        return None

    def _global_tau_grad(self, weighted, scale_t, tau_now, mean_le, group, world) -> float:
        """d/dtau of the objective's estimator (v0: Eq. 8, v3: Eq. 10), summed over ranks."""
        with torch.enable_grad():
            (ds,) = torch.autograd.grad(weighted, scale_t, retain_graph=True)
        parts = torch.stack([ds.reshape(()).detach().double(), mean_le.detach().double()])
        if world > 1:
            parts = parts.to(comm_device(group, parts.device))
            dist.all_reduce(parts, group=group)
        d_scale, total_mean_le = float(parts[0]), float(parts[1])
        tau = float(tau_now)
        d_weighted_dtau = -d_scale / (tau * tau)  # scale = 1 / tau
        if self.loss_kind == "gcl":  # v0: gradient of the unscaled GCL
            return d_weighted_dtau
        return total_mean_le + 2 * self.rho + tau * d_weighted_dtau  # v3

    def _individual_tau_grads(self, q1, k, row1, pos1, k2, q, row2, pos2, le1, le2, w1, w2, opts):
        """Per-sample Eq. (9): ``log(eps + u) + rho - w (E_P[x'] - x'_ii)`` for both directions.

        ``E_P[x'_ij] = q'_i . sum_j P_ij k_j`` and ``sum_j P_ij k_j`` is the gradient of
        ``sum_i row_lse_i`` with respect to the (temperature-scaled) row features: one extra
        backward of the op per direction (collective on every rank, like the forward).
        """
        from ds_infcl.loss.functional import lse

        grads = []
        for rows_in, cols_in, row, pos, le, w in ((q1, k, row1, pos1, le1, w1),
                                                  (k2, q, row2, pos2, le2, w2)):
            with torch.enable_grad():
                if row.requires_grad and rows_in.requires_grad:
                    (d_rows,) = torch.autograd.grad(row.sum(), rows_in, retain_graph=True)
                else:
                    r = rows_in.detach().requires_grad_(True)
                    row_d, _ = lse(r, cols_in.detach(), 1.0, compute_col=False, **opts)
                    (d_rows,) = torch.autograd.grad(row_d.sum(), r)
                    rows_in = r
            expected = (rows_in.detach().float() * d_rows.float()).sum(dim=1)
            grads.append((le + self.rho - w * (expected - pos.detach())).float())
        return grads[0], grads[1]

    @torch.no_grad()
    def _commit(self, idx, lu1, lu2, extra, layout, group):
        """Replicate the batch's new state on every rank and apply it (same ops everywhere)."""
        cols = [idx.to(lu1.device).double()[:, None], lu1.double()[:, None], lu2.double()[:, None]]
        if extra is not None:
            cols.append(extra.double())
        payload = torch.cat(cols, dim=1)
        if layout.world > 1:
            payload = payload.to(comm_device(group, payload.device))
            payload = all_gather_nograd(payload, layout.query_sizes, group)
        payload = payload.to(self.log_u1.device)
        gidx = payload[:, 0].round().long()
        if torch.unique(gidx).numel() != gidx.numel():
            # A sample twice in one global batch (a shuffle buffer spanning an epoch boundary):
            # its first occurrence in rank order updates the state, the same on every rank.
            order = torch.argsort(gidx, stable=True)
            sorted_idx = gidx[order]
            first = torch.ones_like(sorted_idx, dtype=torch.bool)
            first[1:] = sorted_idx[1:] != sorted_idx[:-1]
            keep = order[first]
            payload, gidx = payload[keep], gidx[keep]
        self.log_u1[gidx] = payload[:, 1].float()
        self.log_u2[gidx] = payload[:, 2].float()
        if extra is not None:
            lr = self.current_temperature_lr()
            count = self.tau_count_i[gidx]
            for d, (tau, m, v) in enumerate(((self.tau1, self.tau1_m, self.tau1_v),
                                             (self.tau2, self.tau2_m, self.tau2_v))):
                t, mm, vv, cc = tau[gidx], m[gidx], v[gidx], count.clone()
                _optimizer_step(t, payload[:, 3 + d].float(), mm, vv, cc,
                                kind=self.temperature_optimizer, lr=lr, betas=self.betas,
                                adam_eps=self.adam_eps, momentum=self.momentum)
                tau[gidx] = t.clamp_(self.min_temperature, self.max_temperature)
                m[gidx], v[gidx] = mm, vv
            self.tau_count_i[gidx] = count + 1

    @torch.no_grad()
    def _step_global_tau(self, grad: float) -> None:
        lr = self.current_temperature_lr()
        g = torch.tensor(grad, dtype=_F32, device=self.tau.device)
        tau = self.tau.clone()
        _optimizer_step(tau, g, self.tau_m, self.tau_v, self.tau_count,
                        kind=self.temperature_optimizer, lr=lr, betas=self.betas,
                        adam_eps=self.adam_eps, momentum=self.momentum)
        self.tau.copy_(tau.clamp(self.min_temperature, self.max_temperature))
        if self.lr_decay_threshold is not None and float(self.tau) < self.lr_decay_threshold:
            self.tau_lr_decayed.fill_(True)

    def extra_repr(self) -> str:
        return (
            f"version={self.version!r}, num_samples={self.num_samples}, "
            f"gamma_schedule={self.gamma_schedule!r}, eps={self.eps:g}, rho={self.rho:g}, "
            f"temperature={self.temperature:.4f}, temperature_lr={self.temperature_lr:g}"
        )


# --------------------------------------------------------------------------------------------
# Registry of names the run config selects
# --------------------------------------------------------------------------------------------


def available_fastclip_losses() -> Tuple[str, ...]:
    """Names accepted by :func:`build_fastclip_loss`, sorted."""
    return tuple(sorted(_NAMES))


def build_fastclip_loss(name: str, num_samples: int, **kwargs) -> FastCLIPLoss:
    """``FastCLIPLoss`` by registry name (``fastclip_v0`` .. ``fastclip_v3``, ``sogclr``,
    ``isogclr``); ``kwargs`` override the name's settings (see ``FastCLIPLoss``)."""
    if name not in _NAMES:
        raise ValueError(f"unknown FastCLIP loss {name!r}; choose one of {available_fastclip_losses()}")
    settings = dict(_NAMES[name])
    settings.update(kwargs)
    return FastCLIPLoss(num_samples, **settings)



def fastclip_num_samples(settings: LossSettings) -> int:
    """``num_samples`` of a FastCLIP loss: ``loss.args.num_samples`` checked against the task's
    ``sample_index_bound()``, or that bound when the config leaves it out.

    Raises:
        ConfigError: the given value is below what the data's indices need (the message says which
            value to set), or neither the config nor the task gives one.
    """
    from ds_infcl.errors import ConfigError

    given = (settings.config.get("args") or {}).get("num_samples")
    bound = settings.sample_index_bound() if settings.sample_index_bound is not None else None
    if given is None:
        if bound is None:
            raise ConfigError(
                f"loss.args.num_samples: loss.impl {settings.impl!r} keeps state per sample index and "
                f"task {settings.owner!r} cannot tell how many there are; set it "
                "to one more than the largest global sample index of the training data"
            )
        return int(bound)
    if bound is not None and given < bound:
        raise ConfigError(
            f"loss.args.num_samples: {given} is too small for this data: its global sample indices run up to "
            f"{bound - 1} (they number the whole data set, held-out samples included); set "
            f"loss.args.num_samples to {bound} or leave it out to take it from the data"
        )
    return int(given)


def _build_from_settings(settings: LossSettings) -> FastCLIPLoss:
    """``loss.impl: <FastCLIP name>``: ``build_fastclip_loss`` with ``loss.args``; the task's
    InfoNCE defaults do not apply."""
    args = dict(settings.config.get("args") or {})
    args["num_samples"] = fastclip_num_samples(settings)
    return build_fastclip_loss(settings.impl, **settings.placement(), **args)


for _name in _NAMES:
    register_loss_module(_name, _build_from_settings, check=fastclip_num_samples, features=("directed", "args", "run_config"))


from ds_infcl.loss.fastclip_reference import fastclip_reference  # noqa: E402 (its tests import it from here)
