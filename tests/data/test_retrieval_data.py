"""Retrieval data: jsonl (FlagEmbedding and Tevatron shapes) and shards with malformed records,
the converter CLI, and the global no-duplicate batch sampler."""

import io
import json
import os
import tarfile
import warnings

import pytest

from ds_infcl.data.retrieval import (
    GlobalNoDuplicatesBatchSampler,
    MalformedTally,
    RetrievalExample,
    example_texts,
    iter_retrieval_jsonl,
    iter_retrieval_shards,
    main,
    parse_retrieval_record,
    read_retrieval_jsonl,
    write_retrieval_shards,
)

GOOD_FLAG = {"query": "what is a cat", "pos": ["a small feline"], "neg": ["a big dog", "a car"]}
GOOD_TEVATRON = {
    "query_id": "7", "query": "who wrote hamlet",
    "positive_passages": [{"docid": "1", "title": "Hamlet", "text": "a play by Shakespeare"}],
    "negative_passages": [{"docid": "2", "title": "", "text": "a village"}],
}
BAD_LINES = [
    "{not json",                                   # invalid JSON
    json.dumps({"pos": ["x"]}),                    # no query
    json.dumps({"query": "q", "pos": []}),         # empty pos
    json.dumps({"query": "q", "pos": [1, 2]}),     # wrong type
    json.dumps(["a", "list"]),                     # not an object
    json.dumps({"query": "q"}),                    # no positives at all
    json.dumps({"query": "q", "positive_passages": [{"title": "t"}]}),  # passage without text
]


def _write_jsonl(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def test_parse_shapes():
    ex = parse_retrieval_record(GOOD_FLAG, default_idx=3)
    assert ex == RetrievalExample("what is a cat", ["a small feline"], ["a big dog", "a car"], 3)
    tev = parse_retrieval_record(GOOD_TEVATRON)
    assert tev.pos == ["Hamlet a play by Shakespeare"] and tev.neg == ["a village"]
    assert parse_retrieval_record({"query": "q", "pos": "single"}).pos == ["single"]


def test_jsonl_skips_malformed_lines_with_count_and_line_number(tmp_path):
    path = str(tmp_path / "train.jsonl")
    lines = [json.dumps(GOOD_FLAG)] + BAD_LINES[:3] + ["", json.dumps(GOOD_TEVATRON)] + BAD_LINES[3:]
    _write_jsonl(path, lines)
    tally = MalformedTally()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = list(iter_retrieval_jsonl(path, tally=tally))
    assert [e.query for e in examples] == ["what is a cat", "who wrote hamlet"]
    assert [e.idx for e in examples] == [0, 1]
    assert tally.total == len(BAD_LINES)
    bad_line_numbers = [2, 3, 4, 7, 8, 9, 10]
    assert tally.where == [f"{path}:{n}" for n in bad_line_numbers]
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(BAD_LINES)
    for n, msg in zip(bad_line_numbers, messages):
        assert f"{path}:{n}:" in msg and "skipping malformed retrieval record" in msg
    assert any("invalid JSON" in m for m in messages)
    with pytest.raises(ValueError, match=r"train.jsonl:2"):
        read_retrieval_jsonl(path, strict=True)


def test_shards_roundtrip_and_malformed_samples(tmp_path):
    examples = [RetrievalExample(f"query {i}", [f"pos {i}"], [f"neg {i}"] * (i % 3)) for i in range(7)]
    manifest = write_retrieval_shards(examples, str(tmp_path), prefix="rt", samples_per_shard=3)
    assert manifest["num_shards"] == 3 and manifest["samples_per_shard"] == [3, 3, 1]
    got = list(iter_retrieval_shards(str(tmp_path / "rt-{000000..000002}.tar")))
    assert [(e.query, e.pos, e.neg, e.idx) for e in got] == [(e.query, e.pos, e.neg, i) for i, e in enumerate(examples)]

    # a shard with a good sample, invalid JSON, a record with no positives and a sample with no .json
    bad = str(tmp_path / "bad-000000.tar")
    with tarfile.open(bad, "w") as tar:
        for name, data in [("000000010.json", json.dumps(dict(GOOD_FLAG, idx=10)).encode()),
                           ("000000011.json", b"{oops"),
                           ("000000012.json", json.dumps({"query": "q", "pos": []}).encode()),
                           ("000000013.txt", b"just text")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tally = MalformedTally()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(iter_retrieval_shards([bad], tally=tally))
    assert [e.idx for e in got] == [10]
    assert tally.total == 3 and tally.counts["invalid JSON"] == 1 and tally.counts["no .json member"] == 1
    assert tally.where == [f"{bad}:000000011", f"{bad}:000000012", f"{bad}:000000013"]
    assert len(caught) == 3 and f"{bad}:000000011" in str(caught[0].message)


def test_unreadable_shard_is_reported(tmp_path):
    broken = tmp_path / "broken-000000.tar"
    broken.write_bytes(b"this is not a tar file" * 40)
    tally = MalformedTally()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(iter_retrieval_shards([str(broken), str(tmp_path / "missing.tar")], tally=tally)) == []
    assert tally.total == 2 and tally.counts == {"unreadable shard": 2}
    assert all("skipping malformed" in str(w.message) for w in caught)


def test_converter_cli(tmp_path, capsys):
    src = str(tmp_path / "tev.jsonl")
    _write_jsonl(src, [json.dumps(GOOD_TEVATRON), "{bad", json.dumps(GOOD_FLAG)])
    out = str(tmp_path / "flag.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["convert", src, "--out", out])
        main(["convert", src, "--shards", str(tmp_path / "sh"), "--prefix", "p", "--samples-per-shard", "1"])
    text = capsys.readouterr().out
    assert "wrote 2 examples" in text and "skipped 1 malformed" in text and f"{src}:2" in text
    with open(out) as f:
        records = [json.loads(line) for line in f]
    assert records[0] == {"idx": 0, "query": "who wrote hamlet", "pos": ["Hamlet a play by Shakespeare"],
                          "neg": ["a village"]}
    assert len(list(iter_retrieval_shards(str(tmp_path / "sh" / "p-{000000..000001}.tar")))) == 2
    assert os.path.exists(tmp_path / "sh" / "p.json")


def _examples_with_duplicates(n, seed=0):
    import random

    rng = random.Random(seed)
    pool = [f"doc {i}" for i in range(n // 2)]  # positives and negatives repeat across examples
    return [RetrievalExample(f"query {i % (n - 5)}", [rng.choice(pool)], [rng.choice(pool)]) for i in range(n)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_global_no_duplicates_sampler(world_size):
    examples = _examples_with_duplicates(120)
    texts = [example_texts(e) for e in examples]
    samplers = [GlobalNoDuplicatesBatchSampler(texts, 6, world_size=world_size, rank=r, seed=1, duplicates="drop")
                for r in range(world_size)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) > 3
    used = []
    for step in range(len(per_rank[0])):
        shares = [per_rank[r][step] for r in range(world_size)]
        assert all(len(s) == 6 // world_size for s in shares)
        global_batch = [i for s in shares for i in s]
        all_texts = [t for i in global_batch for t in set(texts[i])]
        assert len(all_texts) == len(set(all_texts)), f"duplicate text in global batch {step}"
        used += global_batch
    assert len(used) == len(set(used))  # every example at most once per epoch
    # a per-rank de-duplication (sentence-transformers) would let duplicates through on 2+ ranks
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != per_rank[0]


def test_sampler_validation():
    with pytest.raises(ValueError, match="divisible"):
        GlobalNoDuplicatesBatchSampler([("a",)] * 10, 5, world_size=2, rank=0)
    with pytest.raises(ValueError, match="rank"):
        GlobalNoDuplicatesBatchSampler([("a",)] * 10, 4, world_size=2, rank=2)
    with pytest.raises(ValueError, match="duplicates must be one of"):
        GlobalNoDuplicatesBatchSampler([("a",)] * 4, 2, duplicates="skip")
    # all texts equal: the strict rule forms one example per batch, so with drop_last no batch of 2
    strict = GlobalNoDuplicatesBatchSampler([("a",)] * 4, 2, duplicates="drop")
    assert list(strict) == [] and len(strict) == 0 and strict.unused == 4
    assert len(list(GlobalNoDuplicatesBatchSampler([("a",)] * 4, 2, drop_last=False, duplicates="drop"))) == 4
    # the default defers them into batches with the repeat (the loss masks it), none lost
    deferred = GlobalNoDuplicatesBatchSampler([("a",)] * 4, 2)
    assert len(list(deferred)) == len(deferred) == 2 and deferred.unused == 0 and deferred.duplicate_batches == 2


def test_chatterbot_split_by_question():
    from ds_infcl.data.retrieval_chatterbot import chatterbot_retrieval_split

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = chatterbot_retrieval_split("english", heldout_fraction=0.2, seed=0)
    train_q = {ex.query for ex in split.train}
    assert len(train_q) == len(split.train) and not train_q & set(split.queries)
    assert len(split.queries) == len(split.relevant) > 100
    assert len(set(split.corpus)) == len(split.corpus)
    for ex in split.train:
        assert ex.pos and all(p in split.corpus for p in ex.pos)
    assert all(rel and max(rel) < len(split.corpus) for rel in split.relevant)
