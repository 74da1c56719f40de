"""``decode: gpu`` on a CUDA GPU with torchvision's nvjpeg ``decode_jpeg`` (skipped without them):

    python -m pytest -q -s tests/gpu/test_device_decode_gpu.py

Against the CPU path (PIL decode + bicubic crop/resize, the same crop boxes): the pixels of real
256 px JPEG shards, undecodable images counted the same, the clip task's stream on the device
with its prefetch thread on a side stream. Each case prints its numbers.
"""

import pytest
import torch

from ds_infcl.data.device_decode import gpu_decode_problem

if gpu_decode_problem() is not None:
    pytest.skip(f"needs CUDA and torchvision: {gpu_decode_problem()}", allow_module_level=True)

from ds_infcl.data import ImageTextShards, ImageTransform  # noqa: E402
from ds_infcl.data.device_decode import EncodedImages, JpegBatchDecoder  # noqa: E402
from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards  # noqa: E402
from tests.data.test_device_decode import DAMAGED_STREAM, _epoch, damaged_images, write  # noqa: E402


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("jpeg") / "s")
    write_synth_jpeg_shards(out, num_samples=96, samples_per_shard=32, image_size=256)
    return out


def test_nvjpeg_pixels_match_the_cpu_path(shards):
    kwargs = dict(batch_size=32, shuffle_shards=False, seed=0)
    cpu = ImageTextShards(shards, image_transform=ImageTransform(224, train=True, random_crop_scale=(0.9, 1.0),
                                                                  output="uint8"), **kwargs)
    enc = ImageTextShards(shards, image_transform=EncodedImages(ImageTransform(224, train=True,
                                                                               random_crop_scale=(0.9, 1.0),
                                                                               output="uint8")), **kwargs)
    decoder = JpegBatchDecoder(224, "cuda", decode_batch=20)
    diffs = []
    for a, b in zip(cpu, enc):
        images, ok, failures = decoder(b["image"])
        assert ok.all() and not failures and images.is_cuda and images.shape == (32, 3, 224, 224)
        assert torch.equal(a["idx"], b["idx"])
        diffs.append((images.cpu().float() - a["image"].float()).abs().mean().item())
    print(f"mean |nvjpeg + bilinear - PIL + bicubic| per batch: {[round(d, 2) for d in diffs]}")
    assert decoder.images_decoded_on_device == 96 and decoder.images_decoded_on_cpu == 0
    assert max(diffs) < 5.0  # same crops (with PIL decoding on CPU: 2-3); tests/tasks/test_clip_decode.py


def test_bad_images_counted_as_on_the_cpu_path_with_nvjpeg(tmp_path):
    bad = damaged_images()
    pattern = write(tmp_path / "s", [bad[n] for n in DAMAGED_STREAM], per_shard=7)

    def transform():
        return ImageTransform(16, train=True, random_crop_scale=(0.9, 1.0), output="uint8")

    cpu_batches, cpu_counts = _epoch(pattern, transform(), gpu=False)
    decoder = JpegBatchDecoder(16, "cuda")
    gpu_batches, gpu_counts = _epoch(pattern, transform(), gpu=True, decoder=decoder)
    print(f"cpu {cpu_counts}, gpu {gpu_counts}; decoded on the device {decoder.images_decoded_on_device}, "
          f"on the CPU after the device refused {decoder.images_decoded_on_cpu}")
    assert cpu_counts == gpu_counts == {"bad_image": 5}
    assert sorted(torch.cat([b["idx"] for b in gpu_batches]).tolist()) == \
        sorted(torch.cat([b["idx"] for b in cpu_batches]).tolist())
    assert all(b["image"].is_cuda and b["image"].shape == (4, 3, 16, 16) for b in gpu_batches)


def test_clip_task_stream_on_the_device_with_its_prefetch_thread(shards):
    from ds_infcl.tasks.clip import ClipTask

    tasks = {d: ClipTask(shards, arch="tiny", tokenizer_kind="bpe", vocab_size=200, shuffle_buffer=0, decode=d,
                         worker_batch_size=12, num_workers=2) for d in ("cpu", "gpu")}
    streams = {}
    for d, task in tasks.items():
        task.build_towers()
        streams[d] = task.batches(rank=0, world_size=1, local_batch_size=32, start_step=0, seed=0)
    for _ in range(4):
        a, b = next(streams["cpu"]), next(streams["gpu"])
        assert b["query_inputs"].is_cuda and b["query_inputs"].dtype == torch.uint8
        assert torch.equal(a["sample_index"], b["sample_index"])
        diff = (b["query_inputs"].cpu().float() - a["query_inputs"].float()).abs().mean().item()
        print(f"task batch: mean |gpu - cpu| {diff:.2f}")
        assert diff < 5.0
