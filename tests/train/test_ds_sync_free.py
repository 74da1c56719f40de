"""``ds_infcl.train.ds_sync_free``: its versions of DeepSpeed's gradient-norm mask and ZeRO-1/2
clip give the originals' bits on every kind of norm, and they do it without a host read. A whole
ZeRO-1 and ZeRO-2 run with clipping gives the same losses and weights with them as without
(``DS_INFCL_SYNC_FREE=0``).

There is no GPU here, so a host read is found by the operator that would cause it on one
(``HostReads``): ``.item()``/``bool()`` of a tensor (``_local_scalar_dense``), a tensor made from
host data (``lift_fresh``: a pageable copy to the GPU), and ``masked_fill_`` with a tensor value
(read on the host). ``tests/gpu/test_step_syncs_gpu.py`` counts the real waits on a GPU.
"""

import math
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepspeed
import deepspeed.runtime.utils as ds_utils
from deepspeed.runtime.zero import stage3, stage_1_and_2
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ds_infcl.train import ds_sync_free
from tests.train import harness as h

MASK, CLIP = "mask_nan_or_inf_with_val_inplace", "unscale_and_clip_grads"
NORM, COUNT = "get_grad_norm_direct", "count_used_parameters_in_backward"
PLACES = [(ds_utils, MASK), (stage_1_and_2, MASK), (stage3, MASK), (DeepSpeedZeroOptimizer, CLIP),
          (DeepSpeedZeroOptimizer, NORM), (stage_1_and_2, COUNT)]


def _original(owner, name):
    """DeepSpeed's own function, also where this process installed the replacement earlier."""
    fn = ds_sync_free._originals.get((owner, name), vars(owner)[name])
    assert "deepspeed" in pathlib.Path(fn.__code__.co_filename).parts, fn
    return fn


ORIGINAL_MASK = _original(ds_utils, MASK)
ORIGINAL_CLIP = _original(DeepSpeedZeroOptimizer, CLIP)
ORIGINAL_NORM = _original(DeepSpeedZeroOptimizer, NORM)
ORIGINAL_COUNT = _original(stage_1_and_2, COUNT)


@pytest.fixture
def deepspeed_as_shipped(monkeypatch):
    """DeepSpeed's own functions in every place and nothing recorded as installed; whatever the
    test installs is undone after it."""
    for owner, name in PLACES:
        monkeypatch.setattr(owner, name, _original(owner, name))
    monkeypatch.setattr(ds_sync_free, "_originals", {})
    monkeypatch.delenv("DS_INFCL_SYNC_FREE", raising=False)


_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
    assert torch.equal(a.view(_INT_OF[a.dtype]), b.view(_INT_OF[a.dtype])), (a, b)


class HostReads(TorchDispatchMode):
    """The operators of the calls under it that would make the host wait for a GPU."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.lift_fresh",
                            "aten.masked_fill_.Tensor", "aten.masked_fill.Tensor")):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


# -- the mask -------------------------------------------------------------------------------------

VALUES = [2.5, math.nan, math.inf, -math.inf, -1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", VALUES + ["all"])
@pytest.mark.parametrize("device_arg", ["same", None])
def test_the_mask_gives_the_originals_bits(dtype, value, device_arg):
    x = torch.tensor(VALUES if value == "all" else value, dtype=dtype)
    device = x.device if device_arg == "same" else None
    want, got = x.clone(), x.clone()
    ORIGINAL_MASK(want, device=device)
    ds_sync_free.mask_nan_or_inf_with_val_inplace(got, device=device)
    assert_same_bits(got, want)
    assert torch.isfinite(got).all()


def test_the_mask_reads_nothing_on_the_host():
    x = torch.tensor([1.0, math.nan, math.inf])
    with HostReads() as original:
        ORIGINAL_MASK(x.clone(), device=x.device)
    with HostReads() as replaced:
        ds_sync_free.mask_nan_or_inf_with_val_inplace(x.clone(), device=x.device)
    assert original.found  # the check sees the original's reads: a -1.0 from the host, a tensor fill value
    assert replaced.found == []


# -- the clip -------------------------------------------------------------------------------------


class _Optimizer:
    """What ``unscale_and_clip_grads`` reads of a ``DeepSpeedZeroOptimizer``."""

    def __init__(self, clip_grad: float, loss_scale: float):
        self.clip_grad, self.loss_scale, self.device = clip_grad, loss_scale, torch.device("cpu")


def _grads(layout: str):
    """Flat fp32 gradient partitions (``"flat"``), or a list of sub-partitions beside a flat one
    (``"sub"``); values from 1e-3 to 300, both signs, and one inf (times 0 it gives NaN)."""
    torch.manual_seed(0)
    flat = torch.randn(37) * torch.logspace(-3, 2.5, 37)
    flat[5] = math.inf
    if layout == "flat":
        return [flat, torch.randn(8)]
    return [[flat[:20].clone(), flat[20:].clone()], torch.randn(8)]


def _copy(grads):
    return [[g.clone() for g in x] if isinstance(x, list) else x.clone() for x in grads]


def _flat(grads):
    return [g for x in grads for g in (x if isinstance(x, list) else [x])]


def _norm(value: float, kind: str):
    return {"float": value, "tensor": torch.tensor(value), "tensor1": torch.tensor([value])}[kind]


def _outcome(fn, opt, grads, norm):
    """The exception type ``fn`` raised, or ``None`` (it changed ``grads`` in place)."""
    try:
        fn(opt, grads, norm)
    except Exception as e:  # noqa: BLE001 -- compared with the original's
        return type(e)
    return None


# norm * loss_scale, as DeepSpeed passes it: below the clip, above it, far above, and the invalid ones
NORMS = [0.25, 3.75, 5000.0, math.nan, math.inf, -math.inf, -1.0]


@pytest.mark.parametrize("layout", ["flat", "sub"])
@pytest.mark.parametrize("kind", ["tensor", "tensor1", "float"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_the_clip_gives_the_originals_bits(layout, kind, norm, loss_scale, clip_grad):
    opt, grads = _Optimizer(clip_grad, loss_scale), _grads(layout)
    want, got = _copy(grads), _copy(grads)
    raised = _outcome(ORIGINAL_CLIP, opt, want, _norm(norm, kind))
    # A finite Python float norm with clipping on raises in DeepSpeed too (torch.clamp of a float).
    assert _outcome(ds_sync_free.unscale_and_clip_grads, opt, got, _norm(norm, kind)) is raised
    for a, b in zip(_flat(got), _flat(want)):
        assert_same_bits(a, b)


@pytest.mark.parametrize("norm", [3.75, math.nan, -1.0])
def test_the_clip_reads_nothing_on_the_host(norm):
    opt, grads, total_norm = _Optimizer(1.0, 1024.0), _grads("sub"), torch.tensor(norm)
    with HostReads() as original:
        ORIGINAL_CLIP(opt, _copy(grads), total_norm)
    with HostReads() as replaced:
        ds_sync_free.unscale_and_clip_grads(opt, _copy(grads), total_norm)
    assert original.found  # is_invalid_grad_norm's bool()
    assert replaced.found == []


# -- the gradient norm ---------------------------------------------------------------------------


class _NormOptimizer:
    """What ``get_grad_norm_direct`` reads of a ``DeepSpeedZeroOptimizer`` (one rank: its
    all-reduces are the identity, see ``one_rank``)."""

    def __init__(self, model_parallel_rank: int = 0):
        self.model_parallel_rank, self.dp_process_group, self.device = model_parallel_rank, None, torch.device("cpu")
        self.model_parallel_group = None

    def _model_parallel_all_reduce(self, tensor, op):
        pass


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(deepspeed.comm, "all_reduce", lambda tensor, op=None, group=None, **kw: tensor)


def _norm_case(kind: str):
    """Gradients and parameters as ZeRO-1/2 pass them: fp32 views of a partition, with a padding
    gradient, a pipeline-replicated parameter and model-parallel ones; values from 1e-4 to 1e3."""
    torch.manual_seed(1)
    sizes = [1, 37, 300, 5, 1024]
    grads = [torch.randn(n) * torch.logspace(-4, 3, n) for n in sizes]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    if kind == "padding":
        pad = torch.ones(3)
        pad._zero_padding = True
        grads.insert(2, pad)  # left out of the norm, and of the pairing with the parameters
    if kind == "replicated":
        params[1].ds_pipe_replicated = True
    if kind == "model_parallel":
        params[3].model_parallel = True
    if kind == "nonfinite":
        grads[2][7] = math.nan
    if kind == "inf":
        grads[4][0] = math.inf
    if kind == "empty":
        grads, params = [], []
    return grads, params


@pytest.mark.parametrize("kind", ["plain", "padding", "replicated", "model_parallel", "nonfinite", "inf", "empty"])
@pytest.mark.parametrize("mp_rank", [0, 1])
@pytest.mark.parametrize("norm_type", [2, 2.0, math.inf])
def test_the_norm_gives_the_originals_bits(one_rank, kind, mp_rank, norm_type):
    grads, params = _norm_case(kind)
    opt = _NormOptimizer(mp_rank)
    if kind == "empty" and norm_type == math.inf:
        pytest.skip("DeepSpeed's inf norm of no gradients raises (torch.stack of nothing)")
    want = ORIGINAL_NORM(opt, grads, params, norm_type)
    got = ds_sync_free.get_grad_norm_direct(opt, grads, params, norm_type)
    assert_same_bits(got, want)


class _Ops(TorchDispatchMode):
    """The number of operators dispatched under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_norm_launches_no_kernel_per_gradient_and_reads_nothing(one_rank):
    grads, params = _norm_case("plain")
    counts = []
    for n in (1, 2):  # the same operators for twice the gradients
        with _Ops() as ops:
            ds_sync_free.get_grad_norm_direct(_NormOptimizer(), grads * n, params * n)
        counts.append(ops.count)
    assert counts[0] == counts[1], counts
    for kind in ("plain", "empty"):
        grads, params = _norm_case(kind)
        with HostReads() as replaced:
            ds_sync_free.get_grad_norm_direct(_NormOptimizer(), grads, params)
        assert replaced.found == [], kind
    with HostReads() as original:
        ORIGINAL_NORM(_NormOptimizer(), [], [])
    assert original.found  # torch.tensor(0.0).to(device): a pageable copy


# -- the count of parameters in a backward ---------------------------------------------------------


def _counts_in_backward(fns, model, params, use, dtype=torch.float32):
    """``[fn(params) for fn in fns]`` as they run inside one backward of a loss made from the
    layers ``use``."""
    seen = []
    x = torch.randn(4, 8, dtype=dtype)
    out = sum(model[i](x).sum() for i in use)
    out.register_hook(lambda g: seen.append([fn(params) for fn in fns]))
    out.backward()
    return seen[0]


def test_the_count_is_the_originals_across_backwards(monkeypatch):
    """The same count as DeepSpeed's for different subsets of used layers, frozen and repeated
    parameters, and again after ``param.data`` changes dtype (torch makes a new accumulator then)."""
    monkeypatch.setattr(ds_sync_free, "_GRAD_NODES", ds_sync_free.WeakIdKeyDictionary())
    model = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    model[3].bias.requires_grad_(False)
    params = list(model.parameters()) + [model[0].weight, "not a tensor"]
    both = (ORIGINAL_COUNT, ds_sync_free.count_used_parameters_in_backward)
    for use in ([0, 1, 2, 3], [1], [0, 3], [2, 2], [0, 1, 2, 3]):
        want, got = _counts_in_backward(both[::-1], model, params, use)[::-1]  # ours first: it fills the cache
        assert got == want == 2 * len(set(use)) - (3 in use), use
    assert len(ds_sync_free._GRAD_NODES) == 7  # every leaf that requires a gradient, kept once
    model.double()  # param.data of another dtype: new accumulators
    kept = {id(p): ds_sync_free._GRAD_NODES[p][0] for p in model.parameters() if p.requires_grad}
    for use in ([0, 1], [0, 1, 2, 3]):
        want, got = _counts_in_backward(both, model, params, use, torch.float64)
        assert got == want == 2 * len(use) - (3 in use), use
    assert all(ds_sync_free._GRAD_NODES[p][0] is not kept[id(p)] for p in model.parameters() if p.requires_grad)


def test_the_count_outside_a_backward_raises_as_the_original():
    params = list(torch.nn.Linear(2, 2).parameters())
    for fn in (ORIGINAL_COUNT, ds_sync_free.count_used_parameters_in_backward):
        with pytest.raises(RuntimeError, match="during backward"):
            fn(params)


# -- install --------------------------------------------------------------------------------------


def test_install_replaces_every_binding_once(deepspeed_as_shipped):
    lines = []
    assert ds_sync_free.install(lines.append) and ds_sync_free.install(lines.append)
    for owner, name in PLACES:
        assert vars(owner)[name] is getattr(ds_sync_free, name), (owner, name)
    assert len(lines) == 1 and f"DeepSpeed {deepspeed.__version__}: " in lines[0] and "left as is" not in lines[0]
    assert ds_sync_free._originals[(DeepSpeedZeroOptimizer, CLIP)] is ORIGINAL_CLIP


def test_install_is_off_with_the_setting(deepspeed_as_shipped, monkeypatch):
    assert ds_sync_free.install()
    monkeypatch.setenv("DS_INFCL_SYNC_FREE", "0")
    lines = []
    assert not ds_sync_free.install(lines.append)
    for owner, name in PLACES:
        assert vars(owner)[name] is _original(owner, name)
    assert "DS_INFCL_SYNC_FREE=0" in lines[0] and not ds_sync_free.installed()


def test_another_deepspeed_version_is_left_as_is(deepspeed_as_shipped, monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    lines = []
    assert not ds_sync_free.install(lines.append)
    assert lines == ["DeepSpeed 0.20.0 left as is: train/ds_sync_free.py replaces the gradient-norm code of "
                     "DeepSpeed 0.19.x only (its host waits stay)"]
    assert all(vars(owner)[name] is _original(owner, name) for owner, name in PLACES)


def test_code_not_known_is_left_as_is(deepspeed_as_shipped, monkeypatch):
    """A 0.19 release whose clip is other code (the earlier ones have no check of the norm) keeps
    its clip; the mask, the same text since 0.19.0, is still replaced."""
    monkeypatch.setitem(ds_sync_free.KNOWN_SOURCES, CLIP, "0" * 16)
    lines = []
    assert ds_sync_free.install(lines.append)
    assert vars(DeepSpeedZeroOptimizer)[CLIP] is ORIGINAL_CLIP and ds_utils.mask_nan_or_inf_with_val_inplace is \
        ds_sync_free.mask_nan_or_inf_with_val_inplace
    assert lines[0].endswith("left as is, not the known code: unscale_and_clip_grads")
    assert vars(DeepSpeedZeroOptimizer)[NORM] is ds_sync_free.get_grad_norm_direct


# -- whole runs -----------------------------------------------------------------------------------


def test_zero1_and_zero2_runs_are_the_same_with_and_without(tmp_path, monkeypatch):
    """ZeRO-1 and ZeRO-2, bf16 and fp32, SGD (its update is proportional to the clipped gradient)
    with ``gradient_clipping`` 1.0, 3 steps on one rank: the same losses and weights, bit for bit,
    with the replacements (the default) and with DeepSpeed's own functions. The fp32 runs show a
    change of the clip's last bits, which the bf16 weights round away. A run without clipping ends
    elsewhere, so the clip acted (the norms are about 15 to 30)."""
    sgd = [s for s in h.SGD if not s.startswith("gradient_clipping")]
    jobs = [h.job(f"z{stage}_{dtype}", f"zero{stage}.json",
                  sgd + ["gradient_clipping=1.0", f"bf16.enabled={str(dtype == 'bf16').lower()}"], h.COMMON)
            for stage in (1, 2) for dtype in ("bf16", "fp32")]
    unclipped = h.job("z1_fp32_unclipped", "zero1.json", sgd + ["gradient_clipping=0", "bf16.enabled=false"], h.COMMON)
    h.run_jobs(h.write_jobs(tmp_path / "on", jobs + [unclipped]), 1)
    monkeypatch.setenv("DS_INFCL_SYNC_FREE", "0")
    h.run_jobs(h.write_jobs(tmp_path / "off", jobs), 1)
    assert "replaced by versions without host waits" in (tmp_path / "on" / "jobs.log").read_text()
    assert "DS_INFCL_SYNC_FREE=0" in (tmp_path / "off" / "jobs.log").read_text()
    for job in jobs:
        on, off = tmp_path / "on" / job["name"], tmp_path / "off" / job["name"]
        assert h.summary(on)["losses"] == h.summary(off)["losses"], job["name"]
        a, b = h.params(on), h.params(off)
        assert a.keys() == b.keys()
        for key in a:
            assert_same_bits(a[key], b[key])
    assert h.max_abs_diff(h.params(tmp_path / "on" / "z1_fp32"), h.params(tmp_path / "on" / "z1_fp32_unclipped")) > 0
