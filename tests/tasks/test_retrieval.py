"""The retrieval task on the trainer: 2 ranks, ZeRO-2, GradCache chunks and false-negative
masking give the same loss trajectory as one process without GradCache (exact global-batch
gradients), and the exported folder loads in sentence-transformers."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data(path):
    t = random_texts(200, 3)
    with open(path, "w") as f:
        for i in range(60):  # positives repeat across examples (false negatives) and negatives overlap
            f.write(json.dumps({"query": t[i], "pos": [t[60 + i % 50]], "neg": [t[120 + i], t[120 + (i + 1) % 80]]}) + "\n")
        f.write("{bad json\n")


def _run(tmp, name, *, world, grad_cache, task_args=None, ds="zero2.json"):
    cfg = {
        "task": {"name": "retrieval",
                 "args": {"data": str(tmp / "train.jsonl"), "model_path": str(tmp / "tiny"), "num_negatives": 1,
                          "max_seq_length": 16, **(task_args or {})}},
        "batch": {"global_batch_size": 12, "grad_cache": grad_cache, "chunk_size": 2 if grad_cache else None},
        # Matryoshka over the 32-dim embedding: each prefix an exact global loss on both layouts.
        "loss": {"matryoshka_dims": [32, 16, 8], "matryoshka_weights": [1.0, 0.5, 0.25]},
        "train": {"num_steps": 3, "seed": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "logging": {"every_steps": 1, "progress_bar": False},
        "checkpoint": {"every_steps": 0, "export_final": True},
        "output_dir": str(tmp / name),
    }
    if not grad_cache:
        del cfg["batch"]["chunk_size"]
    with open(tmp / f"{name}.json", "w") as f:
        json.dump(cfg, f)
    common = ["--deepspeed_config", os.path.join(ROOT, "ds_configs", ds), "--ds-set", "bf16.enabled=false",
              "--ds-set", "optimizer.params.torch_adam=true", "--ds-set", "scheduler=null", "--config", str(tmp / f"{name}.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    if world == 1:
        cmd = [sys.executable, "-m", "ds_infcl.train", *common]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [launcher, "--num_gpus", str(world), "--master_port", str(port), "--module", "ds_infcl.train", *common]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(tmp / name / "summary.json") as f:
        return json.load(f)


def test_engine_two_ranks_grad_cache_equals_one_process(tmp_path):
    make_tiny_model_dir(str(tmp_path / "tiny"))
    _data(tmp_path / "train.jsonl")
    single = _run(tmp_path, "single", world=1, grad_cache=False)
    multi = _run(tmp_path, "multi", world=2, grad_cache=True)
    assert len(single["losses"]) == len(multi["losses"]) == 3
    for a, b in zip(single["losses"], multi["losses"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert single["losses"][-1] < single["losses"][0]
    # The data counts in the summary are the run's, not a rank's: the malformed line once, the
    # sampler's counts (the same on every rank) once.
    assert multi["data"] == single["data"]
    assert multi["data"]["malformed_records"] == 1 and multi["data"]["epochs_begun"] == 1
    assert multi["data"]["unused_examples"] == 0  # 60 examples, 5 global batches of 12

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "multi" / "final_model"
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.encode(["the cat"], convert_to_tensor=True).shape == (1, 32)
    assert "Global batch size: **12**" in (folder / "README.md").read_text()


def test_records_are_checked_at_load(tmp_path):
    """One record with ``"neg": []`` under ``num_negatives: 1`` used to pass ``--check`` and kill
    the run at the step that drew it; now the task refuses at load and names FILE:LINE. A missing
    data file or a directory is a config error naming the path, not a traceback."""
    import json

    from ds_infcl.train.config import ConfigError
    from ds_infcl.tasks.base import get_task

    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i in range(240):
            neg = [] if i == 200 else [f"unrelated passage {i}"]
            f.write(json.dumps({"query": f"question {i}", "pos": [f"answer {i}"], "neg": neg}) + "\n")
    with pytest.raises(ConfigError, match=rf"1 of 240 examples have none .*{path}:201"):
        get_task("retrieval", {"data": str(path), "num_negatives": 1})
    assert len(get_task("retrieval", {"data": str(path), "num_negatives": 0}).examples) == 240
    with pytest.raises(ConfigError, match=r"task.args.data: .*nope.jsonl' does not exist"):
        get_task("retrieval", {"data": str(tmp_path / "nope.jsonl")})
    with pytest.raises(ConfigError, match="is a directory"):
        get_task("retrieval", {"data": str(tmp_path)})


def test_faq_data_loses_no_example_and_counts_what_it_leaves_out(tmp_path, capsys):
    # Issue 13, item 3: 240 rows where 120 queries share one positive. The strict sampler trained
    # on 96 examples per epoch and said nothing; now every example is used but the last partial
    # global batch, and what is left out is counted and printed.
    from ds_infcl.tasks.base import get_task

    make_tiny_model_dir(str(tmp_path / "tiny"))
    t = random_texts(400, 5)
    with open(tmp_path / "faq.jsonl", "w") as f:
        for i in range(240):
            pos = t[300] if i < 120 else t[120 + i]
            f.write(json.dumps({"query": t[i], "pos": [pos]}) + "\n")
    task = get_task("retrieval", {"data": str(tmp_path / "faq.jsonl"), "model_path": str(tmp_path / "tiny")})
    stream = task.batches(rank=0, world_size=2, local_batch_size=16, start_step=0, seed=0)
    epoch = [next(stream) for _ in range(7)]  # 240 // 32 = 7 global batches
    used = sum(len(b["sample_index"]) for b in epoch) * 2
    assert used == 224 and task.unused_examples == 240 - 224 and task.epochs_begun == 1
    out = capsys.readouterr().out
    assert "retrieval epoch 0: 224 of 240 examples in 7 global batches; 16 not used" in out
    report = task.data_report()
    assert report["unused_examples"] == 16 and report["duplicate_batches"] == task.duplicate_batches > 0
    strict = get_task("retrieval", {"data": str(tmp_path / "faq.jsonl"), "model_path": str(tmp_path / "tiny"),
                                    "duplicates": "drop"})
    next(strict.batches(rank=0, world_size=2, local_batch_size=16, start_step=0, seed=0))
    assert strict.unused_examples == 240 - 96  # the old behaviour, now counted
    from ds_infcl.errors import ConfigError

    with pytest.raises(ConfigError, match="mask_false_negatives"):
        get_task("retrieval", {"data": str(tmp_path / "faq.jsonl"), "model_path": str(tmp_path / "tiny"),
                               "mask_false_negatives": False})


def test_beir_folder_evaluated_by_the_task(tmp_path):
    # Issue 15: the trainer's evaluation on a BEIR-format folder (read and checked at load); the
    # task's numbers equal the command's on the same encoder.
    from tests.adapters.test_beir_eval import write_beir
    from ds_infcl.adapters.beir_eval import evaluate_beir, load_encoder
    from ds_infcl.errors import ConfigError
    from ds_infcl.tasks.base import get_task

    make_tiny_model_dir(str(tmp_path / "tiny"))
    _data(tmp_path / "train.jsonl")
    write_beir(tmp_path / "beir")
    with pytest.raises(ConfigError, match="task.args.beir_data"):
        get_task("retrieval", {"data": str(tmp_path / "train.jsonl"), "model_path": str(tmp_path / "tiny"),
                               "beir_data": str(tmp_path / "nope")})
    task = get_task("retrieval", {"data": str(tmp_path / "train.jsonl"), "model_path": str(tmp_path / "tiny"),
                                  "beir_data": str(tmp_path / "beir"), "max_seq_length": 16})
    towers = task.build_towers()

    class Encoder:  # what the engine hands to evaluate(): towers without gradients
        device = torch.device("cpu")

        def encode_query(self, inputs):
            return towers.encode_query(inputs)

        def encode_key(self, inputs):
            return towers.encode_key(inputs)

    towers.eval()
    metrics = task.evaluate(Encoder(), step=0)
    ref = evaluate_beir(load_encoder(str(tmp_path / "tiny"), max_seq_length=16), str(tmp_path / "beir"), progress=False)
    for key in ("ndcg@10", "mrr@10", "recall@100"):
        assert metrics[f"beir/{key}"] == pytest.approx(float(ref[key]), abs=1e-5)


def test_matryoshka_dims_checked_at_load(tmp_path):
    from ds_infcl.errors import ConfigError
    from ds_infcl.tasks.base import build_loss, get_task
    from ds_infcl.train.config import LossConfig

    make_tiny_model_dir(str(tmp_path / "tiny"))
    _data(tmp_path / "train.jsonl")
    task = get_task("retrieval", {"data": str(tmp_path / "train.jsonl"), "model_path": str(tmp_path / "tiny")})
    with pytest.raises(ConfigError, match="loss.matryoshka_dims"):
        build_loss(task, LossConfig(matryoshka_dims=[64, 16]))  # the embedding has 32 dims
    loss = build_loss(task, LossConfig(matryoshka_dims=[32, 8]))
    q = torch.nn.functional.normalize(torch.randn(4, 32), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(4, 32), dim=-1)
    plain = build_loss(task, LossConfig())
    expected = plain(q, k) + plain(torch.nn.functional.normalize(q[:, :8], dim=-1),
                                   torch.nn.functional.normalize(k[:, :8], dim=-1))
    assert loss(q, k).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_lora_decoder_under_zero_matches_one_process(tmp_path, zero):
    # Issue 15: a decoder embedder (tiny random Qwen2, last-token pooling, EOS appended, an
    # instruction template on queries) with LoRA adapters, trained by the engine on 2 ranks with
    # GradCache under ZeRO-2 / ZeRO-3: the loss trajectory of one process without GradCache; the
    # export reloads in sentence-transformers and carries the adapter alone too.
    from tests.adapters.test_decoder_embedders import make_tiny_decoder_dir

    make_tiny_decoder_dir(str(tmp_path / "tiny"), "qwen2")
    _data(tmp_path / "train.jsonl")
    extra = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
             "query_template": "Instruct: {task}\nQuery: {text}", "task_description": "find the answer"}
    single = _run(tmp_path, "single", world=1, grad_cache=False, task_args=extra, ds="zero0.json")
    multi = _run(tmp_path, f"multi_{zero}", world=2, grad_cache=True, task_args=extra, ds=f"{zero}.json")
    assert len(single["losses"]) == len(multi["losses"]) == 3
    for a, b in zip(single["losses"], multi["losses"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert single["losses"][-1] != single["losses"][0]  # the adapters trained

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / f"multi_{zero}" / "final_model"
    assert (folder / "adapter" / "adapter_config.json").is_file()
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.encode(["the cat"], convert_to_tensor=True).shape == (1, 32)
