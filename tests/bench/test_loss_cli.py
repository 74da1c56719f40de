"""The loss benchmark's command line on a machine without a GPU: a bad fixed matmul rate is an
error that says what is wrong, before anything runs; without CUDA the benchmark says so."""

import pytest
import torch

from ds_infcl.bench import loss


@pytest.mark.parametrize("rate", ["0", "-5", "nan"])
def test_matmul_rate_must_be_positive(rate, capsys):
    with pytest.raises(SystemExit) as exc:
        loss.main(["--matmul-tflops", rate])
    assert exc.value.code == 2
    assert "--matmul-tflops must be a positive rate" in capsys.readouterr().err


def test_without_cuda_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(loss.torch.cuda, "is_available", lambda: False)
    assert loss.main(["--matmul-tflops", "793"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_precision_smoke_times_ours_and_openclip_in_three_settings(tmp_path, capsys):
    """``--precision --smoke``: the one command's grid on CPU: every setting x loss x batch has a
    time for ours and for OpenCLIP's loss, a table is printed and the CSV holds every row."""
    import csv

    from ds_infcl.bench import loss_precision

    assert loss.main(["--precision", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| setting | loss | GPUs | b per GPU | ours ms | OpenCLIP ms (fastest) | OpenCLIP / ours |" in out
    rows = list(csv.DictReader(open(tmp_path / "loss_precision_cpu_w1.csv")))
    points = {(r["setting"], r["loss"], r["b"], r["provider"]) for r in rows if float(r["median_ms"]) > 0}
    want = {(s, lo, b, p) for s in loss_precision.SETTINGS for lo in loss_precision.LOSSES
            for b in ("48", "80") for p in ("ours", "openclip")}
    assert points == want


def _precision_worker(rank, world, payload):
    import torch.distributed as dist

    from ds_infcl.bench import loss_precision

    return loss_precision.run([48], 32, 1, 1, torch.device("cpu"), dist.group.WORLD, settings=("bf16_autocast",))


def test_precision_on_two_ranks_times_ours_and_both_openclip_configurations():
    """Under torchrun the same grid runs on the default group: ours (its default distributed
    path), OpenCLIP's ClipLoss as its trainer defaults and with local_loss + gather_with_grad,
    and SigLipLoss; every rank reports the slowest rank's times."""
    from tests.ring.ring_harness import spawn

    results = spawn(_precision_worker, 2, timeout=120)
    assert results[0] == results[1]
    got = {(r["loss"], r["provider"]) for r in results[0] if r["median_ms"] != ""}
    assert got == {("clip", "ours"), ("clip", "openclip"), ("clip", "openclip_local"), ("siglip", "ours"),
                   ("siglip", "openclip")}
