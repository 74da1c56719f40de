"""Checkpoints are never lost and never half-read (issue "Long runs that survive"), without a
process group: which tag a resume takes (the newest complete one, by the records, whatever
``latest`` says), damaged files named and the previous tag used, fresh starts over complete
checkpoints refused, ``keep_last`` and tag names that never touch another run's checkpoints, the
directory fsync, and ``weights_only`` loading."""

import json
import os
import stat

import pytest
import torch

from ds_infcl.errors import ConfigError
from ds_infcl.train import checkpoint as ck
from ds_infcl.train.checkpoint import RECORD, resolve_resume
from ds_infcl.train.cli import main
from tests.train import harness

ZERO2 = str(harness.REPO / "ds_configs" / "zero2.json")
FILES = {"mp_rank_00_model_states.pt": b"model" * 100,
         "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": b"optim" * 300,
         "rng_rank00000.pt": b"rng" * 50}


def _write(d, step, run_id="A", name=None, complete=True):
    """A tag as ``save_checkpoint`` leaves it: its files, then the record with their sizes and
    SHA-256 (``publish_record``: ``seq``, ``latest``)."""
    tag = name or f"step{step:08d}"
    (d / tag).mkdir(parents=True)
    for f, data in FILES.items():
        (d / tag / f).write_bytes(data + str(step).encode())
    if complete:
        files = {f: {"size": os.path.getsize(d / tag / f), "sha256": ck.file_sha256(str(d / tag / f))} for f in FILES}
        ck.publish_record(str(d), tag, {"tag": tag, "step": step, "run_id": run_id, "files": files})
    return d / tag


def test_latest_missing_resumes_the_newest_complete_tag(tmp_path):
    # today's main: no latest -> "no checkpoint ... starting fresh" over a complete step 10
    d = tmp_path / "ckpt"
    _write(d, 5), _write(d, 10), _write(d, 15, complete=False)
    (d / "latest").unlink()
    assert resolve_resume("auto", str(d)) == (str(d), "step00000010")
    assert resolve_resume(str(d), str(tmp_path / "other")) == (str(d), "step00000010")


def test_latest_naming_an_incomplete_or_no_tag_is_only_a_hint(tmp_path, capsys):
    d = tmp_path / "ckpt"
    _write(d, 4), _write(d, 8, complete=False)
    (d / "latest").write_text("step00000008")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    assert "latest names step00000008; the newest complete checkpoint is step00000004" in capsys.readouterr().out
    (d / "latest").write_text("step00000099")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    assert "names step00000099, which is not there" in capsys.readouterr().out


def test_garbled_latest_is_named_and_the_newest_complete_tag_used(tmp_path, capsys):
    # today's main: UnicodeDecodeError traceback
    d = tmp_path / "ckpt"
    _write(d, 4), _write(d, 8)
    (d / "latest").write_bytes(b"\xff\xfe\x00garbage")
    assert resolve_resume("auto", str(d)) == (str(d), "step00000008")
    assert f"{d}/latest is garbled" in capsys.readouterr().out


@pytest.mark.parametrize("victim,damage,message", [
    ("mp_rank_00_model_states.pt", "truncate", "mp_rank_00_model_states.pt: 150 bytes, the record says 501"),
    ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "garble", "optim_states.pt: its SHA-256 differs"),
    ("rng_rank00000.pt", "garble", "rng_rank00000.pt: its SHA-256 differs"),
    ("rng_rank00000.pt", "delete", "rng_rank00000.pt: missing"),
    (RECORD, "truncate", f"{RECORD}: not valid JSON, truncated or garbled"),
])
def test_a_damaged_file_is_named_and_the_previous_tag_used(tmp_path, capsys, victim, damage, message):
    d = tmp_path / "ckpt"
    _write(d, 4), _write(d, 8)
    path = d / "step00000008" / victim
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:150])
    elif damage == "garble":
        path.write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:40]) + data[40:])
    else:
        path.unlink()
    assert resolve_resume("auto", str(d)) == (str(d), "step00000004")
    out = capsys.readouterr().out
    assert f"checkpoint {d}/step00000008 is damaged: " in out and message in out
    assert "using the newest intact checkpoint step00000004" in out
    # An explicit path to the damaged tag: a config error naming the file and the previous tag.
    with pytest.raises(ConfigError, match=f"damaged: .*{message[:20]}.*resume from {d}/step00000004"):
        resolve_resume(str(d / "step00000008"), str(d))
    # With no intact tag left: one config error (exit 2 from the CLI), naming each.
    (d / "step00000004" / "rng_rank00000.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="no intact checkpoint in .*step00000008 is damaged.*step00000004 is damaged"):
        resolve_resume("auto", str(d))


def test_no_intact_checkpoint_is_one_config_error_line(tmp_path, capsys):
    d = tmp_path / "ckpt"
    _write(d, 4)
    (d / "step00000004" / "mp_rank_00_model_states.pt").write_bytes(b"short")
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"batch": {"global_batch_size": 64}, "train": {"num_steps": 10}, "output_dir": str(tmp_path / "out"),
                               "checkpoint": {"dir": str(d)}, "logging": {"tensorboard": False}}))
    rc = main(["--deepspeed_config", ZERO2, "--config", str(run), "--check", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("config error: --resume auto: no intact checkpoint")
    assert "mp_rank_00_model_states.pt: 5 bytes, the record says 501" in err and "Traceback" not in err


def test_fresh_start_into_complete_checkpoints_is_refused(tmp_path, capsys):
    d = tmp_path / "out" / "checkpoints"
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"batch": {"global_batch_size": 64}, "train": {"num_steps": 10}, "output_dir": str(tmp_path / "out"),
                               "logging": {"tensorboard": False}}))
    check = ["--deepspeed_config", ZERO2, "--config", str(run), "--check"]
    _write(d, 4, complete=False)  # only a write cut short: nothing to lose
    assert main(check) == 0
    _write(d, 8)
    capsys.readouterr()
    assert main(check) == 2
    err = capsys.readouterr().err
    assert "holds complete checkpoints (newest: step00000008)" in err and "--resume" in err and "--fresh" in err
    assert main(check + ["--fresh"]) == 0
    assert main(check + ["--set", "checkpoint.overwrite=true"]) == 0
    assert main(check + ["--resume", "--fresh"]) == 2
    assert "pass only one of them" in capsys.readouterr().err


def test_a_run_never_rewrites_or_prunes_another_runs_checkpoints(tmp_path):
    """Run A wrote 4, 8, 12; run B resumed from 4 (an explicit earlier tag) with keep_last 1.
    Today's main rewrote A's step 8 and, ordering by name, deleted B's newest tag."""
    d = tmp_path / "ckpt"
    for step in (4, 8, 12):
        _write(d, step, run_id="A")
    run_b = ck.run_id_after((str(d), "step00000004"))  # not the newest: a new run
    assert run_b != "A" and ck.run_id_after((str(d), "step00000012")) == "A"  # the newest: A continues
    written = []
    for step in (6, 8, 10):
        tag = ck._tag_to_write(str(d), step, run_b, overwrite=False)
        _write(d, step, run_id=run_b, name=tag)
        written.append(tag)
        ck.prune(str(d), 1, run_b, keep=tag)
        assert (d / tag / RECORD).is_file()  # the tag just written is kept
    assert written == ["step00000006", "step00000008-2", "step00000010"]
    assert json.loads((d / "step00000008" / RECORD).read_text())["run_id"] == "A"  # not rewritten
    left = sorted(t for t in os.listdir(d) if t.startswith("step"))
    assert left == ["step00000004", "step00000008", "step00000010", "step00000012"]
    # The newest complete checkpoint is B's step 10, although A's step 12 has a higher step.
    assert resolve_resume("auto", str(d)) == (str(d), "step00000010")
    assert (d / "latest").read_text() == "step00000010"
    # B continued (auto) prunes its own older tags by step, never A's.
    assert ck.run_id_after((str(d), "step00000010")) == run_b
    # overwrite (--fresh): tags of the same name are rewritten
    assert ck._tag_to_write(str(d), 12, "C", overwrite=True) == "step00000012"
    assert not (d / "step00000012" / RECORD).exists()


def test_record_and_latest_renames_are_followed_by_a_directory_fsync(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    tag = _write(d, 4, complete=False)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino if stat.S_ISDIR(st.st_mode) else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ck.publish_record(str(d), tag.name, {"tag": tag.name, "step": 4, "files": {}})
    i_record = events.index(("replace", RECORD))
    i_latest = events.index(("replace", "latest"))
    assert ("fsync", os.stat(tag).st_ino) in events[i_record + 1:i_latest]  # the record's directory
    assert events[i_latest + 1:] == [("fsync", os.stat(d).st_ino)]  # the checkpoint directory after latest
    assert events[i_record - 1] == ("fsync", "file") and events[i_latest - 1] == ("fsync", "file")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this calls open(marker, "w"): code from the file
        return (open, (self.marker, "w"))


def test_weights_only_loading_refuses_a_pickle_that_runs_code(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": _RunsCode(str(marker))}, bad)
    with pytest.raises(ConfigError, match=r"refused to load .*mp_rank_00_model_states.pt: it is not plain tensors"):
        ck.load_weights_only(str(bad))
    assert not marker.exists()
    # What DeepSpeed's own files hold loads (its loss scaler, ZeRO stage enum, fragment addresses).
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    good = tmp_path / "optim_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "dyn": DynamicLossScaler(2.0 ** 16, 1000, 1, 2, False),
                "zero_stage": ZeroStageEnum.gradients, "state": torch.arange(3)}, good)
    loaded = ck.load_weights_only(str(good))
    assert loaded["zero_stage"] == ZeroStageEnum.gradients and loaded["dyn"].cur_scale == 2.0 ** 16
    assert torch.equal(loaded["state"], torch.arange(3))


def test_deepspeed_checkpoint_engine_loads_weights_only(tmp_path, monkeypatch):
    """``load_checkpoint`` replaces the loader of DeepSpeed's TorchCheckpointEngine (which uses
    ``weights_only=False``) before anything is read."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "ran"
    bad = tmp_path / "bad.pt"
    torch.save({"x": _RunsCode(str(marker))}, bad)

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

        def load_checkpoint(self, ckpt_dir, tag):
            return ckpt_dir, self.checkpoint_engine.load(str(bad), map_location="cpu")

    import deepspeed.comm as dist

    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)  # no process group needed
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    with pytest.raises(ConfigError, match="refused to load .*bad.pt"):
        ck.load_checkpoint(Engine(), str(tmp_path), "step00000001", torch.device("cpu"))
    assert not marker.exists()
