"""No host synchronization inside the GradCache chunk loop (issue 16), none from the trainer
between steps (issue 37), and none from DeepSpeed's ZeRO-1/2 optimizer step, on a CUDA GPU:

    python -m pytest -q -s tests/gpu/test_step_syncs_gpu.py

With ``torch.cuda.set_sync_debug_mode("warn")`` every operation that makes the host wait for the
device (an ``.item()``, a ``bool`` of a device tensor, a blocking copy) warns. A step of 2 chunks
and a step of 8 chunks over the same local batch must warn the same number of times: what a step
synchronizes (the loss's input checks) does not depend on the number of chunks, so nothing inside
the loop over chunks waits for the GPU. The stand-in engine of ``tests/train/test_steps.py`` keeps
DeepSpeed's own work out of that count. The step no longer reads its loss back: the trainer reads
it one step late (``train/inflight.py``), which the last tests check on real trainer steps.

On real trainer steps DeepSpeed made the host wait three times per step with ZeRO-1/2 in bf16
(DeepSpeed 0.19.8 on an H200, 2026-11-28: ``deepspeed/runtime/utils.py`` lines 887 and 888 in
``mask_nan_or_inf_with_val_inplace``, line 233 in ``is_invalid_grad_norm`` from the clip). The
trainer now replaces those two functions (``train/ds_sync_free.py``), so these tests expect no
wait charged to DeepSpeed or to ``ds_infcl/train`` in steady-state steps. The loss's input checks
(``ds_infcl/ops/validation.py``), one read per loss call until then, are queued on the device inside
a trainer step (``deferred_value_checks``) and read with the loss: on one rank nothing is left but
one wait outside ds_infcl's and DeepSpeed's code per counted run (``"other"``, 1 in 4 steps before
these changes too). A ``grad_cache_step`` called outside the trainer reads its loss's checks once,
after the loss's forward is queued, by a wait on the copy of the counts that this mode does not
see (``tests/gpu/test_loss_checks_gpu.py``).
"""

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ds_infcl.loss import ContrastiveLoss  # noqa: E402
from ds_infcl.tasks.synthetic import SyntheticTask  # noqa: E402
from ds_infcl.train.model import ContrastiveModel  # noqa: E402
from ds_infcl.train.steps import grad_cache_step  # noqa: E402
from tests.train.test_steps import FakeEngine  # noqa: E402

DEVICE = torch.device("cuda")
LOCAL = 64


def _syncs(num_chunks: int, copy_stream: bool) -> int:
    torch.manual_seed(0)
    task = SyntheticTask()
    model = ContrastiveModel(task.build_towers(), ContrastiveLoss(symmetric=True, impl="infcl")).to(DEVICE)
    batch = next(task.batches(rank=0, world_size=1, local_batch_size=LOCAL, start_step=0, seed=0))
    batch = batch.map(lambda t: t.pin_memory())
    chunk = LOCAL // num_chunks
    # Warm-up step: kernel compilation, allocator growth, lazy CUDA state.
    grad_cache_step(FakeEngine(model, num_chunks), batch, chunk, DEVICE, copy_stream=copy_stream)
    torch.cuda.synchronize()
    engine = FakeEngine(model, num_chunks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            grad_cache_step(engine, batch, chunk, DEVICE, copy_stream=copy_stream)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # (torch's one-time notice that the sync debug mode is a prototype names "synchronizing
    # operations" too: it is not a sync)
    return sum("synchronizing" in str(w.message) and "prototype" not in str(w.message) for w in caught)


@pytest.mark.parametrize("copy_stream", [True, False])
def test_syncs_do_not_grow_with_the_chunks(copy_stream):
    # The first counted step of a process saw one more "synchronizing" warning than every later one
    # (on an H200, torch 2.11: 4 then 3, with either chunk count first): most likely torch's one-time
    # prototype notice, no longer counted; one discarded measurement still comes first.
    _syncs(4, copy_stream)
    few, many = _syncs(2, copy_stream), _syncs(8, copy_stream)
    print(f"copy_stream={copy_stream}: {few} synchronizing operations with 2 chunks, {many} with 8")
    assert few == many, (few, many)


def _trainer_syncs(ds_config: str, grad_cache, ranks: int = 1) -> dict:
    """``tests/gpu/trainer_syncs.py`` in a fresh process (a 1-rank world on this GPU), or under
    torchrun on ``ranks`` GPUs."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    from ds_infcl.train.dist import free_port

    repo = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "TRITON_INTERPRET": "0"}
    env.pop("DS_ACCELERATOR", None)
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                                      "--master_port", str(free_port())]
    proc = subprocess.run([sys.executable, *launcher, "-m", "tests.gpu.trainer_syncs",
                           str(repo / "ds_configs" / ds_config), json.dumps(grad_cache)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=repo)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRAINER_SYNCS ")]
    assert lines, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("TRAINER_SYNCS "):])


def _trainer_waits(got: dict) -> dict:
    """The waits charged to ``ds_infcl/train`` outside the settle of ``train/inflight.py`` (those of
    ``train/ds_sync_free.py`` included), and to DeepSpeed."""
    return {src: n for src, n in got["sources"].items()
            if src.startswith("deepspeed/") or src.startswith("ds_infcl/train/") and "inflight.py" not in src}


@pytest.mark.parametrize("ds_config", ["zero1.json", "zero2.json"])
@pytest.mark.parametrize("grad_cache", [False, "auto", True])
def test_the_trainer_does_not_wait_for_the_gpu_between_steps(ds_config, grad_cache):
    """Steady-state steps of the trainer (train/inflight.py): nothing in ds_infcl/train makes the
    host wait for the device (no per-step ``synchronize`` for the timing, no read of the loss or
    the gradient norm right after the step, no blocking stop vote); the one wait is the settle of
    the step before, on its event, after the next step is launched. Nor does DeepSpeed's optimizer
    step (its gradient-norm mask and clip replaced, train/ds_sync_free.py), nor the loss's input
    checks (queued, ``deferred_value_checks``). What remains, printed, is the one ``"other"``."""
    got = _trainer_syncs(ds_config, grad_cache)
    print(f"{ds_config} grad_cache={grad_cache}: per {got['steps']} steps {got['sources']}")
    assert got["sync_free"], f"train/ds_sync_free.py left this DeepSpeed as is (see its log line): {got}"
    assert not _trainer_waits(got), got
    left = {src: n for src, n in got["sources"].items() if src != "other"}
    assert not left, got
    assert got["sources"].get("other", 0) <= 1, got


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_vote_and_step_without_waiting():
    """The same on 2 ranks (torchrun, NCCL): the stop vote's collective is queued, not read, at the
    step boundary (``StopOnSignal.vote``); neither the trainer nor DeepSpeed waits."""
    got = _trainer_syncs("zero1.json", "auto", ranks=2)
    print(f"2 ranks, zero1.json grad_cache=auto: per {got['steps']} steps {got['sources']}")
    assert got["sync_free"], f"train/ds_sync_free.py left this DeepSpeed as is (see its log line): {got}"
    assert not _trainer_waits(got), got
