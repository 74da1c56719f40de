# Over 500 lines on purpose: the shard format in one place: the writer, its manifest, and the reader that counts
# a damaged shard's losses against the sizes the manifest (or sizes.json) records.
"""Writing image + caption webdataset shards, and their manifest.

A sample in a shard is the group of tar members sharing one key::

    000001234.png    the image bytes, as given (jpg, png or webp)
    000001234.txt    the caption, UTF-8
    000001234.json   {"idx": 1234, "caption": ..., plus any metadata such as "label"}

The key is the sample's *global index*, zero-padded to 9 digits, and ``idx`` repeats it in the
json: a stable index over the whole data set that survives shuffling, resampling and splitting.
FastCLIP-style losses keep per-sample state keyed by it.

Next to the shards, ``<prefix>.json`` records the brace pattern of the shard names, the number of
samples per shard and in total (``read_manifest`` turns it into absolute URLs).

Reading: ``resolve_shards(source)`` takes a shard source (a folder of ``.tar`` files, a brace
pattern, several joined by ``::``, or a list of those) and returns the shards with the number of
samples in each (from OpenCLIP's ``sizes.json``, else our manifest, else counted once from the tar
headers and cached in ``sizes.json``). ``iter_shard_samples(url, report)`` reads one shard and,
where it is damaged (truncated, garbage, a cut member), stops and records why and at which byte:
with the shard's known size, a reader can count exactly how many samples the damage cost.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "IMAGE_EXTENSIONS",
    "normalize_image_ext",
    "sample_key",
    "write_image_text_shards",
    "read_manifest",
    "brace_pattern",
    "SAMPLE_IMAGE_EXTS",
    "SHARD_SOURCE_HELP",
    "ShardList",
    "ShardReport",
    "count_shard_samples",
    "expand_shard_source",
    "iter_shard_samples",
    "known_shard_sizes",
    "resolve_shards",
]

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "png", "webp")
_EXT_ALIASES = {"jpeg": "jpg", "jpg": "jpg", "png": "png", "webp": "webp"}
KEY_DIGITS = 9


def normalize_image_ext(ext: str) -> str:
    """``'.JPEG' -> 'jpg'``; ``ValueError`` listing the supported extensions otherwise."""
    e = ext.lower().lstrip(".")
    if e not in _EXT_ALIASES:
        raise ValueError(f"unsupported image extension {ext!r}; supported: jpg, jpeg, png, webp")
    return _EXT_ALIASES[e]


def sample_key(idx: int) -> str:
    """The tar key of global index ``idx`` (``1234 -> '000001234'``)."""
    if idx < 0:
        raise ValueError(f"sample index must be >= 0, got {idx}")
    return f"{idx:0{KEY_DIGITS}d}"


def brace_pattern(prefix: str, num_shards: int) -> str:
    """Shard names as one brace pattern: ``train-{000000..000007}.tar`` (no braces for one)."""
    if num_shards == 1:
        return f"{prefix}-000000.tar"
    return f"{prefix}-{{000000..{num_shards - 1:06d}}}.tar"


def _add_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = mtime
    info.mode = 0o444
    tar.addfile(info, io.BytesIO(data))


def write_image_text_shards(
    records: Iterable[Dict[str, Any]],
    out_dir: str,
    *,
    prefix: str = "shard",
    samples_per_shard: int = 1000,
    mtime: Optional[float] = None,
) -> Dict[str, Any]:
    """Write ``records`` into tar shards ``<out_dir>/<prefix>-000000.tar, ...`` and a manifest.

    Args:
        records: dicts with ``idx`` (global index, unique, >= 0), ``image`` (encoded bytes),
            ``ext`` (``jpg``/``jpeg``/``png``/``webp``), ``caption`` (str); every other key goes
            into the sample's json (e.g. ``label``).
        out_dir: created if missing.
        prefix: shard file prefix (``train``, ``heldout``, ...).
        samples_per_shard: maximum samples in a shard.
        mtime: tar member time (default: now); fix it for byte-identical shards.

    Returns:
        The manifest (also written to ``<out_dir>/<prefix>.json``): ``pattern`` (brace pattern of
        the shard names, relative to ``out_dir``), ``num_samples``, ``shard_sizes``.

    Raises:
        ValueError: a record misses a field, repeats an index or has an unsupported extension.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    os.makedirs(out_dir, exist_ok=True)
    mtime = time.time() if mtime is None else mtime
    seen = set()
    shard_sizes: List[int] = []
    tar = None
    try:
        for record in records:
            missing = [k for k in ("idx", "image", "ext", "caption") if k not in record]
            if missing:
                raise ValueError(f"record is missing {missing}: keys {sorted(record)}")
            idx = int(record["idx"])
            if idx in seen:
                raise ValueError(f"duplicate sample index {idx}")
            seen.add(idx)
            if tar is None or shard_sizes[-1] >= samples_per_shard:
                if tar is not None:
                    tar.close()
                name = os.path.join(out_dir, f"{prefix}-{len(shard_sizes):06d}.tar")
                tar = tarfile.open(name, "w")
                shard_sizes.append(0)
            key = sample_key(idx)
            ext = normalize_image_ext(record["ext"])
            caption = str(record["caption"])
            meta = {k: v for k, v in record.items() if k not in ("image", "ext")}
            meta["idx"] = idx
            _add_member(tar, f"{key}.{ext}", bytes(record["image"]), mtime)
            _add_member(tar, f"{key}.txt", caption.encode("utf-8"), mtime)
            _add_member(tar, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"), mtime)
            shard_sizes[-1] += 1
    finally:
        if tar is not None:
            tar.close()
    if not shard_sizes:
        raise ValueError("no records to write")
    manifest = {
        "pattern": brace_pattern(prefix, len(shard_sizes)),
        "num_samples": sum(shard_sizes),
        "shard_sizes": shard_sizes,
    }
    with open(os.path.join(out_dir, f"{prefix}.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(path: str) -> Dict[str, Any]:
    """Load ``<prefix>.json``; adds ``urls``, the pattern made absolute (a brace pattern string)."""
    with open(path) as f:
        manifest = json.load(f)
    manifest["urls"] = os.path.join(os.path.dirname(os.path.abspath(path)), manifest["pattern"])
    return manifest


# -- reading shards: sources, sizes, damage -------------------------------------------------------
#
# A *shard source* is a folder (every ``*.tar`` in it, sorted by name), a brace pattern
# (``shards/{000000..000099}.tar``, as webdataset and OpenCLIP take them), several of those joined
# by ``::``, or a list of those. ``resolve_shards`` turns one into the shard list and the number
# of samples in each shard; ``iter_shard_samples`` reads one shard and says exactly where and why
# it stopped early, so that a reader can count what a damaged shard lost.

SAMPLE_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SIZES_FILE = "sizes.json"
SHARD_SOURCE_HELP = (
    "a shard source is a folder (every *.tar in it), a brace pattern such as "
    "'shards/{000000..000099}.tar', several of those joined by '::', or a list of those"
)
# webdataset's rule: the key runs up to the first dot of the member's base name, the rest
# (lower-cased) names the field; names like __key__ are metadata and skipped.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META_NAME = re.compile(r"__[^/]*__($|/)")
_SHARD_NAME = re.compile(r"^(.*)-\d+\.tar$")


def is_remote(url: str) -> bool:
    """``pipe:...`` or a URL with a scheme other than ``file://``: opened through webdataset,
    never listed or checked on the local disk."""
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file://"))


def _local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _why(exn: BaseException) -> str:
    text = " ".join(str(exn).split()) or type(exn).__name__
    return f"{type(exn).__name__}: {text}"[:300]


@dataclass
class ShardReport:
    """What reading one shard found.

    ``num_samples`` counts the samples that came out (groups of members sharing a key that hold
    a sample member, e.g. an image); ``damage`` says why the reading stopped before the shard's
    end-of-archive marker and ``offset`` where (byte offset in the uncompressed tar stream);
    both are ``None`` for a shard read to its proper end.
    """

    url: str
    num_samples: int = 0
    damage: Optional[str] = None
    offset: Optional[int] = None

    @property
    def damaged(self) -> bool:
        return self.damage is not None

    def where(self) -> str:
        """``'<url> at byte <offset>: <damage>'`` (or just the url when undamaged)."""
        if self.damage is None:
            return self.url
        return f"{self.url} at byte {self.offset}: {self.damage}"


class _Damage(Exception):
    def __init__(self, offset: int, reason: str, in_member: bool):
        super().__init__(reason)
        self.offset, self.reason, self.in_member = offset, reason, in_member


def _open_tar(url: str):
    """``(tarfile, extra file object to close or None)``: local files seekable (members whose
    data is not wanted are skipped by seeking), anything else as a stream."""
    if is_remote(url):
        from webdataset.gopen import gopen

        stream = gopen(url)
        try:
            return tarfile.open(fileobj=stream, mode="r|*"), stream
        except BaseException:
            stream.close()
            raise
    path = _local_path(url)
    try:
        return tarfile.open(path, mode="r:"), None
    except tarfile.ReadError as plain:
        try:
            return tarfile.open(path, mode="r:*"), None  # a compressed tar
        except tarfile.ReadError:
            raise plain from None


def _tar_members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members' headers; ``_Damage`` where a header cannot be read. Unlike ``TarFile.next``,
    which ends the archive quietly at a truncated or invalid header, only the end-of-archive
    marker (a zero block) ends it here."""
    info = tar.firstmember
    tar.firstmember = None
    tar.members = []
    while info is not None:
        yield info
        offset = tar.offset
        try:
            tar.fileobj.seek(offset)
            info = tarfile.TarInfo.fromtarfile(tar)
        except tarfile.EOFHeaderError:
            return
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):
            raise _Damage(offset, "the shard ends without its end-of-archive marker (truncated)", False) from None
        except Exception as exn:  # noqa: BLE001 -- any failure to parse a header is damage
            raise _Damage(offset, f"unreadable tar header ({_why(exn)})", False) from None


def iter_shard_samples(
    url: str,
    report: Optional[ShardReport] = None,
    *,
    sample_exts: Sequence[str] = SAMPLE_IMAGE_EXTS,
    read: Optional[Collection[str]] = None,
) -> Iterator[Dict[str, Any]]:
    """The samples of one shard, in order: dicts ``{"__key__", "__url__", ext: bytes, ...}``
    grouping consecutive members that share a key (webdataset's grouping).

    Damage never raises: reading stops where the shard is unreadable (it cannot be opened, a
    member's data or a header is cut short or invalid, the end-of-archive marker is missing) and
    ``report`` records why and at which byte offset. The sample whose member was cut is dropped;
    the samples before it are yielded.

    Args:
        url: a local path (or ``file://``), else anything webdataset's ``gopen`` opens.
        report: filled in as the shard is read (``num_samples`` counts the yielded samples that
            hold one of ``sample_exts``).
        sample_exts: the members that make a group a sample (an image by default).
        read: the extensions whose data is read (``None``: all); other members are present in
            the dict with the value ``None`` (their data is skipped, not checked).
    """
    report = report if report is not None else ShardReport(url)
    exts = set(sample_exts)
    current: Optional[Dict[str, Any]] = None

    def counted(sample: Dict[str, Any]) -> Dict[str, Any]:
        if not exts.isdisjoint(sample):
            report.num_samples += 1
        return sample

    try:
        tar, extra = _open_tar(url)
    except Exception as exn:  # noqa: BLE001 -- a shard that cannot be opened is a damaged shard
        report.damage, report.offset = f"cannot be opened as a tar file ({_why(exn)})", 0
        return
    try:
        for info in _tar_members(tar):
            if not info.isreg() or _META_NAME.match(info.name):
                continue
            match = _KEY_EXT.match(info.name)
            if match is None:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if current is not None and (key != current["__key__"] or ext in current):
                yield counted(current)
                current = None
            if current is None:
                current = {"__key__": key, "__url__": url}
            data = None
            if read is None or ext in read:
                try:
                    data = tar.extractfile(info).read()
                except Exception as exn:  # noqa: BLE001 -- a member that cannot be read is damage
                    raise _Damage(info.offset, f"member {info.name!r} is cut short ({_why(exn)})", True) from None
            current[ext] = data
    except _Damage as damage:
        report.damage, report.offset = damage.reason, damage.offset
        if damage.in_member:
            current = None
    finally:
        tar.close()
        if extra is not None:
            extra.close()
    if current is not None:
        yield counted(current)


def count_shard_samples(url: str, sample_exts: Sequence[str] = SAMPLE_IMAGE_EXTS) -> ShardReport:
    """Count the samples of one shard from its tar headers alone (no member data is read)."""
    report = ShardReport(url)
    for _ in iter_shard_samples(url, report, sample_exts=sample_exts, read=()):
        pass
    return report


def expand_shard_source(source: Any, *, check: bool = True) -> List[str]:
    """The shard list of a shard source (see ``resolve_shards``), in order.

    With ``check``, a local pattern that names a file that does not exist is an error; without
    it only folders are looked at on disk.

    Raises:
        ValueError: naming the path and saying what a shard source can be: an empty list or
            string, a folder without ``.tar`` files, a path or pattern naming missing files.
    """
    if isinstance(source, ShardList):
        return list(source.urls)
    if isinstance(source, (str, os.PathLike)):
        items = [os.fspath(source)]
    else:
        items = [os.fspath(s) for s in source]
    if not items:
        raise ValueError(f"the shard source is an empty list; {SHARD_SOURCE_HELP}")
    from webdataset.shardlists import expand_urls

    urls: List[str] = []
    for item in items:
        for part in item.split("::"):
            if not part.strip():
                raise ValueError(f"empty shard source in {item!r}; {SHARD_SOURCE_HELP}")
            path = _local_path(part)
            if not is_remote(part) and os.path.isdir(path):
                tars = sorted(name for name in os.listdir(path) if name.endswith(".tar"))
                if not tars:
                    raise ValueError(f"the folder {path} holds no .tar file; {SHARD_SOURCE_HELP}")
                urls.extend(os.path.join(path, name) for name in tars)
                continue
            expanded = expand_urls(part)
            if check and not is_remote(part):
                missing = [u for u in expanded if not os.path.isfile(_local_path(u))]
                if missing and len(expanded) == 1 and expanded[0] == part:
                    raise ValueError(f"the shard source {part!r} does not exist; {SHARD_SOURCE_HELP}")
                if missing:
                    raise ValueError(
                        f"the shard pattern {part!r} names {len(missing)} of {len(expanded)} files that do "
                        f"not exist, first {missing[0]!r}; {SHARD_SOURCE_HELP}"
                    )
            urls.extend(expanded)
    return urls


@dataclass
class ShardList:
    """Shards and their sample counts (what ``resolve_shards`` returns).

    ``sizes[i]`` is the number of samples in ``urls[i]`` (``None`` where unknown) and
    ``sizes_from[i]`` where it came from (a ``sizes.json`` or manifest path, ``"counted"``, or
    ``""``); ``num_samples`` is their sum, else the total the caller gave, else ``None``.
    Iterating gives the URLs, so a ``ShardList`` goes wherever a list of shards does.
    """

    urls: List[str]
    sizes: List[Optional[int]]
    sizes_from: List[str]
    num_samples: Optional[int]

    def __iter__(self) -> Iterator[str]:
        return iter(self.urls)

    def __len__(self) -> int:
        return len(self.urls)

    def size_of(self, url: str) -> Optional[int]:
        """The sample count of ``url`` (``None`` if unknown or not in the list)."""
        for u, n in zip(self.urls, self.sizes):
            if u == url:
                return n
        return None


def _json_file(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exn:
        logger.warning("ignoring %s, which cannot be read as json: %s", path, _why(exn))
        return None


def _read_sizes_file(folder: str) -> Dict[str, int]:
    """``{shard name: samples}`` of ``<folder>/sizes.json`` (OpenCLIP's file), ``{}`` if none."""
    path = os.path.join(folder, SIZES_FILE)
    sizes = _json_file(path)
    if sizes is None:
        return {}
    if not isinstance(sizes, dict) or not all(isinstance(v, int) and v >= 0 for v in sizes.values()):
        logger.warning("ignoring %s: expected {\"name.tar\": number of samples, ...}", path)
        return {}
    return {str(k): v for k, v in sizes.items()}


def _read_manifest_sizes(path: str) -> Dict[str, int]:
    """``{absolute shard path: samples}`` from one of our manifests (``shard_sizes`` of the
    image-text writers, ``samples_per_shard`` of the retrieval writer), ``{}`` if none."""
    manifest = _json_file(path)
    if not isinstance(manifest, dict):
        return {}
    pattern = manifest.get("pattern")
    sizes = manifest.get("shard_sizes", manifest.get("samples_per_shard"))
    if not isinstance(pattern, str) or not isinstance(sizes, list):
        return {}
    import braceexpand

    names = list(braceexpand.braceexpand(pattern)) if pattern else []
    if len(names) != len(sizes) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        logger.warning("ignoring the shard sizes of %s: %d names in its pattern, sizes %s", path, len(names), sizes)
        return {}
    folder = os.path.dirname(path)
    return {os.path.normpath(os.path.join(folder, name)): n for name, n in zip(names, sizes)}


def known_shard_sizes(urls: Sequence[str]) -> Tuple[List[Optional[int]], List[str]]:
    """``(sizes, sizes_from)`` of the shards without counting: from ``sizes.json`` in a shard's
    folder, else from our manifest ``<prefix>.json`` next to ``<prefix>-NNNNNN.tar``."""
    sizes_files: Dict[str, Dict[str, int]] = {}
    manifests: Dict[str, Dict[str, int]] = {}
    sizes: List[Optional[int]] = []
    origins: List[str] = []
    for url in urls:
        n, origin = None, ""
        if not is_remote(url):
            path = os.path.normpath(os.path.abspath(_local_path(url)))
            folder, name = os.path.split(path)
            if folder not in sizes_files:
                sizes_files[folder] = _read_sizes_file(folder)
            if name in sizes_files[folder]:
                n, origin = sizes_files[folder][name], os.path.join(folder, SIZES_FILE)
            else:
                match = _SHARD_NAME.match(name)
                if match is not None:
                    manifest = os.path.join(folder, match.group(1) + ".json")
                    if manifest not in manifests:
                        manifests[manifest] = _read_manifest_sizes(manifest)
                    if path in manifests[manifest]:
                        n, origin = manifests[manifest][path], manifest
        sizes.append(n)
        origins.append(origin)
    return sizes, origins


def _write_json_atomic(path: str, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".sizes-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def resolve_shards(
    source: Any,
    num_samples: Optional[int] = None,
    *,
    count: bool = True,
    sample_exts: Sequence[str] = SAMPLE_IMAGE_EXTS,
) -> ShardList:
    """The shards of a shard source and the number of samples in each.

    A shard source is a folder (every ``*.tar`` in it, sorted by name), a brace pattern
    (``shards/{000000..000099}.tar``), several of those joined by ``::``, or a list of those.
    Each shard's sample count comes from, in this order:

    1. ``sizes.json`` in the shard's folder (OpenCLIP's file: ``{"name.tar": n, ...}``);
    2. our manifest ``<prefix>.json`` next to ``<prefix>-NNNNNN.tar`` (the shard writers');
    3. with ``count``, the tar headers, read once: the samples (groups of members sharing a key)
       that hold one of ``sample_exts``. The counts are then cached in the folder's
       ``sizes.json`` (merged with what it held, plus the sizes known from manifests) when the
       folder is writable and no shard of it is damaged; otherwise they are kept in memory
       only, with a log line;
    4. else unknown (``None``); ``num_samples``, the total the caller gives, then stands for
       the total. Remote shards (``pipe:``, ``http://``, ...) are neither checked nor counted.

    Args:
        source: the shard source, or a ``ShardList`` (returned as it is).
        num_samples: the total number of samples, if the caller knows it; a total that differs
            from the known sizes is logged as a warning (the sizes win).
        count: count the shards that no file describes (step 3).
        sample_exts: the members that make a sample (images by default; ``("json",)`` for
            retrieval shards).

    Returns:
        A ``ShardList`` (``urls``, ``sizes``, ``sizes_from``, ``num_samples``).

    Raises:
        ValueError: an empty list, a missing folder or file, a folder without ``.tar`` files, a
            pattern naming files that do not exist (the first one named); the message names the
            path and says what a shard source can be.
    """
    if isinstance(source, ShardList):
        return source
    urls = expand_shard_source(source, check=True)
    if len(set(urls)) < len(urls):
        logger.warning("the shard source names %d shard(s) more than once: they are read that often",
                       len(urls) - len(set(urls)))
    sizes, origins = known_shard_sizes(urls)
    if count:
        _count_and_cache(urls, sizes, origins, sample_exts)
    known = [n for n in sizes if n is not None]
    total = sum(known) if len(known) == len(sizes) else None
    if num_samples is not None:
        if total is None:
            total = int(num_samples)
        elif total != num_samples:
            logger.warning("num_samples=%d was given, but the shards' sizes add up to %d; using the sizes",
                           num_samples, total)
    return ShardList(urls=urls, sizes=sizes, sizes_from=origins, num_samples=total)


def _count_and_cache(urls: List[str], sizes: List[Optional[int]], origins: List[str],
                     sample_exts: Sequence[str]) -> None:
    """Step 3 of ``resolve_shards``: fill in ``sizes`` of local shards by counting, folder by folder."""
    by_folder: Dict[str, List[int]] = {}
    for i, url in enumerate(urls):
        if sizes[i] is None and not is_remote(url):
            folder = os.path.dirname(os.path.normpath(os.path.abspath(_local_path(url))))
            by_folder.setdefault(folder, []).append(i)
    for folder, todo in by_folder.items():
        logger.info("counting the samples of %d shard(s) in %s from their tar headers (no %s or manifest gives "
                    "their sizes)", len(set(urls[i] for i in todo)), folder, SIZES_FILE)
        damaged = []
        counted: Dict[str, Optional[int]] = {}
        for i in todo:
            name = os.path.basename(_local_path(urls[i]))
            if name not in counted:
                report = count_shard_samples(urls[i], sample_exts)
                counted[name] = None if report.damaged else report.num_samples
                if report.damaged:
                    damaged.append(report)
                    logger.warning("shard %s is damaged: its number of samples is unknown (%d readable before the "
                                   "damage)", report.where(), report.num_samples)
            if counted[name] is not None:
                sizes[i], origins[i] = counted[name], "counted"
        path = os.path.join(folder, SIZES_FILE)
        if damaged:
            logger.warning("not writing %s: %d damaged shard(s) in the folder; counted sizes kept in memory",
                           path, len(damaged))
            continue
        merged = _read_sizes_file(folder)
        for url, n in zip(urls, sizes):
            if n is not None and not is_remote(url):
                shard_path = os.path.normpath(os.path.abspath(_local_path(url)))
                if os.path.dirname(shard_path) == folder:
                    merged[os.path.basename(shard_path)] = n
        try:
            _write_json_atomic(path, merged)
            logger.info("wrote the shard sizes to %s", path)
        except OSError as exn:
            logger.warning("cannot write %s (%s): the counted sizes are kept in memory and counted again next "
                           "time", path, _why(exn))
