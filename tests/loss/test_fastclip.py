"""FastCLIP's global losses (ds_infcl.loss.fastclip) against fp64 materialized computations:
log g and the u estimator (also where exp overflows float32), the gamma schedule table, the
gradients of every version (features and temperatures), the temperature update rules, state
casting and checkpoint/resume, the registry and input errors. Single process; the multi-rank
tests are in test_fastclip_dist.py."""

from __future__ import annotations

import math

import pytest
import torch

from ds_infcl.loss.fastclip import (
    FastCLIPLoss,
    available_fastclip_losses,
    build_fastclip_loss,
    fastclip_reference,
    inner_lr,
    log_eps_plus,
    log_inner,
    update_log_u,
)
from ds_infcl.ops.reference import lse_reference

VERSIONS = ("v0", "v1", "v2", "v3")


def _pairs(n, c, seed, normalize=True, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, c, generator=g), torch.randn(n, c, generator=g)
    if normalize:
        q, k = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(k, dim=1)
    return q * spread, k * spread


def _close(got, ref, rel, what):
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    scale = max(ref.abs().max().item(), 1e-6)
    err = (got - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel:.1e} * {scale:.3g}"


def _direct_log_g(q, k, tau):
    """fp64, materialized, direct exp (no max shift): log g1 (rows) and log g2 (columns)."""
    q, k = q.double(), k.double()
    n = q.shape[0]
    sim = q @ k.T
    off = ~torch.eye(n, dtype=torch.bool)
    g1 = (torch.exp((sim - sim.diagonal()[:, None]) / tau) * off).sum(1) / (n - 1)
    g2 = (torch.exp((sim - sim.diagonal()[None, :]) / tau) * off).sum(0) / (n - 1)
    return g1.log(), g2.log()


# ---- the gamma schedule -----------------------------------------------------------------------


def test_inner_lr_table():
    cos = dict(schedule="cosine", gamma_min=0.2, decay_epochs=18)
    assert inner_lr(0, **cos) == 1.0
    assert inner_lr(9, **cos) == pytest.approx(0.6, abs=1e-12)  # half way: (1 + 0.2) / 2
    assert inner_lr(18, **cos) == pytest.approx(0.2, abs=1e-12)
    assert inner_lr(30, **cos) == pytest.approx(0.2, abs=1e-12)  # constant after E
    # E = 4, gamma_min = 0.6 (the large-scale v2 values shape): 0.5 (1 + cos(pi e / 4)) 0.4 + 0.6
    table = [inner_lr(e, schedule="cosine", gamma_min=0.6, decay_epochs=4) for e in range(7)]
    expected = [1.0, 0.9414213562373095, 0.8, 0.6585786437626905, 0.6, 0.6, 0.6]
    assert table == pytest.approx(expected, abs=1e-12)
    assert all(a >= b for a, b in zip(table, table[1:]))
    assert inner_lr(0, schedule="constant", gamma=0.6) == 0.6
    assert inner_lr(50, schedule="constant", gamma=0.8) == 0.8
    with pytest.raises(ValueError, match="cosine"):
        inner_lr(0, schedule="linear")


def test_module_gamma_follows_epochs():
    m = FastCLIPLoss(10, version="v3", gamma_decay_epochs=4, gamma_min=0.2, steps_per_epoch=2,
                     backend="torch")
    q, k = _pairs(4, 6, 0)
    seen = []
    for step in range(6):
        m(q, k, torch.arange(4) + (step % 2) * 4)
        seen.append(m.last_stats["gamma"])
    assert seen[:2] == [1.0, 1.0]
    assert seen[2] == pytest.approx(inner_lr(1, gamma_min=0.2, decay_epochs=4))
    assert seen[4] == pytest.approx(inner_lr(2, gamma_min=0.2, decay_epochs=4))
    sog = build_fastclip_loss("sogclr", 10, backend="torch")
    assert sog.current_gamma(0) == 0.6 and sog.current_gamma(7) == 0.6


# ---- log g and u against fp64 -----------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.07, 0.01])
def test_log_g_and_u_match_fp64_also_past_fp32_overflow(tau):
    # Unnormalized features: similarity gaps up to ~20, so (s_ij - s_ii) / tau reaches ~2000 and
    # exp() is inf in float32 (and in float64 past ~709 at tau = 0.01).
    n, c = 9, 7
    q, k = _pairs(n, c, 1, normalize=False, spread=1.5)
    row, col = lse_reference(q.double(), k.double(), 1.0 / tau, exclude_positive=True)
    pos = (q.double() * k.double()).sum(1) / tau
    ref1, ref2 = log_inner(row, pos, n), log_inner(col, pos, n)  # fp64 LSE (max-shifted)
    x_max = ((q @ k.T) - (q * k).sum(1)[:, None]).max().item() / tau
    assert x_max > 88 and torch.isinf(torch.exp(torch.tensor(x_max, dtype=torch.float32)))
    if x_max < 700:  # fp64 direct exp still finite: check the LSE form against it too
        d1, d2 = _direct_log_g(q, k, tau)
        _close(ref1, d1, 1e-12, "fp64 lse vs direct exp, rows")
        _close(ref2, d2, 1e-12, "fp64 lse vs direct exp, cols")

    m = FastCLIPLoss(20, version="v1", init_temperature=tau, min_temperature=tau, backend="torch",
                     tile_size=4)
    idx = torch.tensor([5, 17, 2, 9, 0, 11, 3, 8, 19])
    m(q, k, idx)  # epoch 0: gamma = 1, u = g
    assert torch.isfinite(m.log_u1[idx]).all() and torch.isfinite(m.log_u2[idx]).all()
    _close(m.log_u1[idx], ref1, 1e-5, "log u1 = log g1")
    _close(m.log_u2[idx], ref2, 1e-5, "log u2 = log g2")
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[idx] = False
    assert torch.isneginf(m.log_u1[untouched]).all()

    # Second step with gamma < 1 on new features: log((1 - gamma) u + gamma g) in fp64.
    q2, k2 = _pairs(n, c, 2, normalize=False, spread=1.5)
    row2, col2 = lse_reference(q2.double(), k2.double(), 1.0 / tau, exclude_positive=True)
    pos2 = (q2.double() * k2.double()).sum(1) / tau
    gamma = m.current_gamma(3)
    m(q2, k2, idx, epoch=3)
    for state, old, new_lse in ((m.log_u1, ref1, row2), (m.log_u2, ref2, col2)):
        new = log_inner(new_lse, pos2, n)
        expected = torch.logaddexp(old + math.log(1 - gamma), new + math.log(gamma))
        _close(state[idx], expected, 1e-5, "log u after a gamma < 1 step")


def test_update_log_u_and_log_eps_plus():
    g = torch.Generator().manual_seed(3)
    log_u = torch.randn(50, generator=g, dtype=torch.float64) * 300  # u from 1e-130 to 1e+130
    log_g = torch.randn(50, generator=g, dtype=torch.float64) * 300
    log_u[:5] = float("-inf")  # never seen: u = g
    for gamma in (1.0, 0.8, 0.2):
        got = update_log_u(log_u, log_g, gamma)
        # Reference in exact arithmetic via Python floats scaled by a common max.
        ref = []
        for a, b in zip(log_u.tolist(), log_g.tolist()):
            if a == float("-inf") or gamma == 1.0:
                ref.append(b)
                continue
            top = max(a, b)
            ref.append(top + math.log((1 - gamma) * math.exp(a - top) + gamma * math.exp(b - top)))
        _close(got, torch.tensor(ref, dtype=torch.float64), 1e-14, f"update_log_u gamma={gamma}")
    eps = 1e-14
    le = log_eps_plus(log_u, eps)
    ref = [math.log(eps) if a == float("-inf") else max(a, math.log(eps))
           + math.log1p(math.exp(-abs(a - math.log(eps)))) for a in log_u.tolist()]
    _close(le, torch.tensor(ref, dtype=torch.float64), 1e-14, "log(eps + u)")


# ---- gradients of every version ----------------------------------------------------------------


def _stated_objective(version, q, k, tau, eps, rho):
    """The stated objectives on the mini-batch, fp64 autograd, g by direct exp (with gamma = 1,
    u = g and the FCCO estimator equals their exact gradient)."""
    n = q.shape[0]
    sim = q @ k.T
    diag = sim.diagonal()
    off = ~torch.eye(n, dtype=torch.bool)
    if version == "v2":
        t1, t2 = tau
        g1 = (torch.exp((sim - diag[:, None]) / t1[:, None]) * off).sum(1) / (n - 1)
        g2 = (torch.exp((sim - diag[None, :]) / t2[None, :]) * off).sum(0) / (n - 1)
        return ((t1 * (torch.log(eps + g1) + rho)).sum() + (t2 * (torch.log(eps + g2) + rho)).sum()) / n
    g1 = (torch.exp((sim - diag[:, None]) / tau) * off).sum(1) / (n - 1)
    g2 = (torch.exp((sim - diag[None, :]) / tau) * off).sum(0) / (n - 1)
    mean_log = (torch.log(eps + g1).sum() + torch.log(eps + g2).sum()) / n
    if version == "v0":
        return mean_log
    if version == "v1":
        return tau * mean_log
    return tau * mean_log + 2 * rho * tau


def _snapshot_tau(m, idx, version):
    if version == "v2":
        return (m.tau1[idx].double().clone().requires_grad_(True),
                m.tau2[idx].double().clone().requires_grad_(True))
    return m.tau.double().clone().requires_grad_(version in ("v0", "v3"))


@pytest.mark.parametrize("version", VERSIONS)
def test_gradients_equal_autograd_of_stated_objective_at_gamma_one(version):
    n, c = 7, 5
    q, k = _pairs(n, c, 4)
    m = FastCLIPLoss(11, version=version, backend="torch", tile_size=3)
    idx = torch.tensor([3, 0, 9, 4, 7, 1, 10])
    tau = _snapshot_tau(m, idx, version)
    qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    loss = m(qq, kk, idx)  # epoch 0: gamma = 1
    loss.backward()
    qd, kd = q.double().requires_grad_(True), k.double().requires_grad_(True)
    obj = _stated_objective(version, qd, kd, tau, m.eps, m.rho)
    obj.backward()
    _close(loss.item(), obj.item(), 2e-6, "loss value")
    _close(qq.grad, qd.grad, 2e-5, "d/d image features")
    _close(kk.grad, kd.grad, 2e-5, "d/d text features")
    if version in ("v0", "v3"):
        _close(m.last_stats["tau_grad"], tau.grad, 2e-5, "d/d tau")
    if version == "v2":  # per sample: the gradient of sample i's own term (n x the mean's)
        got = m.last_stats["tau_grad_local"]
        _close(got[:, 0], tau[0].grad * n, 2e-5, "d/d tau1_i")
        _close(got[:, 1], tau[1].grad * n, 2e-5, "d/d tau2_i")


@pytest.mark.parametrize("version", VERSIONS)
def test_gradients_with_running_u_match_fp64_reference(version):
    """Three steps (epochs 0, 2, 5: gamma 1 then < 1) over overlapping index sets; each step's
    gradients, temperature gradients and u state against the fp64 materialized reference."""
    n, c = 6, 8
    m = FastCLIPLoss(9, version=version, backend="torch", tile_size=4, gamma_decay_epochs=6,
                     eps=1e-6)
    batches = [torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([8, 2, 6, 0, 7, 4]),
               torch.tensor([5, 3, 1, 8, 6, 2])]
    for step, (epoch, idx) in enumerate(zip((0, 2, 5), batches)):
        q, k = _pairs(n, c, 10 + step)
        tau = _snapshot_tau(m, idx, version)
        lu1, lu2 = m.log_u1[idx].double().clone(), m.log_u2[idx].double().clone()
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        loss = m(qq, kk, idx, epoch=epoch)
        loss.backward()
        qd, kd = q.double().requires_grad_(True), k.double().requires_grad_(True)
        ref = fastclip_reference(qd, kd, version=version, tau=tau, log_u1_old=lu1, log_u2_old=lu2,
                                 gamma=m.current_gamma(epoch), eps=m.eps, rho=m.rho)
        what = f"{version} step {step}"
        _close(loss.item(), ref["value"].item(), 2e-6, f"{what}: loss value")
        _close(m.log_u1[idx], ref["u1"].log(), 2e-5, f"{what}: log u1")
        _close(m.log_u2[idx], ref["u2"].log(), 2e-5, f"{what}: log u2")
        if version == "v2":
            (dt1, dt2) = torch.autograd.grad(ref["tau_objective"], tau, retain_graph=True)
            got = m.last_stats["tau_grad_local"]
            _close(got[:, 0], dt1, 2e-5, f"{what}: d/d tau1_i")
            _close(got[:, 1], dt2, 2e-5, f"{what}: d/d tau2_i")
        elif version in ("v0", "v3"):
            (dt,) = torch.autograd.grad(ref["model_objective"], tau, retain_graph=True)
            _close(m.last_stats["tau_grad"], dt, 2e-5, f"{what}: d/d tau")
        gq, gk = torch.autograd.grad(ref["model_objective"], [qd, kd])
        _close(qq.grad, gq, 2e-5, f"{what}: d/d image features")
        _close(kk.grad, gk, 2e-5, f"{what}: d/d text features")


def test_bf16_features_follow_fp32():
    q, k = _pairs(10, 16, 5)
    idx = torch.arange(10)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = FastCLIPLoss(10, version="v3", backend="torch", tile_size=4)
        qq = q.to(dtype).detach().clone().requires_grad_(True)
        kk = k.to(dtype).detach().clone().requires_grad_(True)
        m(qq, kk, idx).backward()
        grads[dtype] = (qq.grad.float(), m.last_stats["tau_grad"], m.log_u1.clone())
    _close(grads[torch.bfloat16][0], grads[torch.float32][0], 3e-2, "bf16 feature grads")
    _close(grads[torch.bfloat16][1], grads[torch.float32][1], 3e-2, "bf16 tau grad")
    assert m.log_u1.dtype == torch.float32


# ---- temperature updates ------------------------------------------------------------------------


def test_v3_adamw_step_lr_decay_and_clamp():
    q, k = _pairs(6, 5, 6)
    idx = torch.arange(6)
    m = FastCLIPLoss(6, version="v3", init_temperature=0.0305, temperature_lr=1e-3,
                     backend="torch")
    tau0 = m.temperature
    m(q, k, idx)
    grad = m.last_stats["tau_grad"]
    # First AdamW step (bias-corrected): tau - lr * g / (|g| + eps).
    expected = tau0 - 1e-3 * grad / (abs(grad) + 1e-8)
    assert m.temperature == pytest.approx(expected, rel=1e-6)
    assert grad > 0 and m.temperature < 0.03  # rho = 6.5 pushes tau down
    assert bool(m.tau_lr_decayed) and m.current_temperature_lr() == pytest.approx(1e-3 / 3)
    m2 = FastCLIPLoss(6, version="v3", init_temperature=0.0105, temperature_lr=0.1,
                      backend="torch")
    m2(q, k, idx)
    assert m2.temperature == pytest.approx(0.01)  # clamped at min_temperature
    v1 = FastCLIPLoss(6, version="v1", backend="torch")
    v1(q, k, idx)
    assert v1.temperature == pytest.approx(0.03) and "tau_grad" not in v1.last_stats


@pytest.mark.parametrize("kind", ["lion", "sgdm"])
def test_other_temperature_optimizers(kind):
    q, k = _pairs(6, 5, 7)
    m = FastCLIPLoss(6, version="v0", temperature_optimizer=kind, temperature_lr=1e-4,
                     backend="torch")
    m(q, k, torch.arange(6))
    grad = m.last_stats["tau_grad"]
    step = 1e-4 * (math.copysign(1.0, grad) if kind == "lion" else grad)
    assert m.temperature == pytest.approx(max(0.03 - step, 0.01), rel=1e-6)


def test_v2_individual_temperatures_update_only_batch_and_respect_clamps():
    q, k = _pairs(5, 6, 8, normalize=False, spread=3.0)
    m = FastCLIPLoss(12, version="v2", temperature_lr=0.5, backend="torch")  # huge lr: hits clamps
    idx = torch.tensor([1, 4, 7, 10, 11])
    m(q, k, idx)
    other = torch.tensor([0, 2, 3, 5, 6, 8, 9])
    assert torch.all(m.tau1[other] == 0.03) and torch.all(m.tau2[other] == 0.03)
    assert torch.all(m.tau_count_i[idx] == 1) and torch.all(m.tau_count_i[other] == 0)
    for t in (m.tau1[idx], m.tau2[idx]):
        assert torch.all((t >= 0.005) & (t <= 0.05))
        assert torch.all(t != 0.03)
    # One AdamW step per sample: tau - lr * sign(g) (then clamped).
    g = m.last_stats["tau_grad_local"]
    expected = (0.03 - 0.5 * g[:, 0] / (g[:, 0].abs() + 1e-8)).clamp(0.005, 0.05)
    _close(m.tau1[idx], expected, 1e-6, "tau1 after one step")


# ---- state: casting, checkpoint/resume -----------------------------------------------------------


def test_state_stays_fp32_when_module_is_cast():
    m = FastCLIPLoss(8, version="v2", backend="torch")
    m.bfloat16()
    for name in ("log_u1", "tau", "tau1", "tau1_m", "tau_count_i"):
        assert getattr(m, name).dtype == torch.float32, name
    m_cpu = FastCLIPLoss(8, version="v3", state_device="cpu", backend="torch").half()
    assert m_cpu.log_u1.dtype == torch.float32 and m_cpu.log_u1.device.type == "cpu"


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_checkpoint_resume_restores_state_exactly(version):
    def run(module, steps):
        out = []
        for step in steps:
            q, k = _pairs(6, 5, 20 + step)
            qq = q.clone().requires_grad_(True)
            idx = torch.randperm(10, generator=torch.Generator().manual_seed(step))[:6]
            loss = module(qq, k, idx)
            loss.backward()
            out.append((loss.item(), qq.grad.clone()))
        return out

    kwargs = dict(version=version, backend="torch", steps_per_epoch=2, gamma_decay_epochs=3)
    a = FastCLIPLoss(10, **kwargs)
    run(a, [0, 1, 2])
    saved = {n: t.clone() for n, t in a.state_dict().items()}
    b = FastCLIPLoss(10, **kwargs)
    b.load_state_dict(saved)
    for name, t in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], t), name
    after_a, after_b = run(a, [3, 4]), run(b, [3, 4])
    for (la, ga), (lb, gb) in zip(after_a, after_b):
        assert la == lb and torch.equal(ga, gb)
    for name, t in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], t), name
    assert int(b.num_updates) == 5 and b.current_epoch() == 2


# ---- registry and errors --------------------------------------------------------------------------


def test_registry_names():
    assert available_fastclip_losses() == (
        "fastclip_v0", "fastclip_v1", "fastclip_v2", "fastclip_v3", "isogclr", "sogclr",
    )
    iso = build_fastclip_loss("isogclr", 5, backend="torch")
    assert iso.version == "v2" and iso.gamma_schedule == "constant" and iso.current_gamma(0) == 0.6
    v3 = build_fastclip_loss("fastclip_v3", 5, rho=8.5)
    assert v3.rho == 8.5 and v3.temperature == pytest.approx(0.07)
    with pytest.raises(ValueError, match="fastclip_v3"):
        build_fastclip_loss("fastclip_v9", 5)


def test_input_errors():
    m = FastCLIPLoss(10, version="v3", backend="torch")
    q, k = _pairs(4, 5, 9)
    with pytest.raises(ValueError, match="out of range"):
        m(q, k, torch.tensor([1, 2, 3, 10]))
    with pytest.raises(ValueError, match="one sample index per"):
        m(q, k[:3], torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="integer"):
        m(q, k, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match="at least 2"):
        m(q[:1], k[:1], torch.tensor([0]))
    with pytest.raises(ValueError, match="non-finite|NaN|Inf"):
        m(q * float("nan"), k, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="version"):
        FastCLIPLoss(10, version="v4")
    with pytest.raises(ValueError, match="temperature_optimizer"):
        FastCLIPLoss(10, temperature_optimizer="adam")


def test_trainer_contract_labels_logit_scale_and_no_update():
    """What the DeepSpeed trainer relies on: ``forward(q, k, labels=..., sample_index=...)``,
    a ``group`` attribute, ``logit_scale`` (not a parameter), and an evaluation forward that
    changes nothing."""
    m = FastCLIPLoss(10, version="v3", backend="torch")
    q, k = _pairs(4, 5, 11)
    idx = torch.tensor([2, 5, 7, 9])
    assert not isinstance(m.logit_scale, torch.nn.Parameter) and hasattr(m, "group")
    assert m.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    before = {n: t.clone() for n, t in m.state_dict().items()}
    loss_eval = m(q, k, labels=torch.arange(4), sample_index=idx, update=False)
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), n
    loss = m(q, k, labels=torch.arange(4), sample_index=idx)
    assert loss.item() == pytest.approx(loss_eval.item())
    assert m.logit_scale.item() == pytest.approx(-math.log(m.temperature))
    with pytest.raises(ValueError, match="labels"):
        m(q, k, labels=torch.tensor([1, 0, 2, 3]), sample_index=idx)
    with pytest.raises(ValueError, match="sample_index"):
        m(q, k)


def test_duplicate_index_in_a_batch_updates_from_first_occurrence():
    q, k = _pairs(5, 6, 12)
    m = FastCLIPLoss(10, version="v2", backend="torch")
    m(q, k, torch.tensor([4, 1, 4, 7, 1]))
    ref = FastCLIPLoss(10, version="v2", backend="torch")
    ref(q, k, torch.tensor([4, 1, 8, 7, 9]))  # same rows; the repeats go to unused indices
    for name in ("log_u1", "log_u2", "tau1", "tau2"):
        got, want = getattr(m, name), getattr(ref, name)
        assert torch.equal(got[[4, 1, 7]], want[[4, 1, 7]]), name
