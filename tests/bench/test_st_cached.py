"""``ds_infcl.bench.st_cached``: sentence-transformers' CachedMNRL with peft on a ``bench_decoder``
shape. The peer row must compute sentence-transformers' loss: CachedMNRL on our decoder module
equals plain MNRL (loss and gradients, float32) on the same batch, and the command's first timed
step reports that loss; its summary's rates follow from its step times."""

import csv
import json
import math

import pytest
import torch

from ds_infcl.bench import st_cached


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch,lora_r,batch,mini", [("tiny", 4, 5, 2), ("tiny-mistral", 0, 3, 2), ("tiny", 2, 1, 4)])
def test_cached_mnrl_equals_mnrl_on_the_decoder_module(arch, lora_r, batch, mini):
    # mini-batches that do not divide the batch, b = 1, LoRA and full training, Qwen2 and Mistral
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = st_cached.build_model(arch, lora_r=lora_r, model_dtype=torch.float32, device=device)
    features = st_cached.make_features(torch.Generator().manual_seed(1), batch, 9, 300, 3, device)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and (all("lora_" in n for n in trainable) if lora_r else len(trainable) == len(list(model.parameters())))
    out = model(dict(features[0]))["sentence_embedding"]
    assert out.shape == (batch, 32) and torch.allclose(out.norm(dim=-1), torch.ones(batch), atol=1e-5)
    results = {}
    for cached in (True, False):
        model.zero_grad(set_to_none=True)
        loss = st_cached.make_loss(model, cached, mini)([dict(f) for f in features], None)
        loss.backward()
        results[cached] = (float(loss.detach()), _grads(model))
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5, abs=1e-6)
    for name, g in results[False][1].items():
        # float32 sums in another order: elements that cancel to near zero differ by more than
        # rtol; 1e-5 of the tensor's largest element bounds them (an atol of 1e-6 failed at some seeds
        # and thread counts, once in a reverse-order run of the suite)
        assert torch.allclose(results[True][1][name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max())), name
    assert any(g.abs().max() > 0 for g in results[False][1].values())


def test_command_summary_and_first_loss(tmp_path, capsys):
    argv = ["--arch", "tiny", "--batch", "6", "--mini-batch", "4", "--seq-len", "10", "--steps", "3", "--lora-r", "4",
            "--warmup-steps", "0", "--precision", "fp32", "--model-dtype", "fp32", "--device", "cpu", "--out", str(tmp_path)]
    assert st_cached.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("[st_cached] ") and json.loads(printed[len("[st_cached] "):]) == summary
    assert summary["status"] == "ok" and len(summary["step_times_s"]) == 3 and len(summary["losses"]) == 3
    assert summary["step_time_s"] == sorted(summary["step_times_s"])[1]
    assert summary["samples_per_s_per_gpu"] == pytest.approx(6 / summary["step_time_s"])
    assert summary["tokens_per_sample"] == 30  # query, positive, one hard negative of 10 tokens
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(30 * summary["samples_per_s_per_gpu"])
    assert summary["mfu"] is None and summary["peak_mem_gib"] is None  # CPU: no peak FLOPs, no device memory
    lora = 2 * 4 * (2 * (32 + 32) + 2 * (32 + 16))  # layers x r x (A + B of q, o: 32 -> 32; k, v: 32 -> 16)
    assert summary["trainable_params"] == lora
    assert summary["versions"]["sentence_transformers"] and summary["versions"]["peft"]
    # The first timed step (no warm-up) is sentence-transformers' plain MNRL on the first batch of
    # the command's generator, with the command's freshly built model.
    torch.manual_seed(0)
    model = st_cached.build_model("tiny", lora_r=4, model_dtype=torch.float32, device=torch.device("cpu"))
    features = st_cached.make_features(torch.Generator().manual_seed(0), 6, 10, 300, 3, torch.device("cpu"))
    with torch.no_grad():
        reference = float(st_cached.make_loss(model, False, 4)(features, None))
    assert summary["losses"][0] == pytest.approx(reference, rel=1e-5)
    assert all(math.isfinite(x) for x in summary["losses"]) and summary["losses"][1] != summary["losses"][0]


def test_case_command_round_trips_through_the_parser():
    cmd = st_cached.case_command("python", arch="qwen2-7b", seq_len=256, num_negatives=1, batch=512, mini_batch=16,
                                 steps=2, lora_r=16, out="o")
    args = st_cached.parse_args(cmd[3:])
    assert (args.arch, args.seq_len, args.num_negatives, args.batch, args.mini_batch, args.steps, args.lora_r, args.out) == \
        ("qwen2-7b", 256, 1, 512, 16, 2, 16, "o")
    with pytest.raises(SystemExit):
        st_cached.parse_args(["--arch", "tiny", "--seq-len", "129"])


def test_engine_runs_the_st_cached_row_on_the_first_visible_gpu(tmp_path, monkeypatch):
    # The engine's st_cached case, launched for real (a CPU process here: the tiny decoder, bf16
    # autocast), with the task's arch, seq_len, hard negatives and LoRA rank; its row in the table.
    from ds_infcl.bench import engine

    monkeypatch.setattr(engine, "_gpu_info", lambda: {"name": "no GPU", "mem_gib": None})
    seen = {}
    launch = engine._launch

    def spy(cmd, log_path, timeout, exit_codes=None, env_extra=None):
        seen.update(cmd=cmd, env=env_extra)
        return launch(cmd, log_path, timeout, exit_codes, env_extra)

    monkeypatch.setattr(engine, "_launch", spy)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    task = {"arch": "tiny", "seq_len": 10, "num_negatives": 1, "lora": {"r": 4}}
    engine.main(["--task", "bench_decoder", "--task-args", json.dumps(task), "--impls", "st_cached",
                 "--throughput-batch", "0", "--no-search", "--st-batch", "6", "--st-mini-batch", "4", "--st-steps", "1",
                 "--case-timeout", "300", "--out", str(tmp_path)])
    assert seen["env"] == {"CUDA_VISIBLE_DEVICES": "2"}
    args = st_cached.parse_args(seen["cmd"][3:])
    assert (args.arch, args.seq_len, args.num_negatives, args.lora_r, args.batch, args.mini_batch) == ("tiny", 10, 1, 4, 6, 4)
    summary = json.loads((tmp_path / "st_cached_6" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["model_dtype"] == "bfloat16" and summary["precision"] == "bf16"
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 1 and rows[0]["impl"] == "st_cached_mnrl+peft_r4" and rows[0]["status"] == "ok"
    assert float(rows[0]["tokens_per_s_per_gpu"]) == round(summary["tokens_per_s_per_gpu"])
    assert "| st_cached_mnrl+peft_r4 | 1 | 6 | 4 |" in (tmp_path / "results.md").read_text()


def test_engine_refuses_st_cached_without_the_decoder_task(tmp_path):
    from ds_infcl.bench import engine

    with pytest.raises(SystemExit):
        engine.main(["--impls", "st_cached", "--out", str(tmp_path)])
