"""The retrieval task in streaming mode (``task.args.sources``): every rank's batch is its share of
the stream's global batch, the stream position is in ``state_dict`` and a task given it back
continues with the same batches, bad source settings are config errors, and on the trainer a
2-rank run resumed from a mid-epoch checkpoint gives the losses of an uninterrupted run."""

import gzip
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.adapters.test_retrieval_common import make_tiny_model_dir, random_texts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_sources(tmp, n=40):
    """Three sources (parquet folder of 2 files, jsonl.gz, jsonl) of ``n`` examples each; the
    jsonl source shares positives between examples (deferrals), and holds a malformed line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    t = random_texts(9 * n, 5)
    rec = [{"query": t[i], "pos": [t[3 * n + i]], "neg": [t[6 * n + i]]} for i in range(3 * n)]
    os.makedirs(tmp / "pq", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rec[: n // 2]), str(tmp / "pq" / "p0.parquet"), row_group_size=8)
    pq.write_table(pa.Table.from_pylist(rec[n // 2 : n]), str(tmp / "pq" / "p1.parquet"), row_group_size=8)
    with gzip.open(tmp / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rec[n : 2 * n])
    with open(tmp / "c.jsonl", "w") as f:
        f.write("{broken\n")
        for i, r in enumerate(rec[2 * n :]):
            f.write(json.dumps(dict(r, pos=[t[5 * n + (i // 2) % 6]])) + "\n")  # neighbours share a positive
    return [{"path": str(tmp / "pq"), "weight": 2.0, "name": "pq"},
            {"path": str(tmp / "b.jsonl.gz"), "weight": 1.0, "name": "gz"},
            {"path": str(tmp / "c.jsonl"), "weight": 1.0, "name": "dups"}]


def _task(tmp, sources, **kw):
    from ds_infcl.tasks.base import get_task

    return get_task("retrieval", {"sources": sources, "model_path": str(tmp / "tiny"), "num_negatives": 1,
                                  "max_seq_length": 16, "window": 4, "read_ahead": 5, **kw})


def test_ranks_share_the_stream_and_the_state_resumes_the_batches(tmp_path):
    from ds_infcl.data.pair_stream import PairStream

    make_tiny_model_dir(str(tmp_path / "tiny"))
    sources = _write_sources(tmp_path)
    steps = 12
    with pytest.warns(UserWarning, match="c.jsonl:1: invalid JSON"):
        reference = PairStream(sources, 6, window=4, read_ahead=5, seed=7 + 3, require_negative=True, shuffle_buffer=3)
        want = [[ex.query for ex in reference.next_global_batch()[1]] for _ in range(steps)]
    tokenize = _task(tmp_path, sources, seed=7, shuffle_buffer=3).build_towers().tokenize_queries

    def ids(texts):
        return tokenize(texts)["input_ids"]

    states = {}
    for rank in range(2):
        task = _task(tmp_path, sources, seed=7, shuffle_buffer=3)
        it = task.batches(rank=rank, world_size=2, local_batch_size=3, start_step=0, seed=3)
        for step in range(steps):
            batch = next(it)
            assert torch.equal(batch["query_inputs"]["input_ids"], ids(want[step][3 * rank : 3 * rank + 3]))
            assert len(batch["key_inputs"]["input_ids"]) == 6  # positive + one hard negative each
            if step == 4:
                states[rank] = json.loads(json.dumps(task.state_dict()))  # after 5 steps
        assert task.data_report() == ({} if rank else {
            "malformed_records": 1, "deferred_examples": reference.counts["deferred"],
            "dropped_examples": reference.counts["dropped"],
            **{f"examples/{s['name']}": n for s, n in zip(sources, reference.counts["examples_per_source"])}})
    assert reference.counts["deferred"] > 0
    assert states[0]["stream"]["step"] == 5 and states[0]["stream"] == states[1]["stream"]
    # A new task given the saved state continues with step 6's batch (rank 1's share).
    resumed = _task(tmp_path, sources, seed=7, shuffle_buffer=3)
    resumed.load_state_dict(states[0])
    it = resumed.batches(rank=1, world_size=2, local_batch_size=3, start_step=5, seed=3)
    for step in range(5, steps):
        assert torch.equal(next(it)["query_inputs"]["input_ids"], ids(want[step][3:6]))
    # Without a saved position (a checkpoint of the in-memory mode) the stream is read again to it.
    replay = _task(tmp_path, sources, seed=7, shuffle_buffer=3).batches(rank=0, world_size=2, local_batch_size=3, start_step=5, seed=3)
    assert torch.equal(next(replay)["query_inputs"]["input_ids"], ids(want[5][:3]))


def test_stream_settings_are_checked_at_load(tmp_path):
    from ds_infcl.errors import ConfigError

    make_tiny_model_dir(str(tmp_path / "tiny"))
    sources = _write_sources(tmp_path)
    with pytest.raises(ConfigError, match=r"task.args.sources: source 0: .*nope.parquet. does not exist"):
        _task(tmp_path, [{"path": str(tmp_path / "nope.parquet")}])
    with pytest.raises(ConfigError, match="either data .* or sources"):
        _task(tmp_path, sources, data=str(tmp_path / "c.jsonl"))
    with pytest.raises(ConfigError, match="task.args.window: an integer >= 0"):
        _task(tmp_path, sources, window=-1)
    with pytest.raises(ConfigError, match="task.args.shuffle_buffer: an integer >= 0"):
        _task(tmp_path, sources, shuffle_buffer=1.5)
    with pytest.raises(ConfigError, match="task.args.duplicates"):
        _task(tmp_path, sources, duplicates="drop")


def _run(tmp, name, sources, *, num_steps, resume=None):
    cfg = {
        "task": {"name": "retrieval",
                 "args": {"sources": sources, "model_path": str(tmp / "tiny"), "num_negatives": 1, "max_seq_length": 16,
                          "window": 4, "read_ahead": 5}},
        "batch": {"global_batch_size": 8, "grad_cache": False},
        "train": {"num_steps": num_steps, "seed": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "logging": {"every_steps": 1, "progress_bar": False},
        "checkpoint": {"every_steps": 3, "export_final": False},
        "output_dir": str(tmp / name),
    }
    with open(tmp / f"{name}.json", "w") as f:
        json.dump(cfg, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(port), "--module", "ds_infcl.train",
           "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"), "--ds-set", "bf16.enabled=false",
           "--ds-set", "optimizer.params.torch_adam=true", "--ds-set", "scheduler=null",
           "--config", str(tmp / f"{name}.json")]
    if resume:
        cmd += ["--resume", resume]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(tmp / name / "summary.json") as f:
        return json.load(f), proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_ranks_resume_mid_epoch_gives_the_uninterrupted_losses(tmp_path):
    make_tiny_model_dir(str(tmp_path / "tiny"))
    sources = _write_sources(tmp_path)  # 120 examples; 6 steps of 8 read 48: mid-epoch throughout
    sources[2]["weight"] = 2.0  # the source whose neighbours share a positive: the step-3 checkpoint
    # holds a deferred example (checked on the stream: deferrals 0, 1, 2 after steps 1-3, one pending)
    full, _ = _run(tmp_path, "full", sources, num_steps=6)
    # Resume from the uninterrupted run's step-3 checkpoint (3 of its 6 global batches done).
    ckpt = os.path.join(tmp_path, "full", "checkpoints", "step00000003")
    assert os.path.isdir(ckpt), os.listdir(os.path.join(tmp_path, "full"))
    client = torch.load(os.path.join(ckpt, "mp_rank_00_model_states.pt"), weights_only=False)
    position = client["ds_infcl"]["task_state"]["stream"]
    assert position["step"] == 3 and position["stream"]["deferred"]  # mid-epoch, an example deferred
    resumed, log = _run(tmp_path, "resumed", sources, num_steps=6, resume=ckpt)
    assert "reading 3 global batches again" not in log  # the position came from the checkpoint
    assert resumed["start_step"] == 3 and len(full["losses"]) == 6 and len(resumed["losses"]) == 3
    for a, b in zip(full["losses"][3:], resumed["losses"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert len(set(full["losses"])) == 6  # six different batches, not one batch repeated
    # The data counts carry over the checkpoint: the resumed run reports the whole run's.
    assert resumed["data"] == full["data"]
    assert full["data"]["malformed_records"] == 1 and full["data"]["deferred_examples"] > 0


@pytest.mark.slow
def test_the_docs_pretraining_recipe_trains_an_embedder_from_a_parquet_folder(tmp_path):
    """docs/retrieval.md "Pretraining on a pair corpus": its run config, with the paths pointed at
    small local sources and a CPU-sized batch, trains and exports a sentence-transformers folder."""
    import re

    from ds_infcl.data.retrieval import RetrievalExample, write_retrieval_shards

    text = open(os.path.join(ROOT, "docs", "retrieval.md")).read()
    section = text.split("## Pretraining on a pair corpus", 1)[1]
    cfg = json.loads(re.search(r"\*\*2\. The run config\*\*.*?```json\n(.*?)```", section, re.S).group(1))
    make_tiny_model_dir(str(tmp_path / "tiny"))
    mine = _write_sources(tmp_path)
    os.makedirs(tmp_path / "qa")
    os.replace(tmp_path / "b.jsonl.gz", tmp_path / "qa" / "b.jsonl.gz")
    t = random_texts(90, 9)
    write_retrieval_shards([RetrievalExample(query=t[i], pos=[t[30 + i]], neg=[t[60 + i]]) for i in range(30)],
                           str(tmp_path / "code"), samples_per_shard=8)
    args = cfg["task"]["args"]
    paths = {"web": mine[0]["path"], "qa": str(tmp_path / "qa" / "*.jsonl.gz"), "code": str(tmp_path / "code")}
    for source in args["sources"]:
        source["path"] = paths[source["name"]]
    assert args["shuffle_buffer"] > 0
    args.update(model_path=str(tmp_path / "tiny"), window=8, read_ahead=4, shuffle_buffer=6, max_seq_length=16)
    cfg["batch"].update(global_batch_size=8, chunk_size=4)
    cfg["train"]["num_steps"] = 2
    cfg["checkpoint"]["every_steps"] = 0
    cfg["logging"] = {"progress_bar": False}
    cfg["output_dir"] = str(tmp_path / "run")
    with open(tmp_path / "pretrain.json", "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "ds_infcl.train", "--deepspeed_config",
                           os.path.join(ROOT, "ds_configs", "zero2.json"), "--ds-set", "bf16.enabled=false",
                           "--ds-set", "optimizer.params.torch_adam=true", "--config", str(tmp_path / "pretrain.json")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(tmp_path / "run" / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2
    assert sum(v for k, v in summary["data"].items() if k.startswith("examples/")) == 16

    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(tmp_path / "run" / "final_model"))
    assert model.encode(["red sun"]).shape == (1, 32)
