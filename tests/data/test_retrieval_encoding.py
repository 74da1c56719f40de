"""Retrieval input that is not clean UTF-8 (issue "Long runs that survive", item 5): a byte that is
not UTF-8 is a counted skip naming ``file:line`` (it used to end the run with a UnicodeDecodeError
at a buffer offset), a byte-order mark no longer costs line 1, and an empty data file is a one-line
config error with exit status 2 (it used to be a traceback with status 1)."""

import io
import json
import os
import subprocess
import sys
import tarfile
import warnings

import pytest

from ds_infcl.data.retrieval import MalformedTally, iter_retrieval_jsonl, iter_retrieval_shards, read_retrieval_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOM = b"\xef\xbb\xbf"


def _record(i):
    return json.dumps({"query": f"question {i}", "pos": [f"answer {i}"], "neg": [f"other {i}"]}).encode()


def _skip_messages(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


def test_a_line_that_is_not_utf8_is_a_counted_skip_naming_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    bad = b'{"query": "caf\xe9", "pos": ["x"]}'  # latin-1 e-acute: not UTF-8
    # A whole buffer (8 KiB) of good lines first: the old reader failed at a buffer offset.
    lines = [_record(i) for i in range(300)] + [bad] + [_record(i) for i in range(300, 305)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    tally = MalformedTally()
    examples, messages = _skip_messages(lambda: list(iter_retrieval_jsonl(str(path), tally=tally)))
    assert [ex.query for ex in examples] == [f"question {i}" for i in range(305)]
    assert [ex.idx for ex in examples] == list(range(305))  # positions count the kept examples
    assert tally.total == 1 and tally.where == [f"{path}:301"]
    assert tally.counts == {"not UTF-8 (byte 0xe9 at column 15)": 1}
    assert messages == [f"skipping malformed retrieval record at {path}:301: not UTF-8 (byte 0xe9 at column 15)"]
    with pytest.raises(ValueError, match=rf"at {path}:301: not UTF-8"):
        read_retrieval_jsonl(str(path), strict=True)


def test_a_byte_order_mark_keeps_line_one(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + b"\r\n".join(_record(i) for i in range(3)) + b"\r\n")
    tally = MalformedTally()
    examples, messages = _skip_messages(lambda: list(iter_retrieval_jsonl(str(path), tally=tally)))
    assert [ex.query for ex in examples] == ["question 0", "question 1", "question 2"]
    assert examples[0].source == f"{path}:1" and tally.total == 0 and messages == []
    # A mark inside the file (not at its start) is not one: that line is malformed, and counted.
    path.write_bytes(_record(0) + b"\n" + BOM + _record(1) + b"\n")
    examples, messages = _skip_messages(lambda: list(iter_retrieval_jsonl(str(path), tally=tally)))
    assert len(examples) == 1 and tally.where == [f"{path}:2"]


def test_shard_member_with_bom_or_bad_bytes(tmp_path):
    shard = tmp_path / "r-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for key, data in (("000000000", BOM + _record(0)), ("000000001", b'{"query": "\xff", "pos": ["x"]}'),
                          ("000000002", _record(2))):
            info = tarfile.TarInfo(f"{key}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tally = MalformedTally()
    examples, messages = _skip_messages(lambda: list(iter_retrieval_shards(str(shard), tally=tally)))
    assert [ex.query for ex in examples] == ["question 0", "question 2"]
    assert tally.total == 1 and tally.where == [f"{shard}:000000001"]


def test_task_with_no_usable_record_is_a_config_error(tmp_path):
    from ds_infcl.errors import ConfigError
    from ds_infcl.tasks.base import get_task

    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"task.args.data: no training examples in .*the input holds no record"):
        get_task("retrieval", {"data": str(empty)})
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\xfe\n{not json\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=rf"2 malformed records skipped .*first at {garbage}:1, {garbage}:2"):
            get_task("retrieval", {"data": str(garbage)})


def test_cli_check_on_an_empty_data_file_exits_2_with_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    cfg = {"task": {"name": "retrieval", "args": {"data": str(empty)}}, "batch": {"global_batch_size": 4},
           "train": {"num_steps": 1},
           "output_dir": str(tmp_path / "out")}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "ds_infcl.train", "--check", "--config", str(tmp_path / "run.json"),
         "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "task.args.data: no training examples" in errors[0], proc.stderr


def test_beir_files_name_the_line_of_a_bad_byte_and_accept_a_bom(tmp_path):
    from tests.adapters.test_beir_eval import write_beir
    from ds_infcl.adapters.beir_eval import load_beir

    write_beir(tmp_path / "beir")
    reference = load_beir(str(tmp_path / "beir"))
    for name in ("queries.jsonl", os.path.join("qrels", "test.tsv")):
        p = tmp_path / "beir" / name
        p.write_bytes(BOM + p.read_bytes())
    with_bom = load_beir(str(tmp_path / "beir"))
    assert with_bom.query_ids == reference.query_ids and with_bom.qrels == reference.qrels
    corpus = tmp_path / "beir" / "corpus.jsonl"
    lines = corpus.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"text": "', b'"text": "\x80', 1)
    corpus.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=rf"{corpus}:3: not UTF-8 \(byte 0x80 at column \d+\)"):
        load_beir(str(tmp_path / "beir"))
