"""Streaming pair corpora (ds_infcl.data.pair_stream): a 3-source parquet / jsonl.gz / jsonl mix
read under a host-memory bound smaller than the data with the weights honoured, per-source
batches, the windowed no-duplicate rule with its counts, malformed records named by location,
the webdataset and HF-streaming sources, and an exact resume from a saved position."""

import gzip
import json
import os
import random
import tracemalloc
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ds_infcl.data.pair_stream import PairStream, parse_sources
from ds_infcl.data.retrieval import RetrievalExample, example_texts, write_retrieval_shards


def _rec(tag, i, pad=0):
    filler = " " + "x" * pad if pad else ""
    return {"query": f"{tag} query {i}{filler}", "pos": [f"{tag} pos {i}{filler}"],
            "neg": [f"{tag} neg {i}{filler}", f"{tag} neg {i}b{filler}"]}


def _write_parquet(folder, tag, n, files=2, row_group=25, pad=0, tevatron=False):
    os.makedirs(folder, exist_ok=True)
    per = n // files
    for f in range(files):
        rows = [_rec(tag, f * per + i, pad) for i in range(per)]
        if tevatron:
            rows = [{"query": r["query"], "positive_passages": [{"docid": "d", "title": "", "text": r["pos"][0]}],
                     "negative_passages": [{"docid": "n", "title": "T", "text": t} for t in r["neg"]]} for r in rows]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, f"part-{f:03d}.parquet"),
                       row_group_size=row_group)


def _write_jsonl(path, records, gz=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)
    return len(data)


def _three_sources(tmp_path, n=600, pad=0):
    _write_parquet(tmp_path / "a", "A", n, files=3, pad=pad)
    _write_jsonl(str(tmp_path / "b" / "b0.jsonl.gz"), [_rec("B", i, pad) for i in range(n // 2)], gz=True)
    _write_jsonl(str(tmp_path / "b" / "b1.jsonl.gz"), [_rec("B", i, pad) for i in range(n // 2, n)], gz=True)
    _write_jsonl(str(tmp_path / "c" / "c.jsonl"), [_rec("C", i, pad) for i in range(n)])
    return [{"path": str(tmp_path / "a"), "weight": 0.5, "name": "a"},
            {"path": str(tmp_path / "b" / "*.jsonl.gz"), "weight": 0.3, "format": "jsonl", "name": "b"},
            {"path": str(tmp_path / "c" / "c.jsonl"), "weight": 0.2, "name": "c"}]


def _key(ex: RetrievalExample):
    return (ex.idx, ex.query, tuple(ex.pos), tuple(ex.neg), ex.source)


def test_three_source_mix_under_a_memory_bound_smaller_than_the_data_with_the_weights(tmp_path):
    n = 2000  # per source; about 1 KB per record
    sources = _three_sources(tmp_path, n=n, pad=250)
    data_bytes = sum(len(json.dumps(_rec(t, i, 250))) for t in "ABC" for i in range(n))
    stream = PairStream(sources, 32, window=64, read_ahead=32, seed=3)
    assert stream.held_bound == 32 + 64 + 3 * 32 + 1 < 3 * n / 20
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        per_source = {"A": 0, "B": 0, "C": 0}
        seen_queries = {"A": set(), "B": set(), "C": set()}
        num_batches = 100  # 3,200 examples: the sources are read far past their read-ahead
        for _ in range(num_batches):
            src, batch = stream.next_global_batch()
            assert src is None and len(batch) == 32
            texts = [t for ex in batch for t in example_texts(ex)]
            assert len(texts) == len(set(texts))
            for ex in batch:
                tag = ex.query[0]
                # independent of the counters: the source is the file the example came from
                assert ex.source.startswith(str(tmp_path / {"A": "a", "B": "b", "C": "c"}[tag]))
                assert ex.query not in seen_queries[tag]  # no source is past its first epoch
                seen_queries[tag].add(ex.query)
                per_source[tag] += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The instrumented count of examples held never passed the bound (a count above it raises).
    assert 0 < stream.peak_held <= stream.held_bound
    # The Python heap stayed far below the data (the whole corpus as Python objects is several x).
    assert peak < data_bytes / 4, (peak, data_bytes)
    total = 32 * num_batches
    for tag, w in zip("ABC", (0.5, 0.3, 0.2)):
        assert abs(per_source[tag] / total - w) < 0.03, per_source  # ~4 standard deviations
    assert stream.counts["examples_per_source"] == [per_source[t] for t in "ABC"]
    assert stream.counts["deferred"] == stream.counts["dropped"] == 0  # all texts distinct
    assert stream.tally.total == 0
    assert [ex.idx for _, b in [stream.next_global_batch()] for ex in b] == list(range(total, total + 32))


def test_per_source_batches_come_from_one_source_drawn_by_weight(tmp_path):
    sources = _three_sources(tmp_path, n=300)
    stream = PairStream(sources, 8, per_source_batches=True, window=16, read_ahead=16, seed=1)
    counts = [0, 0, 0]
    for _ in range(400):
        src, batch = stream.next_global_batch()
        assert {ex.query[0] for ex in batch} == {"ABC"[src]}
        counts[src] += 1
    assert stream.counts["batches_per_source"] == counts
    for c, w in zip(counts, (0.5, 0.3, 0.2)):
        assert abs(c / 400 - w) < 0.1, counts


def _dup_records(n, shared, seed=0):
    # `shared` distinct positives, drawn at random: neighbouring examples often share one
    rng = random.Random(seed)
    return [{"query": f"q{i}", "pos": [f"p{rng.randrange(shared) if shared > 1 else 0}"], "neg": [f"n{i}"]}
            for i in range(n)]


@pytest.mark.parametrize("window", [0, 2, 64])
def test_no_text_twice_in_a_global_batch_within_the_window(tmp_path, window):
    _write_jsonl(str(tmp_path / "d.jsonl"), _dup_records(1000, 12))
    stream = PairStream([{"path": str(tmp_path / "d.jsonl")}], 6, window=window, read_ahead=8, shuffle_files=False)
    placed = 0
    for _ in range(100):
        _, batch = stream.next_global_batch()
        texts = [t for ex in batch for t in example_texts(ex)]
        assert len(texts) == len(set(texts)), texts
        placed += len(batch)
    c = stream.counts
    # every example read is placed, still deferred or dropped: nothing vanishes uncounted
    assert stream.emitted == placed + len(stream.deferred) + c["dropped"]
    assert len(stream.deferred) <= window
    assert c["deferred"] > 0
    if window == 0:
        assert c["dropped"] == c["deferred"]
    if window == 64:
        assert c["dropped"] == 0  # 12 distinct positives, batches of 6: the window absorbs all


def test_no_dedup_keeps_stream_order_and_an_unfillable_batch_is_an_error(tmp_path):
    _write_jsonl(str(tmp_path / "d.jsonl"), _dup_records(40, 10))
    plain = PairStream([{"path": str(tmp_path / "d.jsonl")}], 20, deduplicate=False, shuffle_files=False)
    assert [ex.query for ex in plain.next_global_batch()[1]] == [f"q{i}" for i in range(20)]
    _write_jsonl(str(tmp_path / "one.jsonl"), _dup_records(40, 1))  # one positive for all
    stuck = PairStream([{"path": str(tmp_path / "one.jsonl")}], 2, window=4)
    with pytest.raises(ValueError, match="repeats its texts too often"):
        stuck.next_global_batch()


def test_malformed_records_are_counted_with_their_location(tmp_path):
    gz = str(tmp_path / "m" / "m.jsonl.gz")
    _write_jsonl(gz, [_rec("M", 0), "{not json", {"query": "q", "pos": []}, "", _rec("M", 1)], gz=True)
    pq.write_table(pa.Table.from_pylist([_rec("P", 0), {"query": None, "pos": ["x"], "neg": []}]),
                   str(tmp_path / "p.parquet"))
    stream = PairStream([{"path": gz}, {"path": str(tmp_path / "p.parquet")}], 3, per_source_batches=False,
                        shuffle_files=False, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        queries = [ex.query for _ in range(4) for ex in stream.next_global_batch()[1]]
    assert set(queries) <= {"M query 0", "M query 1", "P query 0"}
    assert f"{gz}:2" in stream.tally.where and f"{gz}:3" in stream.tally.where
    assert f"{tmp_path / 'p.parquet'}:row 1" in stream.tally.where
    assert stream.tally.counts["invalid JSON (Expecting property name enclosed in double quotes)"] >= 1
    assert any(f"{gz}:2" in str(w.message) for w in caught)


def test_a_source_with_no_valid_record_is_an_error_naming_it(tmp_path):
    _write_jsonl(str(tmp_path / "bad.jsonl"), ["{x", "[]"])
    stream = PairStream([{"path": str(tmp_path / "bad.jsonl"), "name": "broken"}], 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'broken'.*no valid example"):
            stream.next_global_batch()


def test_wds_and_hf_streaming_sources_read_the_same_records(tmp_path):
    records = [_rec("W", i) for i in range(30)]
    write_retrieval_shards([RetrievalExample(**r) for r in records], str(tmp_path / "shards"), samples_per_shard=7)
    _write_parquet(tmp_path / "hfp", "H", 30, files=2, row_group=4, tevatron=True)
    _write_jsonl(str(tmp_path / "hfj" / "x.jsonl"), [_rec("J", i) for i in range(30)])
    for spec, tag in (({"path": str(tmp_path / "shards")}, "W"), ({"path": str(tmp_path / "hfp"), "format": "hf"}, "H"),
                      ({"path": str(tmp_path / "hfj"), "format": "hf"}, "J")):
        stream = PairStream([spec], 10, shuffle_files=False)
        got = [ex for _ in range(3) for ex in stream.next_global_batch()[1]]
        assert [ex.query for ex in got] == [f"{tag} query {i}" for i in range(30)]
        assert got[4].pos == [f"{tag} pos 4"]
        want_neg = [f"T {tag} neg 4", f"T {tag} neg 4b"] if tag == "H" else [f"{tag} neg 4", f"{tag} neg 4b"]
        assert got[4].neg == want_neg
        # the next epoch starts over
        assert stream.next_global_batch()[1][0].query == f"{tag} query 0"


@pytest.mark.parametrize("per_source, shuffle_buffer", [(False, 0), (True, 0), (False, 5)])
def test_resume_from_a_saved_position_gives_the_uninterrupted_batches(tmp_path, per_source, shuffle_buffer):
    sources = _three_sources(tmp_path, n=90)
    _write_jsonl(str(tmp_path / "d" / "d.jsonl"), _dup_records(50, 8) + ["{broken"])
    write_retrieval_shards([RetrievalExample(**_rec("W", i)) for i in range(40)], str(tmp_path / "w"),
                           samples_per_shard=9)
    sources += [{"path": str(tmp_path / "d"), "weight": 0.4, "name": "dups"},
                {"path": str(tmp_path / "w"), "weight": 0.2, "format": "wds", "name": "w"},
                {"path": str(tmp_path / "a"), "weight": 0.2, "format": "hf", "name": "hf"}]
    kwargs = dict(window=5, per_source_batches=per_source, read_ahead=7, seed=11, shuffle_buffer=shuffle_buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = PairStream(sources, 6, **kwargs)
        reference = [[_key(ex) for ex in full.next_global_batch()[1]] for _ in range(60)]
        first = PairStream(sources, 6, **kwargs)
        stop = 0
        while stop < 20 or not first.deferred:  # stop mid-epoch with examples in the deferred buffer
            first.next_global_batch()
            stop += 1
        assert stop < 40
        state = json.loads(json.dumps(first.state_dict()))  # plain values survive a JSON round trip
        # a reader drawn from keeps its shuffle buffer but the example just drawn
        assert all(len(r.get("pool", [])) == max(shuffle_buffer - 1, 0) for r in state["readers"]
                   if r.get("shuffle_draws", 1))
        resumed = PairStream(sources, 6, **kwargs)
        resumed.load_state_dict(state)
        rest = [[_key(ex) for ex in resumed.next_global_batch()[1]] for _ in range(60 - stop)]
    assert rest == reference[stop:]
    assert resumed.counts == full.counts
    assert resumed.tally.counts == full.tally.counts and full.tally.total >= 1
    assert max(r.epoch for r in full.readers) >= 1  # the resume crossed an epoch boundary of a source
    other = PairStream(sources[:2], 6, **kwargs)
    with pytest.raises(ValueError, match="resume with the sources of the saved run"):
        other.load_state_dict(state)


def test_bad_source_specs_name_what_is_wrong(tmp_path):
    _write_jsonl(str(tmp_path / "ok.jsonl"), [_rec("A", 0)])
    cases = [
        ([], "non-empty list"),
        ([{"path": str(tmp_path / "missing.jsonl")}], "does not exist"),
        ([{"path": str(tmp_path / "missing_folder")}], "missing_folder' does not exist"),
        ([{"path": str(tmp_path / "ok.jsonl"), "weight": 0}], "'weight' must be a positive number"),
        ([{"path": str(tmp_path / "ok.jsonl"), "format": "csv"}], r"unknown format 'csv'; choose one of"),
        ([{"path": str(tmp_path / "ok.jsonl"), "wieght": 1}], r"unknown key\(s\) \['wieght'\]"),
        ([{"path": str(tmp_path / "ok.txt")}], "cannot tell the format"),
        ([{"path": str(tmp_path / "*.parquet"), "format": "parquet"}], "matches no file"),
    ]
    (tmp_path / "ok.txt").write_text("x")
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_sources(spec)


def test_a_damaged_shard_is_counted_once_per_pass_also_across_a_resume(tmp_path):
    write_retrieval_shards([RetrievalExample(**_rec("W", i)) for i in range(27)], str(tmp_path / "w"),
                           samples_per_shard=9)
    shard = tmp_path / "w" / "retrieval-000001.tar"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)  # a member cut short: the shard's rest is lost
    kwargs = dict(window=0, read_ahead=4, shuffle_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = PairStream([{"path": str(tmp_path / "w")}], 4, **kwargs)
        reference = [[_key(ex) for ex in full.next_global_batch()[1]] for _ in range(12)]
        read = sum(1 for b in reference for k in b if "retrieval-000001" in k[4])
        assert 0 < read < 2 * 9  # part of the damaged shard was read, in each of 2 passes
        passes = full.readers[0].epoch + (full.readers[0].file_pos >= 2)
        assert full.tally.counts["unreadable shard"] == passes
        assert any("retrieval-000001.tar at byte" in w for w in full.tally.where)
        for stop in range(1, 12):
            first = PairStream([{"path": str(tmp_path / "w")}], 4, **kwargs)
            for _ in range(stop):
                first.next_global_batch()
            resumed = PairStream([{"path": str(tmp_path / "w")}], 4, **kwargs)
            resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
            assert [[_key(ex) for ex in resumed.next_global_batch()[1]] for _ in range(12 - stop)] == reference[stop:]
            assert resumed.tally.counts == full.tally.counts, stop


def test_an_hf_stream_resumes_from_its_own_state_at_every_position(tmp_path):
    _write_parquet(tmp_path / "h", "H", 30, files=2, row_group=4)
    spec = [{"path": str(tmp_path / "h"), "format": "hf"}]
    kwargs = dict(window=2, read_ahead=4)
    full = PairStream(spec, 3, **kwargs)
    reference = [[_key(ex) for ex in full.next_global_batch()[1]] for _ in range(25)]  # 2.5 passes
    for stop in range(1, 25):
        first = PairStream(spec, 3, **kwargs)
        for _ in range(stop):
            first.next_global_batch()
        state = json.loads(json.dumps(first.state_dict()))
        row, hf_state = state["readers"][0]["hf_mark"]
        # the position is the stream's own state at the read-ahead chunk's start, plus a few rows
        assert 0 <= state["readers"][0]["offset"] - row <= 4
        assert (hf_state is None) == (row == 0)
        resumed = PairStream(spec, 3, **kwargs)
        resumed.load_state_dict(state)
        got = [[_key(ex) for ex in resumed.next_global_batch()[1]] for _ in range(min(2, 25 - stop))]
        # a resumed stream saved and resumed again (its marks come from a stream that loaded a state)
        again = PairStream(spec, 3, **kwargs)
        again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
        got += [[_key(ex) for ex in again.next_global_batch()[1]] for _ in range(25 - stop - len(got))]
        assert got == reference[stop:], stop


def test_a_shuffle_buffer_mixes_the_read_order_within_its_size(tmp_path):
    _write_jsonl(str(tmp_path / "s.jsonl"), [_rec("S", i) for i in range(200)])
    spec = [{"path": str(tmp_path / "s.jsonl")}]
    stream = PairStream(spec, 10, shuffle_buffer=16, window=0, read_ahead=4, seed=2)
    order = [int(ex.query.split()[-1]) for _ in range(15) for ex in stream.next_global_batch()[1]]
    assert len(set(order)) == 150  # no example twice within the first pass
    assert order != sorted(order)
    # the k-th example out is one of the first k + 16 read: the buffer holds 16
    assert all(i <= k + 15 for k, i in enumerate(order))
    assert sum(abs(i - k) for k, i in enumerate(order)) / 150 > 2  # mixed, not nearly in order
    assert stream.peak_held <= stream.held_bound == 10 + 0 + (4 + 16) + 1
    assert PairStream(spec, 10, shuffle_buffer=16, window=0, read_ahead=4, seed=2).next_global_batch()[1][0].query \
        == "S query " + str(order[0])  # seeded: the same order again
