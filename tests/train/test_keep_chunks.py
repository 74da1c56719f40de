"""How many chunks ``batch.grad_cache: "auto"`` keeps (``ds_infcl.train.keep_chunks``): the rule
from one measured step, ``keep_chunks``, CPU, and the CUDA measuring step with the device's
memory figures stood in for (the hybrid step itself: tests/train/test_steps.py and
tests/train/test_grad_cache_auto.py; on a GPU: tests/gpu/test_grad_cache_auto_gpu.py)."""

import pytest
import torch

from ds_infcl.train.config import BatchConfig
from ds_infcl.train.keep_chunks import SAFETY_FRACTION, KeepChunks, kept_from_memory
from ds_infcl.train.steps import StepResult

GIB = 2**30


def test_kept_from_memory():
    # peak 30 GiB with one kept chunk of 4 GiB, limit 50: 1 + floor(20 / 4) = 6 chunks
    assert kept_from_memory(16, 4 * GIB, 30 * GIB, 50 * GIB) == 6
    assert kept_from_memory(4, 4 * GIB, 30 * GIB, 50 * GIB) == 4  # all fit: no replay
    assert kept_from_memory(16, 4 * GIB, 30 * GIB, 33 * GIB) == 1  # only the measured one
    assert kept_from_memory(16, 4 * GIB, 51 * GIB, 50 * GIB) == 0  # over already: GradCache
    assert kept_from_memory(3, 0, 1, 2) == 3


def _batch(**kw):
    return BatchConfig(global_batch_size=64, grad_cache=kw.pop("grad_cache", "auto"), chunk_size=8, **kw)


def test_true_keeps_none_keep_chunks_is_taken_and_cpu_keeps_all():
    lines = []
    assert KeepChunks(_batch(grad_cache=True), 8, torch.device("cpu"), lines.append).num_kept() == 0
    assert lines == []
    assert KeepChunks(_batch(keep_chunks=3), 8, torch.device("cpu"), lines.append).num_kept() == 3
    assert lines[-1] == "batch.grad_cache auto: 3 of 8 chunks per step keep their graph, 5 replayed (batch.keep_chunks)"
    cpu = KeepChunks(_batch(), 8, torch.device("cpu"), lines.append)
    assert cpu.num_kept() == 8 and "on cpu there is no device memory to measure" in lines[-1]
    cpu.observe(StepResult(1.0, 8, 8, 8))  # nothing to measure
    assert cpu.num_kept() == 8


def _fake_cuda(monkeypatch, peak, free, reserved, total):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


@pytest.mark.parametrize("budget,want", [(None, 6), (40.0, 3)])
def test_cuda_measures_on_the_first_step_then_keeps_what_fits(monkeypatch, budget, want):
    # One kept chunk held 5 GiB; the measuring step peaked at 30 GiB on an 80 GiB device with 45
    # GiB free and 20 GiB in torch's cache: limit 65 - 8 (the margin) = 57 GiB, so 1 + floor(27 /
    # 5) = 6 chunks (the other rank could keep 7: the smallest wins). With a budget of 40 GiB:
    # 1 + floor(10 / 5) = 3.
    _fake_cuda(monkeypatch, peak=30 * GIB, free=45 * GIB, reserved=20 * GIB, total=80 * GIB)
    lines, agreed = [], []

    def min_over_ranks(value, device):
        agreed.append(value)
        return min(value, 7)  # the other rank could keep 7

    keep = KeepChunks(_batch(memory_budget_gib=budget), 16, torch.device("cuda", 0), lines.append, min_over_ranks)
    assert keep.num_kept() == 1 and "the first step keeps 1 of 16 chunks to measure its memory" in lines[-1]
    keep.observe(StepResult(1.0, 16, 16, 1, kept_bytes=5 * GIB))
    limit = (65 - SAFETY_FRACTION * 80) if budget is None else budget
    mine = 1 + int((limit - 30) // 5)
    assert agreed == [mine] and keep.num_kept() == min(mine, 7) == want
    assert lines[-1].startswith(f"batch.grad_cache auto: {want} of 16 chunks per step keep their graph, "
                                f"{16 - want} replayed from now on (one kept chunk held 5.00 GiB")
    keep.observe(StepResult(1.0, 16, 16, want, kept_bytes=None))  # measured once only
    assert agreed == [mine] and keep.num_kept() == want
