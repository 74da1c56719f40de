"""Checks at load (``ds_infcl.train.preflight``): faults that used to surface only at step 1 or at
the first checkpoint, after the task and the engine were built, are config errors before anything is
built, in a run and in ``--check`` (which writes nothing)."""

import errno
import json
import os
import subprocess
import sys

import pytest

from ds_infcl.errors import ConfigError
from ds_infcl.train import preflight
from ds_infcl.train.checkpoint import RECORD
from ds_infcl.train.cli import main
from ds_infcl.train.config import run_config_from_dict
from tests.train import harness

ZERO2 = str(harness.REPO / "ds_configs" / "zero2.json")
BASE = {"batch": {"global_batch_size": 64}, "train": {"num_steps": 10}, "logging": {"tensorboard": False}}


def _run(tmp_path, extra=None):
    raw = json.loads(json.dumps(BASE))
    raw["output_dir"] = str(tmp_path / "out")
    for k, v in (extra or {}).items():
        raw.setdefault(k, {}).update(v) if isinstance(v, dict) else raw.__setitem__(k, v)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _check(run, *more):
    return main(["--deepspeed_config", ZERO2, "--config", run, "--check", *more])


@pytest.fixture
def no_cxx():
    """Inductor's C++ compiler search finds nothing (as on a machine without g++/clang++).

    Through the config's own ``patch``: monkeypatch's undo of a torch config entry deletes it,
    and every later ``torch.compile`` on CPU in the process then failed ("config.cpp.cxx does not
    exist"; seen with the suite in reverse order)."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    with config.patch({"cpp.cxx": ("/nonexistent/g++",)}):
        cpp_compiler_search.cache_clear()
        yield
    cpp_compiler_search.cache_clear()


def test_compile_without_a_cxx_compiler_is_a_config_error(tmp_path, capsys, no_cxx):
    """It used to fail at the first forward, inside inductor (InvalidCxxCompiler), after the task
    and the engine were built; ``--check`` said ok."""
    run = _run(tmp_path, {"model": {"compile": "blocks"}})
    assert _check(run) == 2
    err = capsys.readouterr().err
    assert "model.compile: torch.compile cannot build kernels on this machine (cpu)" in err
    assert "no working C++ compiler" in err and "install g++" in err and "set model.compile false" in err
    assert _check(run, "--set", "model.compile=false") == 0  # eager needs no compiler
    assert not (tmp_path / "out").exists()  # --check writes nothing


def test_compile_with_zero3_refused_by_check(tmp_path, capsys):
    """Found only by ``compile_towers``, after the task's towers were built; ``--check`` said ok."""
    run = _run(tmp_path, {"model": {"compile": True}})
    assert _check(run, "--ds-set", "zero_optimization.stage=3") == 2
    assert "model.compile: not supported with ZeRO stage 3" in capsys.readouterr().err


def test_cuda_toolchain(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "triton package is not installed" in preflight.compile_toolchain_problem("cuda")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "$CC='/nonexistent/cc' is not an executable" in preflight.compile_toolchain_problem("cuda")
    monkeypatch.delenv("CC")
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    assert "no C compiler (gcc or clang" in preflight.compile_toolchain_problem("cuda")


def test_unwritable_output_and_checkpoint_dirs(tmp_path, capsys):
    """A folder that cannot be created (a file on its path) used to fail when rank 0 first wrote
    there (after the engine was built), or at the first checkpoint, hours in."""
    (tmp_path / "afile").write_text("x")
    run = _run(tmp_path)
    assert _check(run, "--set", f"output_dir={tmp_path / 'afile' / 'out'}") == 2
    assert "output_dir: " in capsys.readouterr().err
    bad_ckpt = f"checkpoint.dir={tmp_path / 'afile' / 'ckpt'}"
    assert _check(run, "--set", bad_ckpt) == 2
    err = capsys.readouterr().err
    assert "checkpoint.dir: " in err and "is a file" in err and "--set checkpoint.dir=" in err
    # a run that saves no checkpoint does not need the folder
    assert _check(run, "--set", bad_ckpt, "--set", "checkpoint.at_end=false") == 0
    assert not (tmp_path / "out").exists()


def test_full_disk(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(preflight.os, "fsync", full)
    with pytest.raises(ConfigError, match=r"checkpoint.dir: the disk of .* is full .*free space there"):
        preflight.check_writable(str(tmp_path / "ckpt"), "checkpoint.dir", dry=False)
    assert os.listdir(tmp_path / "ckpt") == []  # the probe is removed
    monkeypatch.undo()
    preflight.check_writable(str(tmp_path / "ckpt"), "checkpoint.dir", dry=False)
    assert os.listdir(tmp_path / "ckpt") == []
    Usage = type(preflight.shutil.disk_usage(str(tmp_path)))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: Usage(100, 100, 0))
    with pytest.raises(ConfigError, match=r"output_dir: the disk of .* is full \(0 bytes free\)"):
        preflight.check_writable(str(tmp_path / "new"), "output_dir", dry=True)


def test_run_stops_at_load_on_an_unwritable_checkpoint_dir(tmp_path):
    """The run itself (not only ``--check``): exit 2 and the key before the task is built."""
    (tmp_path / "afile").write_text("x")
    run = _run(tmp_path, {"checkpoint": {"dir": str(tmp_path / "afile" / "ckpt")},
                          "task": {"name": "tests.train.nan_task:NoSuchTask"}})  # never built
    proc = subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", ZERO2, "--config", run],
                          env=harness.env(), cwd=harness.REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: checkpoint.dir: cannot write into" in proc.stderr, proc.stderr[-3000:]


def _checkpoint(d, **record):
    tag = d / "step00000004"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tag / RECORD).write_text(json.dumps({"tag": tag.name, "step": 4, **record}))
    (d / "latest").write_text(tag.name)


def test_check_refuses_a_resume_that_cannot_continue(tmp_path, capsys):
    """``--check --resume`` used to resolve the path only: the global batch, the number of ranks
    under ZeRO 1-3 and the schedule were compared after the engine was built and the checkpoint
    loaded."""
    d = tmp_path / "ckpt"
    cfg = run_config_from_dict({**BASE})
    from ds_infcl.train.ds_config import resolve_deepspeed_config

    with open(ZERO2) as f:
        sched = resolve_deepspeed_config(cfg, json.load(f), 2)[0]["scheduler"]
    _checkpoint(d, world_size=2, zero_stage=2, global_batch_size=64, scheduler=sched)
    run = _run(tmp_path)
    assert _check(run, "--world-size", "2", "--resume", str(d)) == 0
    assert _check(run, "--world-size", "2", "--resume", str(d), "--set", "batch.global_batch_size=32") == 2
    assert "trained with a global batch of 64, this run has 32" in capsys.readouterr().err
    assert _check(run, "--world-size", "4", "--resume", str(d)) == 2
    assert "written by 2 ranks under ZeRO stage 2" in capsys.readouterr().err
    assert _check(run, "--world-size", "2", "--resume", str(d), "--set", "train.num_steps=20") == 2
    assert "learning-rate schedule" in capsys.readouterr().err
    # auto finds it in checkpoint.dir
    assert _check(run, "--world-size", "4", "--resume", "--set", f"checkpoint.dir={d}") == 2
    assert "written by 2 ranks" in capsys.readouterr().err


def test_auto_chunk_with_a_fixed_micro_batch(tmp_path, capsys):
    """The towers were timed (a model built and run) before the number in the JSON was compared."""
    run = _run(tmp_path, {"batch": {"grad_cache": True, "chunk_size": "auto"}})
    assert _check(run) == 0
    assert _check(run, "--ds-set", "train_micro_batch_size_per_gpu=64") == 2
    err = capsys.readouterr().err
    assert "train_micro_batch_size_per_gpu = 64 with batch.chunk_size \"auto\"" in err and 'to "auto"' in err


@pytest.mark.parametrize("ds_set,message", [
    ("scheduler.type=Cosine", "scheduler.type 'Cosine' is unknown; use one of ['LRRangeTest'"),
    ("scheduler.params.warmup_typo=1", "scheduler.params.warmup_typo: not a parameter of WarmupCosineLR"),
    ('scheduler={"type": "StepLR", "params": {}}', "scheduler.params: StepLR missing a required argument: 'step_size'"),
    ("optimizer.params.lrr=1", "optimizer.params.lrr: not a parameter of AdamW"),
    ('fp16={"enabled": true}', "fp16.enabled and bf16.enabled are both true; enable one of them"),
])
def test_deepspeed_objects_checked_before_initialize(tmp_path, capsys, ds_set, message):
    """Each used to pass ``--check`` and fail inside ``deepspeed.initialize`` (an AssertionError or
    a TypeError from the class), after the task's model was built."""
    assert _check(_run(tmp_path), "--ds-set", ds_set) == 2
    assert message in capsys.readouterr().err


def test_deepspeed_objects_accept_what_deepspeed_builds():
    from ds_infcl.train.optim import prepare_optimizer

    for name in ("zero2.json", "zero2_offload.json", "zero3_offload.json", "zero2_fp16.json"):
        with open(harness.REPO / "ds_configs" / name) as f:
            ds = json.load(f)
        for accelerator in ("cpu", "cuda"):
            preflight.check_deepspeed_objects(prepare_optimizer(ds, accelerator)[0], name)
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_allow_untested_optimizer": True,
           "scheduler": {"type": "StepLR", "params": {"step_size": 3}}}
    preflight.check_deepspeed_objects(prepare_optimizer(sgd, "cpu")[0])
    with pytest.raises(ConfigError, match=r"optimizer.params.betas: not a parameter of SGD"):
        preflight.check_deepspeed_objects({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}})


def test_resume_into_another_model_is_refused_before_the_engine(tmp_path):
    """Other towers than the checkpoint's (here task.args.embed_dim) used to fail inside DeepSpeed's
    ``load_checkpoint`` (a RuntimeError from ``load_state_dict``) after the engine was built; the
    record's parameter shapes say it first, as a config error."""
    run = _run(tmp_path, {"train": {"num_steps": 1}, "batch": {"global_batch_size": 16},
                          "logging": {"progress_bar": False}, "eval": {"at_end": False}})
    fp32 = str(harness.REPO / "ds_configs" / "zero2_fp32.json")

    def train(*more):
        return subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config", fp32, "--config", run,
                               *more], env=harness.env(), cwd=harness.REPO, capture_output=True, text=True, timeout=300)

    first = train()
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "checkpoints" / "step00000001" / RECORD).read_text())
    assert record["param_shapes"]["towers.query_tower.net.3.weight"] == [16, 64]
    other = train("--resume", "--set", 'task.args={"embed_dim": 24}')
    assert other.returncode == 2, other.stderr[-3000:]
    assert ("config error: --resume: the checkpoint" in other.stderr and "holds another model than this run builds: "
            "towers.query_tower.net.3.weight: [16, 64] in the checkpoint, [24, 64] now" in other.stderr), other.stderr[-3000:]


def test_stage_hints_name_zero1_for_zero2_on_one_gpu_only():
    from ds_infcl.train.preflight import stage_hints

    zero2 = {"zero_optimization": {"stage": 2}}
    (hint,) = stage_hints(zero2, 1, "cuda")
    assert "ZeRO-2 on one GPU" in hint and "ds_configs/zero1.json" in hint
    assert stage_hints(zero2, 2, "cuda") == []  # partitions over ranks: that is what ZeRO-2 is for
    assert stage_hints(zero2, 1, "cpu") == []
    assert stage_hints({"zero_optimization": {"stage": 1}}, 1, "cuda") == []
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert stage_hints(offload, 1, "cuda") == []  # offload needs stage 2
