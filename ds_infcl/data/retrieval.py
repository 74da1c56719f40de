# Over 500 lines on purpose: the retrieval data format in one place: the jsonl and shard readers with their
# malformed-record accounting, the writers, the converter CLI and the sampler that keys on the same texts.
"""Dense-retrieval training data: jsonl and webdataset shards of query / positives / negatives.

One example is ``{"query": str, "pos": [str, ...], "neg": [str, ...]}`` (the FlagEmbedding
shape). Tevatron's shape is read as well and converted on the fly::

    {"query": str, "positive_passages": [{"docid": .., "title": .., "text": ..}, ...],
     "negative_passages": [...]}

(a passage becomes ``"title text"`` when it has a non-empty title, else ``text``). Both may carry
``"query_id"``/``"idx"``; every example gets a stable global index ``idx`` (its position in the
input stream when the record has none), which FastCLIP-style per-sample state keys on.

Malformed input is never dropped silently: a line that is not JSON, misses a field or has a
field of the wrong type is skipped, counted in a :class:`MalformedTally` and reported by a
``warnings.warn`` naming the file and the line number (the shard and the sample key for shards).

Shards: ``<prefix>-000000.tar, ...`` with one member ``<idx:09d>.json`` per example holding the
FlagEmbedding record plus ``idx``, and a ``<prefix>.json`` manifest (``ds_infcl.data.shards``).

The global no-duplicate sampler (:class:`GlobalNoDuplicatesBatchSampler`) forms each step's
*global* batch so that no text occurs twice in it across all ranks, then gives each rank its
contiguous share; sentence-transformers' ``NoDuplicatesBatchSampler`` only looks at one rank's
batch, so two ranks may still hold the same positive (a false negative for the ring's loss).
Examples that cannot be placed without a repeat are deferred, not dropped: by default they fill
the epoch's last batches (``duplicates="defer"``), and what an epoch leaves out is counted
(``sampler.unused``, ``sampler.duplicate_batches``).

Converter CLI::

    python -m ds_infcl.data.retrieval convert IN.jsonl [IN2.jsonl ...] --out OUT.jsonl
    python -m ds_infcl.data.retrieval convert IN.jsonl --shards OUT_DIR [--samples-per-shard N]

Imports torch and webdataset only; never the loss, never deepspeed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import tarfile
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from torch.utils.data import Sampler

from ds_infcl.data.shards import ShardReport, brace_pattern, expand_shard_source, iter_shard_samples
from ds_infcl.data.shards import known_shard_sizes, sample_key

__all__ = [
    "RetrievalExample",
    "MalformedTally",
    "parse_retrieval_record",
    "iter_retrieval_jsonl",
    "read_retrieval_jsonl",
    "write_retrieval_jsonl",
    "write_retrieval_shards",
    "iter_retrieval_shards",
    "example_texts",
    "GlobalNoDuplicatesBatchSampler",
    "main",
]

PathOrPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


@dataclass
class RetrievalExample:
    """One training query with its positive and (optional) hard-negative documents."""

    query: str
    pos: List[str]
    neg: List[str] = field(default_factory=list)
    idx: int = -1
    source: str = field(default="", compare=False)  # FILE:LINE or SHARD:KEY it was read from

    def to_record(self) -> Dict[str, Any]:
        return {"idx": self.idx, "query": self.query, "pos": list(self.pos), "neg": list(self.neg)}


class MalformedTally:
    """Counts skipped records by reason; ``total`` is their sum and ``where`` keeps the first
    locations (``file:line`` or ``shard:key``) for the report."""

    def __init__(self, max_locations: int = 20):
        self.counts: Dict[str, int] = {}
        self.where: List[str] = []
        self.max_locations = max_locations

    def add(self, reason: str, location: str, n: int = 1) -> None:
        """Count ``n`` records skipped for ``reason`` at ``location``."""
        self.counts[reason] = self.counts.get(reason, 0) + n
        if len(self.where) < self.max_locations:
            self.where.append(location)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __repr__(self) -> str:
        return f"MalformedTally(total={self.total}, counts={self.counts})"


def _str_list(value: Any, name: str, allow_empty: bool) -> List[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name!r} must be a list of strings, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name!r} is empty")
    return value


def _passage_text(p: Any, name: str) -> str:
    if isinstance(p, str):
        return p
    if not isinstance(p, dict) or not isinstance(p.get("text"), str):
        raise ValueError(f"{name!r} entries must be objects with a string 'text'")
    title = p.get("title") or ""
    if not isinstance(title, str):
        raise ValueError(f"{name!r} entry has a non-string 'title'")
    return f"{title} {p['text']}" if title.strip() else p["text"]


def parse_retrieval_record(obj: Any, default_idx: int = -1) -> RetrievalExample:
    """A :class:`RetrievalExample` from a FlagEmbedding or Tevatron record.

    Raises:
        ValueError: not an object, no string ``query``, no positive, a field of the wrong type.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"record must be a JSON object, got {type(obj).__name__}")
    query = obj.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ValueError("missing or empty string field 'query'")
    if "pos" in obj:
        pos = _str_list(obj["pos"], "pos", allow_empty=False)
        neg = _str_list(obj.get("neg", []), "neg", allow_empty=True)
    elif "positive_passages" in obj:
        raw_pos, raw_neg = obj["positive_passages"], obj.get("negative_passages", [])
        if not isinstance(raw_pos, list) or not raw_pos:
            raise ValueError("'positive_passages' must be a non-empty list")
        if not isinstance(raw_neg, list):
            raise ValueError("'negative_passages' must be a list")
        pos = [_passage_text(p, "positive_passages") for p in raw_pos]
        neg = [_passage_text(p, "negative_passages") for p in raw_neg]
    else:
        raise ValueError("no positives: expected 'pos' (FlagEmbedding) or 'positive_passages' (Tevatron)")
    idx = obj.get("idx", default_idx)
    if not isinstance(idx, int) or isinstance(idx, bool):
        raise ValueError(f"'idx' must be an integer, got {idx!r}")
    return RetrievalExample(query=query, pos=pos, neg=neg, idx=idx)


def _as_paths(paths: PathOrPaths) -> List[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def _report(tally: MalformedTally, reason: str, location: str, n: int = 1) -> None:
    tally.add(reason, location, n)
    what = "malformed retrieval record" if n == 1 else f"{n} retrieval records"
    warnings.warn(f"skipping {what} at {location}: {reason}", stacklevel=3)


_BOM = b"\xef\xbb\xbf"


def iter_text_lines(path: str) -> Iterator[Tuple[int, Union[str, UnicodeDecodeError]]]:
    """``(line_no, text)`` per line of a UTF-8 file, decoded line by line: a line that is not
    UTF-8 comes as ``(line_no, the UnicodeDecodeError)`` instead, so the caller can skip it and
    name ``file:line`` (decoding the whole file would fail at a buffer offset and end the read).
    A byte-order mark at the start of the file is dropped (``utf-8-sig``)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, e


def not_utf8_reason(e: UnicodeDecodeError) -> str:
    """``not UTF-8 (byte 0xff at column 12)``: a line's decoding error in words (column 1-based)."""
    return f"not UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"


def iter_retrieval_jsonl(
    paths: PathOrPaths, *, tally: Optional[MalformedTally] = None, strict: bool = False
) -> Iterator[RetrievalExample]:
    """Stream examples from one or more jsonl files (blank lines are ignored).

    A malformed line (not UTF-8, not JSON, a record of the wrong shape) is skipped with a warning
    ``skipping malformed retrieval record at FILE:LINE: reason`` and counted in ``tally``
    (``strict=True`` raises instead). A UTF-8 byte-order mark is accepted. Examples without an
    ``idx`` get their running position over all files.
    """
    tally = tally if tally is not None else MalformedTally()
    position = 0
    for path in _as_paths(paths):
        for line_no, line in iter_text_lines(path):
            location = f"{path}:{line_no}"
            if isinstance(line, UnicodeDecodeError):
                if strict:
                    raise ValueError(f"malformed retrieval record at {location}: {not_utf8_reason(line)}")
                _report(tally, not_utf8_reason(line), location)
                continue
            if not line.strip():
                continue
            try:
                ex = parse_retrieval_record(json.loads(line), default_idx=position)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                if strict:
                    raise ValueError(f"malformed retrieval record at {location}: {e}") from None
                reason = f"invalid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
                _report(tally, reason, location)
                continue
            position += 1
            ex.source = location
            yield ex


def read_retrieval_jsonl(paths: PathOrPaths, **kwargs) -> List[RetrievalExample]:
    """``list(iter_retrieval_jsonl(...))``."""
    return list(iter_retrieval_jsonl(paths, **kwargs))


def write_retrieval_jsonl(examples: Iterable[RetrievalExample], path: str) -> int:
    """Write examples in the FlagEmbedding shape (with ``idx``); returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex.to_record(), ensure_ascii=False) + "\n")
            n += 1
    return n


def write_retrieval_shards(
    examples: Iterable[RetrievalExample],
    out_dir: str,
    *,
    prefix: str = "retrieval",
    samples_per_shard: int = 10000,
    mtime: Optional[float] = None,
) -> Dict[str, Any]:
    """Write examples as webdataset shards ``<out_dir>/<prefix>-NNNNNN.tar`` plus a manifest.

    Each sample is one ``<idx:09d>.json`` member with the FlagEmbedding record; examples without
    an index (``idx < 0``) get their running position. Returns the manifest dict.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    os.makedirs(out_dir, exist_ok=True)
    mtime = time.time() if mtime is None else mtime
    counts: List[int] = []
    tar = None
    for position, ex in enumerate(examples):
        if tar is None or counts[-1] == samples_per_shard:
            if tar is not None:
                tar.close()
            tar = tarfile.open(os.path.join(out_dir, f"{prefix}-{len(counts):06d}.tar"), "w")
            counts.append(0)
        idx = ex.idx if ex.idx >= 0 else position
        record = dict(ex.to_record(), idx=idx)
        data = json.dumps(record, ensure_ascii=False).encode("utf-8")
        info = tarfile.TarInfo(f"{sample_key(idx)}.json")
        info.size, info.mtime, info.mode = len(data), mtime, 0o444
        tar.addfile(info, io.BytesIO(data))
        counts[-1] += 1
    if tar is not None:
        tar.close()
    manifest = {
        "pattern": brace_pattern(prefix, len(counts)) if counts else "",
        "num_shards": len(counts),
        "samples_per_shard": counts,
        "num_samples": sum(counts),
        "kind": "retrieval",
    }
    with open(os.path.join(out_dir, f"{prefix}.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def iter_retrieval_shards(
    urls: PathOrPaths, *, tally: Optional[MalformedTally] = None, strict: bool = False
) -> Iterator[RetrievalExample]:
    """Stream examples from retrieval shards (paths, brace patterns or folders of ``.tar``).

    A sample with no ``.json`` member, undecodable JSON or a malformed record is skipped with a
    warning naming ``shard:key`` and counted in ``tally``. A damaged shard (not a tar, truncated,
    a member cut short) is read up to the damage and the rest skipped with a warning naming the
    shard and the byte offset: when its manifest gives the shard's size, the examples lost are
    counted exactly (reason ``lost in damaged shard``), else once (reason ``unreadable shard``;
    the number lost is unknown). ``strict=True`` raises ``ValueError`` instead.
    """
    tally = tally if tally is not None else MalformedTally()
    shard_list = expand_shard_source(_as_paths(urls), check=False)
    sizes = dict(zip(shard_list, known_shard_sizes(shard_list)[0]))
    for shard in shard_list:
        report = ShardReport(shard)
        for sample in iter_shard_samples(shard, report, sample_exts=("json",)):
            key = sample.get("__key__", "?")
            location = f"{shard}:{key}"
            raw = sample.get("json")
            if raw is None:
                if strict:
                    raise ValueError(f"malformed retrieval sample at {location}: no .json member")
                _report(tally, "no .json member", location)
                continue
            try:
                ex = parse_retrieval_record(json.loads(raw.decode("utf-8-sig")))
            except (ValueError, UnicodeDecodeError) as e:
                if strict:
                    raise ValueError(f"malformed retrieval sample at {location}: {e}") from None
                reason = "invalid JSON" if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else str(e)
                _report(tally, reason, location)
                continue
            ex.source = location
            yield ex
        if report.damaged:
            if strict:
                raise ValueError(f"damaged retrieval shard {report.where()}")
            expected = sizes.get(shard)
            if expected is None:
                _report(tally, "unreadable shard", f"{report.where()}; the number of examples lost is unknown")
            else:
                lost = max(expected - report.num_samples, 0)
                _report(tally, "lost in damaged shard",
                        f"{report.where()}; {report.num_samples} of its {expected} examples read", lost)


def example_texts(ex: RetrievalExample) -> Tuple[str, ...]:
    """Every text of an example (query, positives, negatives): what must stay unique in a batch."""
    return (ex.query, *ex.pos, *ex.neg)


DUPLICATES = ("defer", "allow", "drop")


class GlobalNoDuplicatesBatchSampler(Sampler):
    """Batches whose *global* batch (all ranks together) holds no text twice, as far as the data
    allows, and that use every example of an epoch but a final partial global batch.

    For each step the sampler fills a global batch of ``global_batch_size`` example indices from a
    seeded permutation, skipping (and keeping for a later batch) any example that shares a text
    with one already in the batch, then yields this rank's contiguous share of
    ``global_batch_size // world_size`` indices. All ranks compute the same global batches, so no
    communication is needed. An example whose own texts repeat (e.g. a negative equal to its
    positive) is accepted on its own; the loss masks that case.

    When what is left of the epoch no longer yields a full batch without a repeated text (many
    examples sharing one positive, say), ``duplicates`` decides:

    - ``"defer"`` (default): the left-over examples still go into batches: each batch takes as
      many examples as fit without a repeat, then is topped up with the deferred ones, whose
      repeated texts the loss's false-negative masking handles. Only a final global batch
      smaller than ``global_batch_size`` can be dropped (``drop_last``).
    - ``"allow"``: no de-duplication at all: the permutation cut into global batches.
    - ``"drop"``: the strict rule of earlier versions: the epoch ends at the first batch that
      cannot be filled without a repeat (``drop_last=False``: partial batches without repeats).

    What an epoch leaves out is counted: ``unused`` (examples in no batch) and
    ``duplicate_batches`` (batches holding a text in two examples), for the current epoch, the
    same on every rank. ``len(sampler)`` is the exact number of batches.

    Args:
        texts: per example, the texts that must not repeat in a global batch (see
            ``example_texts``); strings are compared exactly.
        global_batch_size: examples per step over all ranks; divisible by ``world_size``.
        world_size, rank: the data-parallel layout (default a single process).
        seed: permutation seed; ``set_epoch(e)`` reshuffles deterministically.
        drop_last: drop a last global batch that could not be filled (default True: every
            rank must get the same number of examples at every step).
        duplicates: ``"defer"``, ``"allow"`` or ``"drop"`` (above).

    Raises:
        ValueError: ``global_batch_size`` below 1 or not divisible by ``world_size``, a rank
            outside ``[0, world_size)``, an unknown ``duplicates``.

    """

    def __init__(
        self,
        texts: Sequence[Sequence[str]],
        global_batch_size: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = True,
        duplicates: str = "defer",
    ):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by world_size {world_size}"
            )
        if duplicates not in DUPLICATES:
            raise ValueError(f"duplicates must be one of {DUPLICATES}, got {duplicates!r}")
        self.texts = [tuple(t) for t in texts]
        self._text_sets = [frozenset(t) for t in self.texts]
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.drop_last = drop_last
        self.duplicates = duplicates
        self.epoch = 0
        self._plan: Optional[Tuple[int, List[List[int]], int]] = None  # (epoch, batches, unused)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch_plan(self) -> Tuple[List[List[int]], int]:
        if self._plan is None or self._plan[0] != self.epoch:
            batches, unused = self._make_batches()
            self._plan = (self.epoch, batches, unused)
        return self._plan[1], self._plan[2]

    def _make_batches(self) -> Tuple[List[List[int]], int]:
        order = list(range(len(self.texts)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        size = self.global_batch_size
        if self.duplicates == "allow":
            batches = [order[s : s + size] for s in range(0, len(order), size)]
        else:
            batches = []
            remaining = deque(order)  # deferred examples first (in the order met), then unseen ones
            while remaining:
                # Fill greedily; an example sharing a text with the batch is deferred.
                batch: List[int] = []
                seen: set = set()
                skipped: List[int] = []
                while remaining and len(batch) < size:
                    i = remaining.popleft()
                    if self._text_sets[i] & seen:
                        skipped.append(i)
                    else:
                        batch.append(i)
                        seen |= self._text_sets[i]
                remaining.extendleft(reversed(skipped))
                if len(batch) < size and self.duplicates == "defer":
                    # no full batch without a repeat is left: top up with deferred examples
                    while remaining and len(batch) < size:
                        batch.append(remaining.popleft())
                if len(batch) < size and self.duplicates == "drop" and self.drop_last:
                    return batches, len(batch) + len(remaining)
                batches.append(batch)
        unused = 0
        if batches and len(batches[-1]) < size and self.drop_last:
            unused = len(batches.pop())
        return batches, unused

    def global_batches(self) -> List[List[int]]:
        """The global batches of the current epoch (the same on every rank)."""
        return [list(b) for b in self._epoch_plan()[0]]

    @property
    def unused(self) -> int:
        """Examples in no batch of the current epoch (the same number on every rank)."""
        return self._epoch_plan()[1]

    @property
    def duplicate_batches(self) -> int:
        """Global batches of the current epoch in which a text occurs in two examples."""
        return sum(1 for batch in self._epoch_plan()[0] if self._has_repeat(batch))

    def _has_repeat(self, batch: Sequence[int]) -> bool:
        seen: set = set()
        for i in batch:
            if self._text_sets[i] & seen:
                return True
            seen |= self._text_sets[i]
        return False

    def __iter__(self) -> Iterator[List[int]]:
        for batch in self._epoch_plan()[0]:
            share = -(-len(batch) // self.world_size)
            yield batch[self.rank * share : (self.rank + 1) * share]

    def __len__(self) -> int:
        return len(self._epoch_plan()[0])


def _convert(args) -> None:
    tally = MalformedTally()
    examples = iter_retrieval_jsonl(args.inputs, tally=tally)
    if args.shards:
        manifest = write_retrieval_shards(
            examples, args.shards, prefix=args.prefix, samples_per_shard=args.samples_per_shard
        )
        print(f"wrote {manifest['num_samples']} examples in {manifest['num_shards']} shards to {args.shards}")
    else:
        n = write_retrieval_jsonl(examples, args.out)
        print(f"wrote {n} examples to {args.out}")
    if tally.total:
        print(f"skipped {tally.total} malformed records: {tally.counts}; first at {tally.where[:5]}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ds_infcl.data.retrieval",
        description="Convert FlagEmbedding/Tevatron jsonl to FlagEmbedding jsonl or webdataset shards.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    conv = sub.add_parser("convert", help="jsonl (FlagEmbedding or Tevatron shape) -> jsonl or shards")
    conv.add_argument("inputs", nargs="+", help="input jsonl files")
    dest = conv.add_mutually_exclusive_group(required=True)
    dest.add_argument("--out", help="output jsonl (FlagEmbedding shape with idx)")
    dest.add_argument("--shards", help="output directory of webdataset shards")
    conv.add_argument("--prefix", default="retrieval", help="shard name prefix")
    conv.add_argument("--samples-per-shard", type=int, default=10000)
    args = parser.parse_args(argv)
    _convert(args)


if __name__ == "__main__":
    main()
