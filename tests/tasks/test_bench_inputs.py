"""The benchmark tasks' generated inputs: deterministic from the indices (GradCache's replay sees
the same inputs), spread over their range, and made without reading a device value on the host."""

import torch

from ds_infcl.tasks.bench import NOISE_IMAGES, BenchClipTask, hashed_ints


def test_hashed_ints_are_deterministic_spread_and_salted():
    index = torch.arange(5000, 7000)
    a = hashed_ints(index, 77, 1000, salt=1)
    assert a.shape == (2000, 77) and a.dtype == torch.int64
    assert torch.equal(a, hashed_ints(index, 77, 1000, salt=1))
    assert int(a.min()) == 0 and int(a.max()) == 999
    assert abs(a.float().mean().item() - 499.5) < 5
    assert (a == hashed_ints(index, 77, 1000, salt=2)).float().mean() < 0.01  # another salt, other ints
    assert (a[:, 1:] == a[:, :-1]).float().mean() < 0.01  # neighbouring positions differ
    assert torch.equal(a[10:20], hashed_ints(index[10:20], 77, 1000, salt=1))  # a chunk sees its rows' values
    big = hashed_ints(torch.tensor([2**62, -5]), 3, 7, salt=12345)  # wrapping arithmetic, still in range
    assert int(big.min()) >= 0 and int(big.max()) < 7


def test_bench_clip_inputs_repeat_for_a_replayed_chunk():
    towers = BenchClipTask(arch="tiny").build_towers()
    index = torch.tensor([3, 4, 5, 3 + NOISE_IMAGES])
    q1, k1 = towers.encode_query(index), towers.encode_key(index)
    q2, k2 = towers.encode_query(index), towers.encode_key(index)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(q1[0], q1[3])  # the same noise image, NOISE_IMAGES indices apart
    assert not torch.allclose(q1[0], q1[1]) and not torch.allclose(k1[0], k1[1])


def test_no_host_read_of_the_indices(monkeypatch):
    """A host read (``int(index[0])``, ``.item()``) of a device tensor syncs the device; here the
    indices are a tensor subclass that refuses to be read back."""

    class NoRead(torch.Tensor):
        def __int__(self):
            raise AssertionError("host read of a device index")

        def item(self):
            raise AssertionError("host read of a device index")

    towers = BenchClipTask(arch="tiny").build_towers()
    index = torch.arange(8).as_subclass(NoRead)
    towers.encode_query(index)
    towers.encode_key(index)
