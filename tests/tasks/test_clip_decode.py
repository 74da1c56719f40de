"""The clip task's image options (issue 16): OpenCLIP's random-resized crop by default
(``random_crop_scale``), and ``decode: gpu`` — refused with a config error where torchvision or
CUDA is missing (this CPU machine), and run here end to end with PIL standing in for nvjpeg
behind the same interface, against the CPU path on the same shards."""

import json
import os

import pytest
import torch

from ds_infcl.data.device_decode import gpu_decode_problem
from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards
from ds_infcl.errors import ConfigError
from ds_infcl.tasks.clip import ClipTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("jpeg") / "shards")
    write_synth_jpeg_shards(out, num_samples=36, samples_per_shard=12, image_size=48)
    return out


def _task(jpeg_dir, **kw):
    return ClipTask(jpeg_dir, arch="tiny", tokenizer_kind="bpe", vocab_size=100, shuffle_buffer=0, **kw)


def test_random_crop_scale_default_null_and_bad_values(jpeg_dir):
    task = _task(jpeg_dir)
    task.build_towers()
    train = task._transform(train=True)
    assert train.train and train.random_crop_scale == (0.9, 1.0)  # OpenCLIP's default
    assert not task._transform(train=False).train
    flat = _task(jpeg_dir, random_crop_scale=None)
    flat.build_towers()
    assert not flat._transform(train=True).train  # null: the evaluation transform
    for bad, match in (([0.5], "two numbers"), ([1.2, 1.0], "0 < lo <= hi <= 1"), ([0.9, 0.5], "0 < lo <= hi <= 1")):
        with pytest.raises(ConfigError, match=f"task.args.random_crop_scale.*{match}"):
            _task(jpeg_dir, random_crop_scale=bad)
    replaced = r"random_crop was replaced by random_crop_scale: give random_crop_scale: \[0.5, 1.0\]"
    with pytest.raises(ConfigError, match=replaced):
        _task(jpeg_dir, random_crop=0.5)
    with pytest.raises(ConfigError, match="task.args.decode must be 'cpu'.* or 'gpu'"):
        _task(jpeg_dir, decode="nvjpeg")
    with pytest.raises(ConfigError, match="set image_dtype: uint8"):
        _task(jpeg_dir, decode="gpu", image_dtype="float32")


def test_decode_gpu_without_torchvision_or_cuda_is_a_config_error_at_check(jpeg_dir, tmp_path, capsys):
    problem = gpu_decode_problem()
    if problem is None:
        pytest.skip("torchvision and CUDA are here: the GPU script runs decode: gpu")
    from ds_infcl.train.cli import main

    run = tmp_path / "run.json"
    run.write_text(json.dumps({
        "task": {"name": "clip", "args": {"data_dir": jpeg_dir, "arch": "tiny", "decode": "gpu"}},
        "batch": {"global_batch_size": 8}, "train": {"num_steps": 1}, "output_dir": str(tmp_path / "out"),
    }))
    rc = main(["--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"), "--config", str(run), "--check"])
    err = capsys.readouterr().err
    assert rc == 2 and "task.args.decode: 'gpu' needs torchvision" in err and problem in err
    assert "use decode: 'cpu'" in err and not (tmp_path / "out").exists()


def _pil_decode_jpeg(device):
    from tests.data.test_device_decode import pil_decode

    return pil_decode


@pytest.mark.parametrize("prefetch", [1, 0])
def test_gpu_decode_path_matches_the_cpu_path(jpeg_dir, monkeypatch, prefetch, capsys):
    """Same samples, captions and crop regions as the CPU path, batch after batch (bilinear vs
    bicubic resampling is the only difference), a replayed start_step included; decoded in the
    prefetch thread or inline."""
    import ds_infcl.data.device_decode as dd
    import ds_infcl.tasks.clip as clip

    monkeypatch.setattr(clip, "gpu_decode_problem", lambda: None)
    monkeypatch.setattr(dd, "torchvision_decode_jpeg", _pil_decode_jpeg)
    monkeypatch.setattr(ClipTask, "decode_device", staticmethod(lambda: torch.device("cpu")))
    cpu = _task(jpeg_dir)
    gpu = _task(jpeg_dir, decode="gpu", decode_batch=5, prefetch_batches=prefetch, report_data_time=True)
    cpu.build_towers()
    gpu.build_towers()
    a = cpu.batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=1)
    b = gpu.batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=1)
    for _ in range(6):  # 48 samples: past the end of the first epoch (36)
        x, y = next(a), next(b)
        assert torch.equal(x["sample_index"], y["sample_index"])
        assert torch.equal(x["key_inputs"]["input_ids"], y["key_inputs"]["input_ids"])
        assert x["query_inputs"].shape == y["query_inputs"].shape == (8, 3, 32, 32)
        assert y["query_inputs"].dtype == torch.uint8
        diff = (x["query_inputs"].float() - y["query_inputs"].float()).abs().mean().item()
        assert diff < 5.0, diff  # measured 2.0-2.4; other crops of the same images: ~10
    assert gpu.tally.total == 0
    if not prefetch:  # the thread may have decoded a batch ahead
        assert gpu._decoder.images_decoded_on_device == 48
    assert capsys.readouterr().out.count("[clip data] batch ") == 6  # report_data_time
    resumed = next(gpu.batches(rank=0, world_size=1, local_batch_size=8, start_step=5, seed=1))
    assert torch.equal(resumed["sample_index"], y["sample_index"])
    assert torch.equal(resumed["query_inputs"], y["query_inputs"])


def test_worker_batches_are_assembled_into_the_ranks_batch(jpeg_dir):
    """``worker_batch_size``: workers build small batches and the rank assembles its own; with one
    reader the stream is the same sample for sample, crop for crop, as whole batches."""
    whole, small = _task(jpeg_dir), _task(jpeg_dir, worker_batch_size=3)
    whole.build_towers()
    small.build_towers()
    a = whole.batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=4)
    b = small.batches(rank=0, world_size=1, local_batch_size=8, start_step=0, seed=4)
    for _ in range(5):
        x, y = next(a), next(b)
        assert torch.equal(x["sample_index"], y["sample_index"]) and torch.equal(x["query_inputs"], y["query_inputs"])
        assert torch.equal(x["key_inputs"]["attention_mask"], y["key_inputs"]["attention_mask"])
    with pytest.raises(ConfigError, match="worker_batch_size must be >= 1 or null"):
        _task(jpeg_dir, worker_batch_size=0)
    with pytest.raises(ConfigError, match="prefetch_batches must be >= 0"):
        _task(jpeg_dir, prefetch_batches=-1)
