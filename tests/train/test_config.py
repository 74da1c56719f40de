"""Run config validation, the cross-check with the DeepSpeed JSON, optimizer preparation, the
batch container and the CPU optimizers: in-process, no DeepSpeed engine."""

import json
import os

import pytest
import torch

from ds_infcl.train.cli import main
from ds_infcl.train.config import ConfigError, apply_overrides, run_config_from_dict
from ds_infcl.train.ds_config import resolve_deepspeed_config, unknown_deepspeed_keys
from ds_infcl.train.optim import Lamb, Lion, prepare_optimizer
from ds_infcl.tasks.base import Batch, get_task
from ds_infcl.tasks.synthetic import SyntheticTask
from tests.train.harness import REPO

ZERO2 = str(REPO / "ds_configs" / "zero2.json")
BASE = {"batch": {"global_batch_size": 64}, "train": {"num_steps": 10}}


def _cfg(**sections):
    raw = json.loads(json.dumps(BASE))
    for k, v in sections.items():
        if isinstance(v, dict):
            raw.setdefault(k, {}).update(v)
        else:
            raw[k] = v
    return run_config_from_dict(raw)


@pytest.mark.parametrize(
    "sections,match",
    [
        ({"bogus": 1}, r"bogus: unknown top-level key; allowed keys are \['batch'"),
        ({"loss": {"temperature": 0.1}}, r"loss.temperature: unknown key; allowed keys of 'loss' are"),
        ({"loss": {"impl": "nope"}}, r"loss.impl: 'nope' is not allowed; choose one of \[.*'infcl'"),
        ({"loss": {"backend": "cuda"}}, r"loss.backend: 'cuda' is not allowed; choose one of"),
        ({"batch": {"global_batch_size": "64"}}, r"batch.global_batch_size: expected integer, got '64'"),
        ({"batch": {"global_batch_size": 0}}, r"batch.global_batch_size: must be >= 1, got 0"),
        ({"batch": {"grad_cache": True}}, r"batch.chunk_size: required when batch.grad_cache is true"),
        ({"batch": {"chunk_size": 8}}, r"batch.chunk_size: only used with GradCache"),
        ({"train": {"num_steps": 2.5}}, r"train.num_steps: expected integer, got 2.5"),
        ({"data": {"pin_memory": "yes"}}, r"data.pin_memory: 'yes' is not allowed; choose one of \['auto', True, False\]"),
        ({"logging": {"every_steps": 0}}, r"logging.every_steps: must be >= 1"),
        ({"checkpoint": {"every_steps": -1}}, r"checkpoint.every_steps: must be >= 0"),
        ({"loss": {"init_logit_scale": 5.0, "max_logit_scale": 4.0}}, r"loss.init_logit_scale: 5.0 exceeds"),
        ({"loss": {"args": {"num_samples": 10}}}, r"loss.args: only used by the FastCLIP losses"),
    ],
)
def test_run_config_errors_name_the_key(sections, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**sections)


def test_fastclip_num_samples_from_the_task_or_the_config():
    # Issue 13, item 8: num_samples may be left out when the task can tell (its sample index
    # bound); a task that cannot (an endless stream) needs it; a bad value is refused at load.
    from ds_infcl.tasks.base import build_loss, fastclip_num_samples

    with pytest.raises(ConfigError, match=r"loss.args.num_samples: must be an integer >= 1"):
        _cfg(loss={"impl": "fastclip_v3", "args": {"num_samples": 0}})
    cfg = _cfg(loss={"impl": "fastclip_v3"})
    assert fastclip_num_samples(SyntheticTask(num_samples=40), cfg.loss) == 40
    assert build_loss(SyntheticTask(num_samples=40), cfg.loss).num_samples == 40
    with pytest.raises(ConfigError, match=r"task 'synthetic' cannot tell how many there are"):
        build_loss(SyntheticTask(), cfg.loss)
    small = _cfg(loss={"impl": "fastclip_v3", "args": {"num_samples": 30}})
    with pytest.raises(ConfigError, match=r"num_samples: 30 is too small .* up to 39 .* set loss.args.num_samples to 40"):
        build_loss(SyntheticTask(num_samples=40), small.loss)
    assert _cfg(loss={"impl": "fastclip_v3", "args": {"num_samples": 100}}).loss.args == {"num_samples": 100}


def test_required_keys():
    with pytest.raises(ConfigError, match=r"train: required section is missing"):
        run_config_from_dict({"batch": {"global_batch_size": 8}})
    with pytest.raises(ConfigError, match=r"batch.global_batch_size: required key is missing"):
        run_config_from_dict({"batch": {}, "train": {"num_steps": 1}})


def test_deepspeed_batch_fields_filled_and_checked():
    cfg = _cfg(batch={"grad_cache": True, "chunk_size": 8})
    ds, layout = resolve_deepspeed_config(cfg, {"train_batch_size": "auto"}, world_size=2)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 8, 4)
    assert (layout.local_batch_size, layout.num_chunks) == (32, 4)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2

    plain, layout = resolve_deepspeed_config(_cfg(), {}, world_size=4)
    assert (plain["train_micro_batch_size_per_gpu"], plain["gradient_accumulation_steps"]) == (16, 1)

    with pytest.raises(ConfigError, match=r"X.json: train_batch_size = 128 contradicts the run config \(batch.global_batch_size is 64\)"):
        resolve_deepspeed_config(cfg, {"train_batch_size": 128}, 2, source="X.json")
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 2 contradicts .*number of chunks, 32 / 8 = 4"):
        resolve_deepspeed_config(cfg, {"gradient_accumulation_steps": 2}, 2)
    with pytest.raises(ConfigError, match=r"without GradCache it must be 1"):
        resolve_deepspeed_config(_cfg(), {"gradient_accumulation_steps": 4}, 2)
    with pytest.raises(ConfigError, match=r"batch.global_batch_size: 64 does not divide over 3"):
        resolve_deepspeed_config(_cfg(), {}, 3)
    with pytest.raises(ConfigError, match=r"batch.chunk_size: 12 does not divide the local batch of 32"):
        resolve_deepspeed_config(_cfg(batch={"grad_cache": True, "chunk_size": 12}), {}, 2)


def test_scheduler_auto_lengths():
    ds, _ = resolve_deepspeed_config(
        _cfg(), {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}, 1
    )
    assert ds["scheduler"]["params"] == {"total_num_steps": 10, "warmup_num_steps": 1}


def test_prepare_optimizer_on_cpu():
    ds, client, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "cpu")
    assert client is None and ds["optimizer"]["params"]["torch_adam"] is True


def test_prepare_adam_on_cuda(monkeypatch):
    import ds_infcl.train.optim as optim

    monkeypatch.setattr(optim, "_fused_adam_buildable", lambda cfg: True)
    ds, _, _ = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {}}}, "cuda")
    assert "torch_adam" not in ds["optimizer"]["params"]  # DeepSpeed's FusedAdam
    monkeypatch.setattr(optim, "_fused_adam_buildable", lambda cfg: False)
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {}}}, "cuda")
    assert ds["optimizer"]["params"]["torch_adam"] is True and "DS_BUILD_FUSED_ADAM=1" in notes[0]
    ds, _, _ = prepare_optimizer({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}, "cuda")
    assert ds["optimizer"]["params"]["torch_adam"] is False  # an explicit choice is kept


def test_prepare_other_optimizers():
    for name, cls in (("Lion", Lion), ("LAMB", Lamb)):
        ds, client, notes = prepare_optimizer(
            {"optimizer": {"type": name, "params": {"lr": 1e-3, "bogus": 1}}, "zero_optimization": {"stage": 2}}, "cpu"
        )
        assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True
        assert isinstance(client([torch.nn.Parameter(torch.zeros(2))]), cls)
        assert any("bogus" in n for n in notes)
    ds, _, notes = prepare_optimizer({"optimizer": {"type": "sgd", "params": {"lr": 0.1}}}, "cpu")
    assert ds["optimizer"]["type"] == "SGD"
    with pytest.raises(ConfigError, match=r"optimizer.type 'SGD' with zero_optimization.stage 2 needs \"zero_allow_untested_optimizer\": true"):
        prepare_optimizer({"optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 2}}, "cpu")
    with pytest.raises(ConfigError, match=r"optimizer.type 'Adamax2' is unknown"):
        prepare_optimizer({"optimizer": {"type": "Adamax2"}}, "cpu")
    with pytest.raises(ConfigError, match=r"an \"optimizer\" block"):
        prepare_optimizer({}, "cpu")


def test_lion_and_lamb_updates():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    p.grad = torch.tensor([0.3, -0.1, 0.0])
    Lion([p], lr=0.1, weight_decay=0.0).step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, -1.9, 0.5]))
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    p.grad = torch.tensor([1.0, 1.0])
    Lamb([p], lr=0.1, eps=0.0).step()  # first step: u = sign(g) = [1, 1], trust ratio 5 / sqrt(2)
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0]) - 0.1 * 5 / 2**0.5)


def test_overrides():
    raw = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "d=runs/x", "e.f=true"])
    assert raw == {"a": {"b": 2, "c": [1, 2]}, "d": "runs/x", "e": {"f": True}}
    assert apply_overrides({"s": {"t": 1}, "k": 2}, ["s=null"], delete_on_null=True) == {"k": 2}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["novalue"])


def test_batch_chunks_keep_keys_with_their_queries():
    b = Batch(query_inputs=torch.arange(6.0)[:, None], key_inputs={"x": torch.arange(12.0)},
              sample_index=torch.arange(100, 106), keys_per_query=2)
    chunks = b.chunks(4)
    assert [len(c) for c in chunks] == [4, 2]
    assert chunks[1].key_inputs["x"].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert chunks[1].sample_index.tolist() == [104, 105]
    assert b.resolved_labels().tolist() == [0, 2, 4, 6, 8, 10]


def test_synthetic_task_is_a_function_of_the_global_index():
    task = SyntheticTask()
    whole = next(task.batches(rank=0, world_size=1, local_batch_size=8, start_step=1, seed=0))
    r1 = next(task.batches(rank=1, world_size=2, local_batch_size=4, start_step=1, seed=0))
    assert r1.sample_index.tolist() == list(range(12, 16))
    torch.testing.assert_close(r1.query_inputs, whole.query_inputs[4:])
    with pytest.raises(ConfigError, match=r"task.name: unknown task 'nope'; choose one of \['bench_clip', 'bench_decoder', 'clip', 'open_clip', 'retrieval', 'synthetic'\] or give an import path"):
        get_task("nope")
    with pytest.raises(ConfigError, match=r"task.name: module 'ds_infcl.tasks.base' has no attribute 'Nope'"):
        get_task("ds_infcl.tasks.base:Nope")
    assert isinstance(get_task("ds_infcl.tasks.synthetic:SyntheticTask", {"embed_dim": 8}), SyntheticTask)
    with pytest.raises(ConfigError, match=r"task.args: .*unexpected keyword argument 'colour'"):
        get_task("synthetic", {"colour": 1})
    with pytest.raises(ConfigError, match=r"task.module: cannot import 'no.such.module'"):
        get_task("synthetic", module="no.such.module")


def test_cli_check(tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({**BASE, "batch": {"global_batch_size": 64, "grad_cache": True, "chunk_size": 8}}))
    assert main(["--deepspeed_config", ZERO2, "--config", str(run), "--check", "--world-size", "2"]) == 0
    assert "global batch 64 = micro 8 x accumulation 4 x 2" in capsys.readouterr().out
    assert main(["--deepspeed_config", ZERO2, "--config", str(run), "--check",
                 "--set", "loss.impl=nope"]) == 2
    assert "loss.impl: 'nope' is not allowed" in capsys.readouterr().err
    assert main(["--deepspeed_config", ZERO2, "--config", str(run), "--check",
                 "--ds-set", "train_batch_size=32"]) == 2
    assert "train_batch_size = 32 contradicts" in capsys.readouterr().err



def test_eval_counts_print_as_integers():
    """Counts in the eval lines and the run summary (``num_images``, ``bad_samples``) are integers,
    not ``359.0000``; rates keep four decimals."""
    from ds_infcl.train.metrics import format_metrics

    line = format_metrics({"num_images": 359.0, "bad_samples": 0.0, "zero_shot_top1": 0.95, "R@1": 1.0})
    assert line == "R@1=1.0000, bad_samples=0, num_images=359, zero_shot_top1=0.9500"


def test_deepspeed_typos_are_warned_and_invalid_blocks_refused(tmp_path, capsys):
    """``--ds-set zero_optimisation.stage=3`` used to be ignored without a word, and ``--check``
    accepted ``zero_optimization.stage=7``: now the typo is warned with the closest key and the
    stage is refused by DeepSpeed's own config model (exit 2), before any run."""
    run = tmp_path / "run.json"
    run.write_text(json.dumps({**BASE, "batch": {"global_batch_size": 64}}))
    assert main(["--deepspeed_config", ZERO2, "--config", str(run), "--check",
                 "--ds-set", "zero_optimisation.stage=3"]) == 0
    err = capsys.readouterr().err
    assert "zero_optimisation: not a DeepSpeed key, DeepSpeed ignores it (did you mean zero_optimization?)" in err
    for bad, word in (("zero_optimization.stage=7", "stage"), ("zero_optimization.stage_3=1", "stage_3")):
        assert main(["--deepspeed_config", ZERO2, "--config", str(run), "--check", "--ds-set", bad]) == 2
        err = capsys.readouterr().err
        assert "zero_optimization is not valid for DeepSpeed" in err and word in err, err
    for name in os.listdir(os.path.dirname(ZERO2)):  # the shipped JSONs are clean
        if name.endswith(".json"):
            with open(os.path.join(os.path.dirname(ZERO2), name)) as f:
                assert unknown_deepspeed_keys(json.load(f)) == [], name


def test_gather_params_values_and_fp16():
    with pytest.raises(ConfigError, match=r"batch.gather_params"):
        _cfg(batch={"grad_cache": True, "chunk_size": 8, "gather_params": "yes"})
    forced = _cfg(batch={"grad_cache": True, "chunk_size": 8, "gather_params": True})
    with pytest.raises(ConfigError, match=r"gather_params: true is not supported with fp16 \(Z.json has fp16.enabled\)"):
        resolve_deepspeed_config(forced, {"fp16": {"enabled": True}}, 2, source="Z.json")
    resolve_deepspeed_config(forced, {"bf16": {"enabled": True}}, 2)  # bf16: fine
    auto = _cfg(batch={"grad_cache": True, "chunk_size": 8})
    assert auto.batch.gather_params == "auto"
    resolve_deepspeed_config(auto, {"fp16": {"enabled": True}}, 2)  # auto: the engine keeps ZeRO-3's path


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"grad_cache": "yes", "chunk_size": 8}, r"batch.grad_cache: 'yes' is not allowed; choose one of \[True, False, 'auto'\]"),
        ({"grad_cache": "auto"}, r'batch.chunk_size: required when batch.grad_cache is "auto"'),
        ({"grad_cache": True, "chunk_size": 8, "keep_chunks": 1}, r'batch.keep_chunks: only used with batch.grad_cache "auto"'),
        ({"keep_chunks": 1}, r'batch.keep_chunks: only used with batch.grad_cache "auto" \(it is false\)'),
        ({"grad_cache": "auto", "chunk_size": 8, "keep_chunks": -1}, r"batch.keep_chunks: must be >= 0, got -1"),
        ({"grad_cache": True, "chunk_size": 8, "memory_budget_gib": 10},
         r'batch.memory_budget_gib: only used with batch.chunk_size "auto" or batch.grad_cache "auto"'),
    ],
)
def test_grad_cache_auto_settings_are_checked(batch, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(batch=batch)


def test_grad_cache_auto_from_the_command_line_and_its_layout():
    # --set batch.grad_cache=auto gives the string (not JSON), true/false the booleans; "auto" lays
    # the batch out as GradCache does (one micro-step per chunk), and keep_chunks is bounded by the
    # chunks of a step.
    raw = apply_overrides(BASE, ["batch.grad_cache=auto", "batch.chunk_size=8", "batch.keep_chunks=2",
                                 "batch.memory_budget_gib=60"])
    cfg = run_config_from_dict(raw)
    assert cfg.batch.grad_cache == "auto" and cfg.batch.keep_chunks == 2
    assert run_config_from_dict(apply_overrides(BASE, ["batch.grad_cache=true", "batch.chunk_size=8"])).batch.grad_cache is True
    ds, layout = resolve_deepspeed_config(cfg, {}, 2)
    assert layout.num_chunks == 4 and ds["gradient_accumulation_steps"] == 4
    with pytest.raises(ConfigError, match=r"batch.keep_chunks: 5 exceeds the 4 chunks of a step \(local batch 32 / "
                                          r"batch.chunk_size 8\); give at most 4"):
        resolve_deepspeed_config(_cfg(batch={"grad_cache": "auto", "chunk_size": 8, "keep_chunks": 5}), {}, 2)
