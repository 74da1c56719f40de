# Over 500 lines on purpose: one streaming pair corpus in one place: the four source readers with their
# resumable positions, the weighted mixer, the windowed no-duplicate rule and the memory bound that ties them.
"""Streaming pair corpora: retrieval examples read from disk as they are trained on, never all
held in host memory.

A corpus is a list of *sources*, each a set of files in one format, with a weight:

- ``parquet``: local parquet files (pyarrow), one row per example, columns in the FlagEmbedding
  (``query``, ``pos``, ``neg``) or Tevatron (``query``, ``positive_passages``,
  ``negative_passages``) shape; read ``read_ahead`` rows at a time.
- ``jsonl``: jsonl files, plain or gzip-compressed (``.jsonl.gz``), one record per line.
- ``wds``: webdataset text shards as written by ``write_retrieval_shards`` (one ``.json`` member
  per example).
- ``hf``: Hugging Face ``datasets`` in streaming mode over local parquet or jsonl files (the
  ``parquet`` or ``json`` builder, ``load_dataset(..., streaming=True)``); nothing is downloaded.

Each source is an endless reader: at the end of its files it starts its next *epoch* (the file
order reshuffled from the seed, for the local formats). Its position is ``(epoch, file index,
record offset)``, where the offset counts raw records (malformed ones included), so a reader
re-opened at a position continues with exactly the next record: parquet seeks to the row group
and slices; jsonl, jsonl.gz and shards skip the records before the offset; an HF stream loads its
own ``state_dict()`` taken at the start of the read-ahead chunk, then skips the rows of the chunk
already taken (fewer than ``read_ahead``).

:class:`PairStream` mixes the sources into *global* batches (all ranks together):

- Without ``per_source_batches`` every example's source is drawn by weight; with it every global
  batch comes from one source, drawn by weight (the per-task batches of BGE and E5: in-batch
  negatives from another task are too easy and dilute the loss).
- The draws come from a counter-based RNG (draw ``k`` is ``Random(f"{seed}:...:{k}")``): the
  whole random state is two integers, part of the position.
- The windowed no-duplicate rule: no text (query, positive or negative) occurs twice in a global
  batch. An example that would repeat a text of the batch being built is *deferred* into a buffer
  of at most ``window`` examples and tried again, first, for the following batches (for the same
  source in per-source mode); when the buffer is full its oldest example is *dropped*. Deferrals
  and drops are counted (``counts``). ``window=0`` drops every repeating example at once.
- Every rank runs the same stream with the same seed and keeps its contiguous share of each global
  batch: no communication, the same batch order on every rank, at the cost of each rank reading
  (and parsing) the whole stream: ``world_size`` times the reading of one reader.

Each source may draw its examples from a seeded shuffle buffer of ``shuffle_buffer`` examples
(webdataset's ``shuffle(n)``); by default examples come in the files' order.

Host memory is bounded by construction, and the bound is checked: the examples held at any time
(the read-ahead buffers, at most ``read_ahead`` per source; the shuffle buffers; the deferred
buffer, at most ``window``; the global batch being built) never exceed
``held_bound = global_batch_size + window + (read_ahead + shuffle_buffer) * len(sources) + 1``; ``peak_held`` is the
largest number observed, and a count above the bound raises ``RuntimeError``.

The position, the RNG counters, the deferred and shuffle-buffer examples themselves and the
counts are :meth:`PairStream.state_dict` (plain lists, dicts, strings and numbers):
``load_state_dict`` continues with exactly the batches an uninterrupted stream would give.

Malformed records are skipped, counted in a :class:`MalformedTally` with their location
(``file:line``, ``file:row N``, ``shard:key``, ``hf:<files>#N``) and warned about, as by the
in-memory readers of ``ds_infcl.data.retrieval``.

Imports pyarrow, gzip, webdataset (through the shard reader) and, for ``hf`` sources only,
``datasets``; never the loss, never deepspeed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from ds_infcl.data.retrieval import (
    MalformedTally,
    RetrievalExample,
    _report,
    example_texts,
    not_utf8_reason,
    parse_retrieval_record,
)
from ds_infcl.data.shards import ShardReport, expand_shard_source, iter_shard_samples

__all__ = ["FORMATS", "PairSource", "parse_sources", "SourceReader", "PairStream"]

FORMATS = ("parquet", "jsonl", "wds", "hf")
_EXTS = {"parquet": (".parquet",), "jsonl": (".jsonl", ".jsonl.gz"), "wds": (".tar",)}
_SOURCE_KEYS = ("path", "weight", "format", "name")


@dataclass
class PairSource:
    """One source of a streaming corpus.

    Args:
        path: a file, a folder (its files of the format, sorted), a glob pattern, or a list of
            these; for ``wds`` also brace patterns.
        weight: relative share of the examples (or of the global batches, per-source) drawn from it.
        format: ``parquet``, ``jsonl`` (also ``.jsonl.gz``), ``wds`` or ``hf``; inferred from the
            file names when left out (``hf`` is never inferred).
        name: for reports (default: ``source<i>``).
    """

    path: Any
    weight: float = 1.0
    format: Optional[str] = None
    name: Optional[str] = None
    files: Tuple[str, ...] = ()


def _infer_format(path: str) -> Optional[str]:
    for fmt, exts in _EXTS.items():
        if path.endswith(exts):
            return fmt
    return None


def _list_files(path: Any, fmt: str) -> List[str]:
    items = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    if fmt == "wds":
        return expand_shard_source(items, check=True)
    exts = _EXTS["parquet"] + _EXTS["jsonl"] if fmt == "hf" else _EXTS[fmt]
    files: List[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(exts))
            if not found:
                raise ValueError(f"folder {item!r} holds no {'/'.join(exts)} file")
            files += found
        elif any(ch in item for ch in "*?["):
            found = sorted(glob.glob(item))
            if not found:
                raise ValueError(f"pattern {item!r} matches no file")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise ValueError(f"{item!r} does not exist; give a file, a folder or a glob pattern")
    return files


def parse_sources(specs: Sequence[Any]) -> List[PairSource]:
    """:class:`PairSource` objects from config dicts ``{"path", "weight", "format", "name"}``,
    their files listed and checked.

    Raises:
        ValueError: naming the source: not a list of objects, an unknown key or format, a weight
            that is not a positive number, a path that names no file.
    """
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError('give a non-empty list of sources, e.g. [{"path": "data/en/", "weight": 1.0}]')
    out: List[PairSource] = []
    for i, spec in enumerate(specs):
        where = f"source {i}"
        if isinstance(spec, PairSource):
            spec = {"path": spec.path, "weight": spec.weight, "format": spec.format, "name": spec.name}
        if not isinstance(spec, dict) or "path" not in spec:
            raise ValueError(f"{where}: must be an object with a 'path' (and 'weight', 'format', 'name'), got {spec!r}")
        unknown = sorted(set(spec) - set(_SOURCE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are {list(_SOURCE_KEYS)}")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}: 'weight' must be a positive number, got {weight!r}")
        paths = spec["path"]
        first = os.fspath(paths if isinstance(paths, (str, os.PathLike)) else (list(paths) or [""])[0])
        fmt = spec.get("format")
        if fmt is None and not any(ch in first for ch in "*?[{") and not os.path.exists(first):
            raise ValueError(f"{where}: {first!r} does not exist; give a file, a folder or a glob pattern")
        if fmt is None:
            fmt = _infer_format(first)
            if fmt is None and os.path.isdir(first):
                kinds = {_infer_format(f) for f in os.listdir(first)} - {None}
                fmt = kinds.pop() if len(kinds) == 1 else None
            if fmt is None:
                raise ValueError(f"{where}: cannot tell the format of {first!r}; set 'format' to one of {list(FORMATS)}")
        if fmt not in FORMATS:
            raise ValueError(f"{where}: unknown format {fmt!r}; choose one of {list(FORMATS)}")
        try:
            files = _list_files(paths, fmt)
        except ValueError as e:
            raise ValueError(f"{where} ({fmt}): {e}") from None
        if fmt == "hf":
            kinds = {"parquet" if f.endswith(".parquet") else "json" for f in files}
            if len(kinds) != 1:
                raise ValueError(f"{where} (hf): mixes parquet and json files; give one kind per source")
        out.append(PairSource(path=paths, weight=float(weight), format=fmt, name=spec.get("name") or f"source{i}",
                              files=tuple(files)))
    return out


# -- raw records of one file, from an offset --------------------------------------------------------
# Each yields (location, record object or an error reason string); the offset counts these items.

def _jsonl_records(path: str, offset: int) -> Iterator[Tuple[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        n = 0
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue  # blank lines are not records
            n += 1
            if n <= offset:
                continue
            location = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield location, not_utf8_reason(e)
                continue
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as e:
                yield location, f"invalid JSON ({e.msg})"


def _no_nulls(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in row.items() if v is not None}  # a null column reads as a missing field


def _parquet_records(path: str, offset: int, chunk: int) -> Iterator[Tuple[str, Any]]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as pf:
        meta = pf.metadata
        start, rg = 0, 0
        while rg < meta.num_row_groups and start + meta.row_group(rg).num_rows <= offset:
            start += meta.row_group(rg).num_rows
            rg += 1
        if rg == meta.num_row_groups:
            return
        row = start
        for batch in pf.iter_batches(batch_size=chunk, row_groups=list(range(rg, meta.num_row_groups))):
            if row + batch.num_rows <= offset:
                row += batch.num_rows
                continue
            skip = max(offset - row, 0)
            rows = batch.slice(skip).to_pylist()
            row += skip
            del batch  # only the decoded rows stay while they are handed out
            for r in rows:
                yield f"{path}:row {row}", _no_nulls(r)
                row += 1


def _wds_records(path: str, offset: int) -> Iterator[Tuple[str, Any]]:
    report = ShardReport(path)
    n = 0
    for sample in iter_shard_samples(path, report, sample_exts=("json",)):
        n += 1
        if n <= offset:
            continue
        location = f"{path}:{sample.get('__key__', '?')}"
        raw = sample.get("json")
        if raw is None:
            yield location, "no .json member"
            continue
        try:
            yield location, json.loads(raw.decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            yield location, "invalid JSON"
    if report.damaged:
        # The rest of the shard is lost (how many is unknown without a manifest). The damage is one
        # more record, so that a reader resumed past it does not count it again.
        n += 1
        if n > offset:
            yield f"{report.where()}; read {report.num_samples} samples", "unreadable shard"


class _HFRecords:
    """The rows of an HF ``datasets`` stream from ``offset``. ``mark = (row, state)`` is a row
    number with the stream's own ``state_dict()`` there: from it the stream resumes without
    reading the rows before (``load_state_dict``), then skips ``offset - row`` rows; without a mark
    it reads and skips ``offset`` rows."""

    def __init__(self, files: Sequence[str], offset: int, mark: Optional[Tuple[int, Dict[str, Any]]] = None):
        import datasets

        builder = "parquet" if files[0].endswith(".parquet") else "json"
        self.ds = datasets.load_dataset(builder, data_files=list(files), split="train", streaming=True)
        self.label = files[0] if len(files) == 1 else f"{os.path.dirname(files[0]) or '.'} ({len(files)} files)"
        self.offset = offset
        self._opened_at: Tuple[int, Optional[Dict[str, Any]]] = (0, None)
        if mark is not None and mark[1] is not None and mark[0] <= offset:
            self._opened_at = (int(mark[0]), mark[1])
            self.ds.load_state_dict(mark[1])
        self.pos = self._opened_at[0]  # the stream's next row
        self._pulled = False
        self._it = self._rows()

    def _rows(self) -> Iterator[Tuple[str, Any]]:
        for row in self.ds:
            n, self.pos, self._pulled = self.pos, self.pos + 1, True
            if n >= self.offset:
                yield f"hf:{self.label}#{n}", _no_nulls(dict(row))

    def __iter__(self):
        return self

    def __next__(self) -> Tuple[str, Any]:
        return next(self._it)

    def mark(self) -> Tuple[int, Optional[Dict[str, Any]]]:
        """``(row, state)``: the stream's next row and its ``state_dict()`` there (plain values).
        Before the first row is read, ``state_dict()`` would not yet reflect a loaded state: the
        mark the stream was opened with is returned (``state`` ``None``: the stream's start)."""
        if not self._pulled:
            return self._opened_at
        return self.pos, json.loads(json.dumps(self.ds.state_dict()))


class SourceReader:
    """An endless, resumable reader of one source: ``next_example()`` returns the next valid
    example (malformed records counted in ``tally`` and skipped).

    ``buffer`` holds at most ``read_ahead`` decoded records. Position: ``epoch``, ``file_pos``
    (index into the epoch's file order), ``offset`` (raw records of that file already taken).
    """

    def __init__(self, source: PairSource, index: int, *, seed: int, tally: MalformedTally,
                 read_ahead: int = 256, shuffle_files: bool = True, require_negative: bool = False,
                 shuffle_buffer: int = 0):
        self.source = source
        self.shuffle_buffer = shuffle_buffer
        self.pool: List[RetrievalExample] = []  # the shuffle buffer (at most shuffle_buffer examples)
        self.shuffle_draws = 0
        self.index = index
        self.seed = seed
        self.tally = tally
        self.read_ahead = read_ahead
        self.shuffle_files = shuffle_files and source.format != "hf"
        self.require_negative = require_negative
        # an hf source is one stream over all its files
        self.units: List[Any] = [tuple(source.files)] if source.format == "hf" else list(source.files)
        self.epoch, self.file_pos, self.offset = 0, 0, 0
        self.valid_in_epoch = 0  # valid examples taken in this epoch (an epoch without one is an error)
        self.buffer: Deque[Tuple[str, Any]] = deque()
        self._it: Optional[Iterator[Tuple[str, Any]]] = None
        self._file_done = False  # the current file has no record left beyond the buffer
        self.hf_mark: Optional[Tuple[int, Optional[Dict[str, Any]]]] = None  # hf: (row, stream state there)

    def _order(self) -> List[Any]:
        order = list(self.units)
        if self.shuffle_files:
            random.Random(f"{self.seed}:files:{self.index}:{self.epoch}").shuffle(order)
        return order

    def _open(self) -> Iterator[Tuple[str, Any]]:
        unit = self._order()[self.file_pos]
        fmt = self.source.format
        if fmt == "jsonl":
            return _jsonl_records(unit, self.offset)
        if fmt == "parquet":
            return _parquet_records(unit, self.offset, self.read_ahead)
        if fmt == "wds":
            return _wds_records(unit, self.offset)
        return _HFRecords(unit, self.offset, self.hf_mark)

    def _fill(self) -> None:
        """Refill the empty buffer with up to ``read_ahead`` records, moving to the next file
        (and epoch) at a file's end."""
        while not self.buffer:
            if self._file_done:
                self._file_done = False
                self._next_file()
            if self._it is None:
                self._it = self._open()
            if isinstance(self._it, _HFRecords):  # the buffer is empty: a resume may start here
                self.hf_mark = self._it.mark()
            for item in self._it:
                self.buffer.append(item)
                if len(self.buffer) >= self.read_ahead:
                    break
            else:  # this file is done once the buffer is taken
                self._it, self._file_done = None, True

    def _next_file(self) -> None:
        self.file_pos, self.offset, self.hf_mark = self.file_pos + 1, 0, None
        if self.file_pos == len(self.units):
            if self.valid_in_epoch == 0:
                raise ValueError(
                    f"source {self.source.name!r} ({self.source.format}): a whole pass over its "
                    f"{len(self.units)} file(s) gave no valid example ({self.tally.total} malformed records so "
                    f"far: {self.tally.counts}; first at {', '.join(self.tally.where[:3])}); fix or remove the source"
                )
            self.epoch, self.file_pos, self.valid_in_epoch = self.epoch + 1, 0, 0

    def next_example(self) -> RetrievalExample:
        """The next example: in read order, or, with a shuffle buffer, one drawn from a pool of
        ``shuffle_buffer`` examples (webdataset's ``shuffle(n)``), refilled from the read order."""
        if not self.shuffle_buffer:
            return self._next_valid()
        while len(self.pool) < self.shuffle_buffer:
            self.pool.append(self._next_valid())
        i = random.Random(f"{self.seed}:shuffle:{self.index}:{self.shuffle_draws}").randrange(len(self.pool))
        self.shuffle_draws += 1
        ex = self.pool[i]
        self.pool[i] = self.pool[-1]
        self.pool.pop()
        return ex

    def _next_valid(self) -> RetrievalExample:
        while True:
            self._fill()
            location, obj = self.buffer.popleft()
            self.offset += 1
            if isinstance(obj, str):
                _report(self.tally, obj, location)
                continue
            try:
                ex = parse_retrieval_record(obj)
            except ValueError as e:
                _report(self.tally, str(e), location)
                continue
            if self.require_negative and not any(n not in ex.pos for n in ex.neg):
                _report(self.tally, "no hard negative (num_negatives > 0)", location)
                continue
            ex.source = location
            self.valid_in_epoch += 1
            return ex

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"epoch": self.epoch, "file_pos": self.file_pos, "offset": self.offset,
                                 "valid_in_epoch": self.valid_in_epoch}
        if self.shuffle_buffer:
            state["shuffle_draws"] = self.shuffle_draws
            state["pool"] = [[ex.to_record(), ex.source] for ex in self.pool]
        if self.hf_mark is not None:
            state["hf_mark"] = [self.hf_mark[0], self.hf_mark[1]]
        return state

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.file_pos = int(state["epoch"]), int(state["file_pos"])
        self.offset, self.valid_in_epoch = int(state["offset"]), int(state["valid_in_epoch"])
        self.shuffle_draws = int(state.get("shuffle_draws", 0))
        self.pool = []
        for record, location in state.get("pool", []):
            ex = parse_retrieval_record(record)
            ex.source = location
            self.pool.append(ex)
        mark = state.get("hf_mark")
        self.hf_mark = (int(mark[0]), mark[1]) if mark is not None else None
        if not 0 <= self.file_pos < len(self.units):
            raise ValueError(f"source {self.source.name!r}: saved file position {self.file_pos} but the source has "
                             f"{len(self.units)} file(s); resume with the sources of the saved run")
        self.buffer.clear()
        self._it, self._file_done = None, False


def _pick(weights: Sequence[float], u: float) -> int:
    total, acc = sum(weights), 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return i
    return len(weights) - 1


class PairStream:
    """Global batches of examples from weighted streaming sources, with the windowed
    no-duplicate rule (module docstring).

    Args:
        sources: :class:`PairSource` objects or their config dicts (``parse_sources``).
        global_batch_size: examples per global batch (all ranks).
        window: at most this many deferred examples are kept (default 1024).
        per_source_batches: every global batch from one source, drawn by weight.
        deduplicate: apply the no-duplicate rule (``False``: examples in stream order).
        seed: the seed of every draw and of the file order.
        read_ahead: records decoded ahead per source (parquet batch size).
        shuffle_buffer: per source, examples come from a seeded pool of this many (0: read order).
        shuffle_files: reshuffle each local source's file order every epoch.
        require_negative: skip (and count) examples without a hard negative.
        tally: where malformed records are counted.
        max_pulls: a global batch that needs more stream examples than this raises (default
            ``10 * (global_batch_size + window) + 100``): the sources repeat their texts too
            often to fill a batch without a repeat.

    ``next_global_batch()`` returns ``(source index or None, examples)``; ``ex.idx`` is the
    example's number in the stream (unique over the run).
    """

    def __init__(self, sources: Sequence[Any], global_batch_size: int, *, window: int = 1024,
                 per_source_batches: bool = False, deduplicate: bool = True, seed: int = 0, read_ahead: int = 256,
                 shuffle_files: bool = True, require_negative: bool = False, tally: Optional[MalformedTally] = None,
                 max_pulls: Optional[int] = None, shuffle_buffer: int = 0):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an integer >= 0, got {window!r}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 1:
            raise ValueError(f"read_ahead must be an integer >= 1, got {read_ahead!r}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be an integer >= 0, got {shuffle_buffer!r}")
        self.sources = parse_sources(sources)
        self.weights = [s.weight for s in self.sources]
        self.global_batch_size = global_batch_size
        self.window = window
        self.per_source_batches = per_source_batches
        self.deduplicate = deduplicate
        self.seed = seed
        self.tally = tally if tally is not None else MalformedTally()
        self.readers = [SourceReader(s, i, seed=seed, tally=self.tally, read_ahead=read_ahead,
                                     shuffle_files=shuffle_files, require_negative=require_negative,
                                     shuffle_buffer=shuffle_buffer)
                        for i, s in enumerate(self.sources)]
        self.max_pulls = max_pulls if max_pulls is not None else 10 * (global_batch_size + window) + 100
        self.held_bound = global_batch_size + window + (read_ahead + shuffle_buffer) * len(self.sources) + 1
        self.deferred: Deque[Tuple[int, RetrievalExample]] = deque()
        self.batches_made = 0  # global batches formed (the per-source draw counter)
        self.draws = 0  # per-example source draws
        self.emitted = 0  # examples taken from the readers (the next example's idx)
        self.counts: Dict[str, Any] = self._zero_counts()
        self.peak_held = 0
        self._building = 0

    def _zero_counts(self) -> Dict[str, Any]:
        n = len(self.sources)
        return {"deferred": 0, "dropped": 0, "examples_per_source": [0] * n, "batches_per_source": [0] * n}

    # -- memory accounting ----------------------------------------------------------------------

    def held(self) -> int:
        """Examples held now: read-ahead buffers + shuffle buffers + deferred buffer + the batch
        being built."""
        return sum(len(r.buffer) + len(r.pool) for r in self.readers) + len(self.deferred) + self._building

    def _check_held(self, extra: int = 0) -> None:
        held = self.held() + extra
        self.peak_held = max(self.peak_held, held)
        if held > self.held_bound:
            raise RuntimeError(f"PairStream holds {held} examples, above its bound {self.held_bound} "
                               "(global batch + window + read-ahead): a bug, please report it")

    # -- batches ------------------------------------------------------------------------------

    def _draw_source(self) -> int:
        u = random.Random(f"{self.seed}:example:{self.draws}").random()
        self.draws += 1
        return _pick(self.weights, u)

    def next_global_batch(self) -> Tuple[Optional[int], List[RetrievalExample]]:
        only: Optional[int] = None
        if self.per_source_batches:
            only = _pick(self.weights, random.Random(f"{self.seed}:batch:{self.batches_made}").random())
        batch: List[Tuple[int, RetrievalExample]] = []
        seen: Set[str] = set()

        def fits(ex: RetrievalExample) -> bool:
            return not self.deduplicate or not (set(example_texts(ex)) & seen)

        def add(src: int, ex: RetrievalExample) -> None:
            batch.append((src, ex))
            self._building = len(batch)
            if self.deduplicate:
                seen.update(example_texts(ex))

        if self.deferred:  # deferred examples first, in the order they were deferred
            keep: Deque[Tuple[int, RetrievalExample]] = deque()
            for src, ex in self.deferred:
                if len(batch) < self.global_batch_size and (only is None or src == only) and fits(ex):
                    add(src, ex)
                else:
                    keep.append((src, ex))
            self.deferred = keep
        pulls = 0
        while len(batch) < self.global_batch_size:
            if pulls >= self.max_pulls:
                name = "the sources" if only is None else f"source {self.sources[only].name!r}"
                raise ValueError(
                    f"global batch {self.batches_made}: {pulls} examples read from {name} without filling "
                    f"{self.global_batch_size} examples with no repeated text ({len(batch)} placed, "
                    f"{self.counts['dropped']} dropped so far): the data repeats its texts too often for this batch; "
                    "use a smaller global batch, de-duplicate the data, or a larger window"
                )
            src = only if only is not None else self._draw_source()
            ex = self.readers[src].next_example()
            ex.idx = self.emitted
            self.emitted += 1
            pulls += 1
            self._check_held(extra=1)
            if fits(ex):
                add(src, ex)
            else:
                self.deferred.append((src, ex))
                self.counts["deferred"] += 1
                if len(self.deferred) > self.window:
                    self.deferred.popleft()
                    self.counts["dropped"] += 1
        self._check_held()
        self._building = 0
        self.batches_made += 1
        for src, _ in batch:
            self.counts["examples_per_source"][src] += 1
        if only is not None:
            self.counts["batches_per_source"][only] += 1
        else:
            for src in {s for s, _ in batch}:
                self.counts["batches_per_source"][src] += 1
        return only, [ex for _, ex in batch]

    def __iter__(self) -> Iterator[List[RetrievalExample]]:
        while True:
            yield self.next_global_batch()[1]

    # -- position -----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The position: plain values (JSON and ``torch.load(weights_only=True)`` safe)."""
        return {
            "version": 1,
            "sources": [[s.name, s.format, len(s.files)] for s in self.sources],
            "readers": [r.state_dict() for r in self.readers],
            "batches_made": self.batches_made, "draws": self.draws, "emitted": self.emitted,
            "deferred": [[src, ex.to_record(), ex.source] for src, ex in self.deferred],
            "counts": json.loads(json.dumps(self.counts)),
            "malformed": {"counts": dict(self.tally.counts), "where": list(self.tally.where)},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state`` (a ``state_dict()`` of a stream over the same sources).

        Raises:
            ValueError: the saved sources (names, formats, file counts) are not these.
        """
        if state.get("version") != 1:
            raise ValueError(f"unknown stream state version {state.get('version')!r}")
        mine = [[s.name, s.format, len(s.files)] for s in self.sources]
        saved = [list(x) for x in state["sources"]]
        if saved != mine:
            raise ValueError(f"the saved stream read the sources {saved} (name, format, files) but this run has {mine}; "
                             "resume with the sources of the saved run")
        for reader, rs in zip(self.readers, state["readers"]):
            reader.load_state_dict(rs)
        self.batches_made, self.draws = int(state["batches_made"]), int(state["draws"])
        self.emitted = int(state["emitted"])
        self.deferred = deque()
        for src, record, location in state["deferred"]:
            ex = parse_retrieval_record(record)
            ex.source = location
            self.deferred.append((int(src), ex))
        self.counts = json.loads(json.dumps(state["counts"]))
        self.tally.counts = dict(state["malformed"]["counts"])
        self.tally.where = list(state["malformed"]["where"])
