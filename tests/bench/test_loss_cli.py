"""The loss benchmark's command line on a machine without a GPU: a bad fixed matmul rate is an
error that says what is wrong, before anything runs; without CUDA the benchmark says so."""

import pytest

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
