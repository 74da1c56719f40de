"""The engine on 2 CPU ranks (gloo) against one process on the same global batch.

One 2-rank launch runs every case in sequence (ZeRO 0/1/2/3 x fp32/bf16, GradCache under ZeRO 2
and 3, each optimizer, the first half of a resumed run), one single-process launch gives the
references, then a second 2-rank launch resumes, and two launchers with one hostfile simulate two
nodes. The multi-rank loss is ``test_gather`` (tests/train/driver.py: all-gather with gradient),
so these tests check the engine whatever the state of the ring; the ``infcl`` cases check the ring
against it. Every case always runs: a module of the package that fails to import fails the
launch and with it these tests (never a skip).
"""

import math

import pytest
import torch

from tests.train import harness as h

pytestmark = pytest.mark.slow

STAGES = [0, 1, 2, 3]
DTYPES = ["fp32", "bf16"]
GATHER = ["loss.impl=test_gather"]


def _bf16(dtype):
    return [f"bf16.enabled={'true' if dtype == 'bf16' else 'false'}"]


def _grid_jobs():
    jobs = []
    for stage in STAGES:
        for dtype in DTYPES:
            jobs.append(h.job(f"z{stage}_{dtype}", f"zero{stage}.json", h.SGD + _bf16(dtype), h.COMMON + GATHER))
    gc = ["batch.grad_cache=true", "batch.chunk_size=4", "batch.verify_replay=true"]  # 12 per rank: 3 chunks
    for stage, dtype in ((2, "fp32"), (3, "fp32"), (3, "bf16")):
        jobs.append(h.job(f"gc{stage}_{dtype}", f"zero{stage}.json", h.SGD + _bf16(dtype), h.COMMON + GATHER + gc))
    # ZeRO-3 GradCache gathers the parameters once per step by default (batch.gather_params
    # "auto"); the per-chunk path through ZeRO-3's hooks stays tested.
    jobs.append(h.job("gc3_fp32_hooks", "zero3.json", h.SGD + _bf16("fp32"),
                      h.COMMON + GATHER + gc + ["batch.gather_params=false"]))
    jobs.append(h.job("fc_z2", "zero2.json", h.SGD + _bf16("fp32"), h.COMMON + FASTCLIP))
    jobs.append(h.job("fc_gc3", "zero3.json", h.SGD + _bf16("fp32"), h.COMMON + FASTCLIP + gc))
    # The CLIP task's export under ZeRO-3 bf16 on 2 ranks (float32 from the master weights).
    jobs.append(h.job("clip_z3_bf16", "zero3.json", [], CLIP_TASK))
    # SigLIP: the loss owns the scale and the bias; both must match one process.
    jobs.append(h.job("sg_z2", "zero2.json", h.SGD + _bf16("fp32"), h.COMMON + SIGLIP))
    jobs.append(h.job("sg_gc3", "zero3.json", h.SGD + _bf16("fp32"), h.COMMON + SIGLIP + gc))
    jobs.append(h.job("infcl_z2", "zero2.json", h.SGD + _bf16("fp32"), h.COMMON + ["loss.impl=infcl"]))
    jobs.append(h.job("infcl_gc3", "zero3.json", h.SGD + _bf16("fp32"), h.COMMON + ["loss.impl=infcl"] + gc))
    return jobs


OPTIMIZERS = {
    "AdamW": '{"type": "AdamW", "params": {"lr": 0.01}}',
    "Lamb": '{"type": "Lamb", "params": {"lr": 0.01}}',
    "Lion": '{"type": "Lion", "params": {"lr": 0.002}}',
    "SGD": '{"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}',
}


def _optimizer_jobs():
    return [
        h.job(f"opt_{name}", "zero2.json", [f"optimizer={spec}", "scheduler=null", "bf16.enabled=false"]
              + (["zero_allow_untested_optimizer=true"] if name == "SGD" else []),
              ["batch.global_batch_size=32", "train.num_steps=6", "logging.progress_bar=false",
               "checkpoint.at_end=false", "eval.at_end=false"] + GATHER)
        for name, spec in OPTIMIZERS.items()
    ]


def _offload_jobs():
    """The shipped offload JSONs as they are (bf16, AdamW), ZeRO-3 offload with GradCache."""
    run = ["batch.global_batch_size=32", "train.num_steps=4", "logging.progress_bar=false",
           "checkpoint.at_end=false", "eval.at_end=false"] + GATHER
    return [
        h.job("offload2", "zero2_offload.json", [], run),
        h.job("offload3_gc", "zero3_offload.json", [], run + ["batch.grad_cache=true", "batch.chunk_size=8"]),
        h.job("plain2", "zero2.json", [], run),
    ]


# GradCache with dropout (RNG replay) and AdamW: 6 steps straight vs 3 + resume to 6.
RESUME = ["batch.global_batch_size=24", "batch.grad_cache=true", "batch.chunk_size=6",
          'task.args={"dropout": 0.1}', "logging.progress_bar=false", "eval.at_end=false"]
# The gather loss under ZeRO-2 and -3, and SigLIP (its scale and bias in the checkpoint) under ZeRO-3.
RESUME_LOSS = {"": GATHER, "_siglip": ["loss.impl=siglip", "loss.init_logit_bias=-2.0"]}
RESUME_CASES = [(2, ""), (3, ""), (3, "_siglip")]
# The schedule length is fixed: the interrupted run differs only in stopping at step 3 (a
# restored scheduler keeps the length it was saved with).
RESUME_DS = ["bf16.enabled=false", 'optimizer={"type": "AdamW", "params": {"lr": 0.01}}',
             "scheduler.params.total_num_steps=6", "scheduler.params.warmup_num_steps=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine")
    jobs = _grid_jobs() + _optimizer_jobs() + _offload_jobs() + [
    ] + [
        job
        for stage, loss in RESUME_CASES
        for job in (
            h.job(f"resume{stage}{loss}_full", f"zero{stage}.json", RESUME_DS,
                  RESUME + RESUME_LOSS[loss] + ["train.num_steps=6", "checkpoint.every_steps=3"]),
            h.job(f"resume{stage}{loss}_part", f"zero{stage}.json", RESUME_DS,
                  RESUME + RESUME_LOSS[loss] + ["train.num_steps=3"]),
        )
    ]
    h.run_jobs(h.write_jobs(out, _digits(jobs, out), "two_ranks.json"), 2)
    refs = [h.job(f"ref_{d}", "zero0.json", h.SGD + _bf16(d), h.COMMON + GATHER) for d in DTYPES]
    refs.append(h.job("bench_tiny", "zero2.json", [], h.COMMON + [
        "task.name=bench_clip", 'task.args={"arch": "tiny"}', "batch.grad_cache=true", "batch.chunk_size=8",
        "batch.verify_replay=true"]))
    refs.append(h.job("ref_sg", "zero0.json", h.SGD + _bf16("fp32"), h.COMMON + SIGLIP))
    refs.append(h.job("ref_fc", "zero0.json", h.SGD + _bf16("fp32"), h.COMMON + FASTCLIP))
    refs.append(h.job("clip_task", "zero2.json", [], CLIP_TASK))
    refs.append(h.job("clip_task_bf16_export", "zero2.json", [], CLIP_TASK + ["checkpoint.export_dtype=bfloat16"]))
    h.run_jobs(h.write_jobs(out, _digits(refs, out), "one_rank.json"), 1)
    resumed = [h.job(f"resume{stage}{loss}_part", f"zero{stage}.json", RESUME_DS,
                     RESUME + RESUME_LOSS[loss] + ["train.num_steps=6"],
                     resume=str(out / f"resume{stage}{loss}_part" / "checkpoints"))
               for stage, loss in RESUME_CASES]
    h.run_jobs(h.write_jobs(out, resumed, "resumed.json"), 2)
    _two_nodes(out)
    return out


# FastCLIP v3 over a finite synthetic data set (48 pairs = 2 global batches per epoch).
FASTCLIP = ["loss.impl=fastclip_v3", 'loss.args={"num_samples": 48, "steps_per_epoch": 2}',
            'task.args={"num_samples": 48}']


SIGLIP = ["loss.impl=siglip", "loss.init_logit_bias=-2.0"]
# The CLIP task (digits shards written on first use), GradCache, 2 steps, the final-model export.
CLIP_TASK = ["task.name=clip", 'task.args={"data_dir": "DIGITS", "eval_batch_size": 128}',  # DIGITS: _digits()
             "batch.global_batch_size=32", "batch.grad_cache=true", "batch.chunk_size=16", "train.num_steps=2",
             "logging.progress_bar=false", "checkpoint.at_end=false"]


def _digits(jobs, out):
    """The jobs with the CLIP task's data folder under this module's temporary directory (written
    here once: the task takes built-in data only by name)."""
    from ds_infcl.tasks.clip import ensure_digits_shards

    if any("DIGITS" in x for job in jobs for x in job["set"]):
        ensure_digits_shards(str(out / "digits"))
    for job in jobs:
        job["set"] = [x.replace("DIGITS", str(out / "digits")) for x in job["set"]]
    return jobs


def _two_nodes(out):
    """Two launchers (node_rank 0 and 1, one rank each), one hostfile, --no_ssh, 127.0.0.1."""
    hostfile = out / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    jobs = h.write_jobs(out, [h.job("two_nodes", "zero2.json", h.SGD + _bf16("fp32"), h.COMMON + GATHER)], "two_nodes.json")
    port = str(h.free_port())
    procs = []
    for node_rank in (1, 0):
        cmd = [str(h.DEEPSPEED), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
               "--master_addr", "127.0.0.1", "--master_port", port, str(h.DRIVER), str(jobs)]
        log = open(out / f"two_nodes_node{node_rank}.log", "w")
        procs.append((h.start(cmd, log), log))
    for proc, log in procs:
        rc = h.wait(proc, 600)
        log.close()
        assert rc == 0, (out / "two_nodes_node0.log").read_text()[-4000:] + (out / "two_nodes_node1.log").read_text()[-4000:]


# Tolerances: fp32 runs agree to rounding; bf16 modules round parameters to 8 bits of mantissa
# (the optimizer keeps fp32 masters), so compare them relative to their size.
def _assert_close(a, b, dtype):
    for k in a:
        if dtype == "fp32":
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")
        else:
            torch.testing.assert_close(b[k], a[k], rtol=2e-2, atol=2e-2, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_stage_matches_single_process(runs, stage, dtype):
    ref = h.params(runs / f"ref_{dtype}")
    got = h.params(runs / f"z{stage}_{dtype}")
    _assert_close(ref, got, dtype)
    # Same loss trajectory: the loss returned on every rank is the global loss.
    ref_losses, got_losses = h.summary(runs / f"ref_{dtype}")["losses"], h.summary(runs / f"z{stage}_{dtype}")["losses"]
    assert got_losses == pytest.approx(ref_losses, rel=1e-5 if dtype == "fp32" else 2e-2)


@pytest.mark.parametrize("case", ["gc2_fp32", "gc3_fp32", "gc3_bf16", "gc3_fp32_hooks"])
def test_grad_cache_matches_uncached(runs, case):
    stage, dtype = case[2], case.split("_")[1]
    cached = h.params(runs / case)
    _assert_close(h.params(runs / f"z{stage}_{dtype}"), cached, dtype)
    _assert_close(h.params(runs / f"ref_{dtype}"), cached, dtype)
    # The logit scale moved (its gradient counted once, not once per chunk: 3 chunks would triple it).
    init = torch.log(torch.tensor(1 / 0.07))
    ref_ls = h.params(runs / f"ref_{dtype}")["loss.logit_scale"]
    assert (ref_ls - init).abs().item() > 1e-2
    assert h.summary(runs / case)["num_chunks"] == 3


@pytest.mark.parametrize("case,ref", [("infcl_z2", "z2_fp32"), ("infcl_gc3", "z3_fp32")])
def test_infcl_matches_gather_reference(runs, case, ref):
    _assert_close(h.params(runs / "ref_fp32"), h.params(runs / case), "fp32")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_from_deepspeed_json(runs, name):
    s = h.summary(runs / f"opt_{name}")
    assert all(torch.isfinite(torch.tensor(s["losses"])))
    assert s["losses"][-1] < s["losses"][0]
    p = h.params(runs / f"opt_{name}")
    assert all(torch.isfinite(v).all() for v in p.values())


@pytest.mark.parametrize("stage,loss", RESUME_CASES)
def test_resume_continues_as_if_never_stopped(runs, stage, loss):
    name = f"resume{stage}{loss}"
    full, part = h.csv_losses(runs / f"{name}_full"), h.csv_losses(runs / f"{name}_part")
    assert sorted(part) == list(range(1, 7))
    assert part == full  # bit-identical losses on CPU, including steps 4-6 after the resume
    assert h.max_abs_diff(h.params(runs / f"{name}_full"), h.params(runs / f"{name}_part")) == 0.0
    s = h.summary(runs / f"{name}_part")
    assert s["start_step"] == 3 and s["steps"] == 6


def test_two_simulated_nodes_match_single_node(runs):
    assert h.summary(runs / "two_nodes")["world_size"] == 2
    _assert_close(h.params(runs / "z2_fp32"), h.params(runs / "two_nodes"), "fp32")


def test_logs_and_summary(runs):
    import csv

    with open(runs / "z2_fp32" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for col in ("loss", "logit_scale", "samples_per_s", "peak_mem_mib", "lr"):
        assert all(r[col] not in ("", "nan") for r in rows), col
    assert (runs / "z2_fp32" / "ds_config.resolved.json").exists()
    ckpt = runs / "resume2_full" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step00000006"
    assert sorted(p.name for p in (ckpt / "step00000003").glob("rng_rank*.pt")) == ["rng_rank00000.pt", "rng_rank00001.pt"]
    # One name per quantity: the summary's "scale" is the CSV's (exp of the clamped logit_scale).
    s = h.summary(runs / "z2_fp32")
    assert s["final_scale"] == pytest.approx(float(rows[-1]["scale"]), rel=1e-5)
    assert s["final_scale"] == pytest.approx(math.exp(min(s["final_logit_scale"], math.log(100.0))), rel=1e-6)


def test_optimizer_offload_configs(runs):
    plain = h.summary(runs / "plain2")["losses"]
    for case in ("offload2", "offload3_gc"):
        assert h.summary(runs / case)["losses"] == pytest.approx(plain, rel=1e-2), case
    _assert_close(h.params(runs / "plain2"), h.params(runs / "offload2"), "bf16")


def test_bench_task_smoke(runs):
    """The GPU benchmark's task (tiny towers, inputs generated from indices) with GradCache replay."""
    s = h.summary(runs / "bench_tiny")
    assert s["num_chunks"] == 3 and len(s["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(s["losses"])))


def test_clip_adapter_task_trains_and_exports(runs):
    """The CLIP adapter's task plugs into the trainer: dict batches, GradCache, its evaluation, and
    the final-model export through its save_pretrained."""
    s = h.summary(runs / "clip_task")
    assert s["steps"] == 2 and s["num_chunks"] == 2
    assert all(torch.isfinite(torch.tensor(s["losses"])))
    assert "zero_shot_top1" in s["eval"]
    assert (runs / "clip_task" / "final_model" / "clip_config.json").exists()


@pytest.mark.parametrize("case", ["clip_task", "clip_z3_bf16"])
def test_export_is_float32_from_the_master_weights(runs, case):
    """bf16 runs (ZeRO-2 on one rank, ZeRO-3 on two) export float32 weights taken from the
    optimizer's float32 masters, not the bf16 module copy upcast (which loses every update below
    bf16's resolution): the trained tensors are not all bf16-representable."""
    from safetensors.torch import load_file

    state = load_file(str(runs / case / "final_model" / "model.safetensors"))
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    assert floats and all(v.dtype == torch.float32 for v in floats.values())
    trained = [v for k, v in floats.items() if k.startswith(("visual_projection", "text_projection"))]
    assert trained and any(not torch.equal(v, v.bfloat16().float()) for v in trained)
    assert state["loss.logit_scale"].dtype == torch.float32


def test_export_dtype_rounds_the_masters_once(runs):
    """checkpoint.export_dtype=bfloat16: the same run's float32 export rounded once to bf16 (not
    the bf16 module copy); the logit scale stays float32."""
    from safetensors.torch import load_file

    full = load_file(str(runs / "clip_task" / "final_model" / "model.safetensors"))
    half = load_file(str(runs / "clip_task_bf16_export" / "final_model" / "model.safetensors"))
    assert half["loss.logit_scale"].dtype == torch.float32
    for k, v in full.items():
        if v.is_floating_point() and k != "loss.logit_scale":
            assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], v.bfloat16()), k


@pytest.mark.parametrize("case", ["fc_z2", "fc_gc3"])
def test_fastclip_loss_matches_single_process(runs, case):
    """FastCLIP v3 (per-sample state, sample indices from the batch, its own temperature update)
    on 2 ranks, uncached under ZeRO-2 and GradCache under ZeRO-3, against one process."""
    _assert_close(h.params(runs / "ref_fc"), h.params(runs / case), "fp32")
    assert h.summary(runs / case)["losses"] == pytest.approx(h.summary(runs / "ref_fc")["losses"], rel=1e-5)
    assert h.summary(runs / case)["final_logit_scale"] == pytest.approx(h.summary(runs / "ref_fc")["final_logit_scale"], rel=1e-6)


@pytest.mark.parametrize("case", ["sg_z2", "sg_gc3"])
def test_siglip_loss_matches_single_process(runs, case):
    """SigLIP (learnable scale and bias owned by the loss) on 2 ranks, uncached under ZeRO-2 and
    GradCache under ZeRO-3, against one process: every parameter (the bias included) and the loss
    trajectory."""
    ref, got = h.params(runs / "ref_sg"), h.params(runs / case)
    assert "loss.logit_bias" in ref and "loss.logit_scale" in ref
    _assert_close(ref, got, "fp32")
    assert h.summary(runs / case)["losses"] == pytest.approx(h.summary(runs / "ref_sg")["losses"], rel=1e-5)
