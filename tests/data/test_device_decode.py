"""The GPU decode path of the image data (``ds_infcl.data.device_decode``) on CPU: torchvision is
not installed here, so the device decoder is PIL behind the same interface (a list of byte
tensors in, a list of ``uint8 [3, H, W]`` out, raising for the whole list on any bad image, as
``decode_jpeg`` does). What is checked against the CPU path (``ImageTransform`` with PIL): the
crop geometry, the pixels (same crops, bilinear vs bicubic), the samples that come out and the
bad-sample counts. The real nvjpeg run is .gpu/data_bench.sh."""

import io

import numpy as np
import pytest
import torch

from ds_infcl.data import BadSampleTally, ImageTextShards, ImageTransform, image_text_loader
from ds_infcl.data.device_decode import EncodedImages, JpegBatchDecoder, crop_resize
from ds_infcl.data.rebatch import Rebatch
from ds_infcl.data.shards import write_image_text_shards


def pil_decode(datas):
    """``decode_jpeg``'s contract with PIL: RGB ``uint8 [3, H, W]``, the whole call fails on any bad image."""
    from PIL import Image

    out = []
    for d in datas:
        with Image.open(io.BytesIO(d.numpy().tobytes())) as img:
            img.load()
            out.append(torch.from_numpy(np.array(img.convert("RGB"), copy=True)).permute(2, 0, 1))
    return out


def smooth_pixels(seed, height=40, width=52):
    """A smooth image (gradients and a blob): bilinear and bicubic resampling agree closely on it."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    cy, cx = rng.uniform(0, height), rng.uniform(0, width)
    blob = 120 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 200.0)
    chans = [rng.uniform(0, 1) * 255 * xx / width, rng.uniform(0, 1) * 255 * yy / height, blob]
    return np.stack(chans, -1).clip(0, 255).astype(np.uint8)


def encode(pixels, fmt="JPEG"):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def write(folder, images, per_shard=7):
    records = [{"idx": i, "image": data, "ext": ext, "caption": f"caption {i}"} for i, (data, ext) in enumerate(images)]
    manifest = write_image_text_shards(records, str(folder), prefix="train", samples_per_shard=per_shard)
    return str(folder / manifest["pattern"])


def damaged_images():
    """(bytes, ext) for: a good JPEG, a PNG, a grey JPEG, a truncated JPEG (no end marker), a
    JPEG whose header reads but whose data PIL cannot load (no scan), and bytes that are no image."""
    good = encode(smooth_pixels(0))
    scan = good.index(b"\xff\xda")
    grey = encode(smooth_pixels(1)[..., 0])
    return {
        "good": (good, "jpg"), "png": (encode(smooth_pixels(2), "PNG"), "png"), "grey": (grey, "jpg"),
        "truncated": (good[: len(good) // 2], "jpg"), "no_scan": (good[:scan] + b"\xff\xd9", "jpg"),
        "garbage": (b"not an image at all", "jpg"),
    }


def test_crop_resize_geometry_and_pixels_against_pil():
    from PIL import Image

    pixels = smooth_pixels(3, 48, 64)
    img = torch.from_numpy(pixels).permute(2, 0, 1)[None]
    # the whole image at its own size is the identity, exactly
    assert torch.equal(crop_resize(img[:, :, :, :48], torch.tensor([[0.0, 0, 48, 48]]), 48), img[:, :, :, :48])
    # an integer crop at its own size is that slice, exactly
    assert torch.equal(crop_resize(img, torch.tensor([[5.0, 7, 37, 39]]), 32), img[:, :, 7:39, 5:37])
    # batched boxes of different sizes: each equals PIL's bilinear crop + resize up to rounding
    boxes = torch.tensor([[3.0, 2, 50, 44], [10.0, 0, 41, 31], [0.0, 0, 64, 48]])
    out = crop_resize(img.expand(3, -1, -1, -1), boxes, 24)
    assert out.shape == (3, 3, 24, 24) and out.dtype == torch.uint8
    for k, box in enumerate(boxes.tolist()):
        ref = np.array(Image.fromarray(pixels).crop(tuple(int(v) for v in box)).resize((24, 24), Image.BILINEAR))
        diff = (out[k].permute(1, 2, 0).float() - torch.from_numpy(ref).float()).abs()
        assert diff.mean() < 1.5, (k, diff.mean())
    # a crop more than twice the output: box-prefiltered (no aliasing), still close to PIL
    big = torch.from_numpy(np.repeat(np.repeat(pixels, 4, 0), 4, 1)).permute(2, 0, 1)[None]
    small = crop_resize(big, torch.tensor([[0.0, 0, 256, 192]]), 32)
    ref = np.array(Image.fromarray(np.repeat(np.repeat(pixels, 4, 0), 4, 1)).resize((32, 32), Image.BILINEAR))
    assert (small[0].permute(1, 2, 0).float() - torch.from_numpy(ref).float()).abs().mean() < 2.0
    with pytest.raises(ValueError, match=r"images \[g, C, H, W\] and boxes \[g, 4\]"):
        crop_resize(img[0], boxes, 8)


def test_workers_draw_the_cpu_paths_crop_boxes():
    """The worker side reads the header and draws the box from the same RNG as the CPU path: the
    same boxes in the same order, so GPU-decoded pixels match the CPU path's crops."""
    datas = [encode(smooth_pixels(i, 40 + i, 60 - i)) for i in range(12)]
    cpu = ImageTransform(24, train=True, random_crop_scale=(0.3, 1.0), seed=5, output="uint8")
    gpu = EncodedImages(ImageTransform(24, train=True, random_crop_scale=(0.3, 1.0), seed=5, output="uint8"))
    from PIL import Image

    items = [gpu.prepare(d) for d in datas]
    decoder = JpegBatchDecoder(24, "cpu", decode=pil_decode, decode_batch=5)
    images, ok, failures = decoder(gpu.collate(items))
    assert ok.all() and not failures and decoder.images_decoded_on_device == 12
    for k, d in enumerate(datas):
        expected = cpu(Image.open(io.BytesIO(d)))
        assert (images[k].float() - expected.float()).abs().mean() < 4.0, k  # bilinear vs bicubic only
    boxes = gpu.collate(items)["box"]
    assert ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) < 0.99 * 40 * 52).any()  # real crops
    with pytest.raises(ValueError, match="uint8"):
        EncodedImages(ImageTransform(24, output="float32"))


def _epoch(pattern, transform, gpu, batch_size=4, num_workers=0, decoder=None):
    # GPU path: the workers keep their last partial batch, the device batcher refills and drops
    dataset = ImageTextShards(pattern, image_transform=EncodedImages(transform) if gpu else transform,
                              batch_size=batch_size, shuffle_shards=False, drop_last=not gpu, seed=3)
    tally = BadSampleTally()
    stream = image_text_loader(dataset, num_workers=num_workers)
    if gpu:
        decoder = decoder or JpegBatchDecoder(16, "cpu", decode=pil_decode)
        batches = list(Rebatch(iter(stream), batch_size, tally, decoder=decoder))
    else:
        batches = []
        for b in stream:
            tally.update(b)
            batches.append(b)
    return batches, tally.counts


DAMAGED_STREAM = ["good", "png", "no_scan", "grey", "truncated", "good", "garbage", "no_scan", "good", "png",
                  "grey", "good", "good", "no_scan", "good", "good", "grey", "good", "good", "good", "good"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_images_are_counted_as_on_the_cpu_path_and_batches_stay_full(tmp_path, num_workers):
    bad = damaged_images()
    names = DAMAGED_STREAM
    pattern = write(tmp_path / "s", [bad[n] for n in names], per_shard=7)
    transform = lambda: ImageTransform(16, train=True, random_crop_scale=(0.9, 1.0), output="uint8")  # noqa: E731
    cpu_batches, cpu_counts = _epoch(pattern, transform(), gpu=False, num_workers=num_workers)
    gpu_batches, gpu_counts = _epoch(pattern, transform(), gpu=True, num_workers=num_workers)
    # 21 samples, 5 undecodable (3 no_scan, a truncated one, garbage): 16 good = 4 full batches
    # (with 2 workers the CPU path drops each worker's last partial batch; the GPU path refills
    # across workers); bad images are counted the same either way
    assert gpu_counts == {"bad_image": 5} and cpu_counts["bad_image"] == 5
    assert sum(len(b["idx"]) for b in cpu_batches) + sum(cpu_counts.values()) == 21
    assert all(len(b["idx"]) == 4 and b["image"].shape == (4, 3, 16, 16) for b in gpu_batches)
    good = [i for i, n in enumerate(names) if n in ("good", "png", "grey")]
    assert sorted(torch.cat([b["idx"] for b in gpu_batches]).tolist()) == good
    if num_workers == 0:
        assert sorted(torch.cat([b["idx"] for b in cpu_batches]).tolist()) == good
    assert all(len(b["text"]) == 4 for b in gpu_batches)


def test_a_batch_short_of_a_multiple_is_counted_as_dropped(tmp_path):
    bad = damaged_images()
    pattern = write(tmp_path / "s", [bad["good"]] * 9 + [bad["no_scan"]], per_shard=10)
    transform = ImageTransform(16, train=True, random_crop_scale=(0.9, 1.0), output="uint8")
    batches, counts = _epoch(pattern, transform, gpu=True, batch_size=4)
    # 10 samples, 1 bad: two batches of 4, the last good one dropped
    assert len(batches) == 2 and counts == {"dropped_last_batch": 1, "bad_image": 1}


def test_threaded_prefetch_keeps_order_raises_and_stops():
    from ds_infcl.data.rebatch import ThreadedPrefetch

    items = [{"x": torch.tensor([i])} for i in range(7)]
    assert [b["x"].item() for b in ThreadedPrefetch(iter(items), "cpu", depth=2)] == list(range(7))

    def failing():
        yield {"x": torch.tensor([0])}
        raise OSError("shard gone")

    stream = ThreadedPrefetch(failing(), "cpu")
    assert next(stream)["x"].item() == 0
    with pytest.raises(OSError, match="shard gone"):
        next(stream)
    endless = ThreadedPrefetch(({"x": torch.tensor([i])} for i in iter(int, 1)), "cpu")
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ThreadedPrefetch(iter(items), "cpu", depth=0)


def test_rebatch_splits_and_joins_worker_batches():
    raw = [{"image": torch.full((3, 1), float(k)), "idx": torch.arange(3 * k, 3 * k + 3),
            "text": [f"t{3 * k + i}" for i in range(3)],
            "bad_samples": {"bad_json": k}, "reader": k % 2} for k in range(4)]
    tally = BadSampleTally()
    out = list(Rebatch(iter(raw), 5, tally))
    assert [b["idx"].tolist() for b in out] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert out[1]["text"] == ["t5", "t6", "t7", "t8", "t9"] and out[1]["image"].flatten().tolist() == [1, 2, 2, 2, 3]
    # the readers' last counts (reader 0: 2, reader 1: 3) and the 2 samples left at the end
    assert tally.counts == {"bad_json": 5, "dropped_last_batch": 2}
