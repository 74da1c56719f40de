# Over 500 lines on purpose: writing, finding, verifying and loading a checkpoint are one protocol (the record written by save is what resolve and load check); split, each half would be read against the other.
"""Checkpoints: DeepSpeed's engine checkpoint plus what a resumed run needs to continue as if it
had never stopped, written so that none is ever lost or half-read.

Layout under the checkpoint directory (one tag per saved step)::

    latest                         # a hint: the tag written last (DeepSpeed's format, written by us)
    step00000100/
        mp_rank_00_model_states.pt # DeepSpeed: module (towers + loss module with logit_scale),
        *optim_states.pt           #   optimizer and scheduler state (ZeRO shards per rank),
                                   #   and our client_state under "ds_infcl"
        rng_rank00000.pt           # ours: this rank's Python, NumPy, torch CPU and CUDA RNG states
        ds_infcl_checkpoint.json   # ours, written last: the completion record

**Complete or invisible.** Every rank writes its files, all ranks meet at a barrier, the ranks
hash the tag's files (SHA-256, shared out among the ranks), rank 0 writes the completion record
(step, world size, ZeRO stage, batch, lr schedule, parameter shapes, and every file's size and
SHA-256), fsyncs the directory, points ``latest`` at the tag by an atomic rename and fsyncs the
directory again. A tag without its record was cut short and is never resumed.

**Which checkpoint a resume takes** (``resolve_resume``). ``auto`` (or a checkpoint directory):
the newest complete tag, found from the records, whatever ``latest`` says (``latest`` only adds a
note where it disagrees). Newest is the record's ``seq`` (the write order in this directory: one
more than the highest ``seq`` there when the tag was written), then the step; within one run that
is the step order. Each candidate is verified against its record (every file there, of the
recorded size and SHA-256); a damaged one is named with the file and what is wrong, and the
previous complete tag is taken with a warning. With none left the resume is a ``ConfigError`` (one
line, exit 2). Directories written before records existed (no tag has one) follow ``latest``.

**Nothing lost.** A run is a ``run_id`` (in every record). A resume from the newest complete tag
continues that tag's run (same ``run_id``); any other start is a new run. A run writes and deletes
only its own tags: a tag name whose complete checkpoint belongs to another run gets a suffix
(``step00000008-2``) instead of being rewritten, and ``keep_last`` removes only this run's older
tags, by step, never the one just written. ``checkpoint.overwrite`` (``--fresh``) lets a new run
start in a directory that holds complete checkpoints (``check_fresh_start`` refuses it otherwise)
and rewrite tags of the same name.

**No pickle from the folder.** ``load_checkpoint`` loads DeepSpeed's model and optimizer files with
``torch.load(weights_only=True)``, allowing the few plain DeepSpeed classes they hold
(``DEEPSPEED_SAFE_GLOBALS``); the RNG files are tensors and plain values. A file that needs any
other class is refused, named.

``client_state["ds_infcl"]`` holds ``step`` (optimizer steps done: the data position of an
index-addressed task), ``samples`` (global samples consumed), the task's ``state_dict`` (data
position of a streaming task), ``world_size`` and the run config. RNG states are per rank because
each rank draws its own dropout masks; DeepSpeed writes ``client_state`` from rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

from ds_infcl import settings

__all__ = [
    "tag_for_step", "save_checkpoint", "load_checkpoint", "resolve_resume", "rng_state", "set_rng",
    "read_record", "check_world_size", "check_fresh_start", "complete_tags", "verify_tag", "prune",
    "publish_record", "run_id_after", "load_weights_only", "file_sha256", "RECORD", "DEEPSPEED_SAFE_GLOBALS",
]

_CLIENT_KEY = "ds_infcl"
RECORD = "ds_infcl_checkpoint.json"
# Fault injection for the tests (tests/train/test_faults.py): the step whose checkpoint write is
# cut short by killing rank 0 after the DeepSpeed files and before the completion record.
_KILL_IN_CHECKPOINT = "DS_INFCL_TEST_KILL_IN_CHECKPOINT"
_TAG = re.compile(r"^step(\d+)(?:-(\d+))?$")


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def rng_state(device: torch.device) -> Dict[str, Any]:
    """This process's RNG states as tensors and plain values (``torch.load(weights_only=True)``)."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng(state: Dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in internal.tolist()), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    """Write ``path`` by a rename of a fsynced temporary file, then fsync its directory."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes (hex), read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Damaged(Exception):
    """A tag whose record is unreadable or whose files differ from it (the message says how)."""


def _parse_tag(name: str) -> Optional[Tuple[int, int]]:
    m = _TAG.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _tag_dirs(ckpt_dir: str) -> List[str]:
    if not os.path.isdir(ckpt_dir):
        return []
    return [t for t in os.listdir(ckpt_dir) if _parse_tag(t) and os.path.isdir(os.path.join(ckpt_dir, t))]


def read_record(ckpt_dir: str, tag: str) -> Optional[Dict[str, Any]]:
    """The completion record of ``ckpt_dir/tag`` (``None``: the tag was never completed).

    Raises:
        ConfigError: the record is there but unreadable (truncated or garbled), naming it.
    """
    from ds_infcl.errors import ConfigError

    try:
        return _read_record(ckpt_dir, tag)
    except _Damaged as e:
        raise ConfigError(f"checkpoint {ckpt_dir}/{tag} is damaged: {e}") from None


def _read_record(ckpt_dir: str, tag: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(ckpt_dir, tag, RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise _Damaged(f"{RECORD}: not valid JSON, truncated or garbled ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise _Damaged(f"{RECORD}: not a completion record (no integer 'step')")
    return record


def verify_tag(ckpt_dir: str, tag: str) -> Optional[Dict[str, Any]]:
    """The record of ``ckpt_dir/tag`` after checking every file it lists: there, of the recorded
    size and SHA-256. ``None``: no record (incomplete, or written before records existed).
    Records written before files were recorded are returned unchecked.

    Raises:
        _Damaged: the record or a file is damaged; the message names the file and what is wrong.
    """
    record = _read_record(ckpt_dir, tag)
    if record is None:
        return None
    files = record.get("files")
    if files is None:
        return record
    for name in sorted(files):
        path = os.path.join(ckpt_dir, tag, name)
        want = files[name]
        if not os.path.isfile(path):
            raise _Damaged(f"{name}: missing")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise _Damaged(f"{name}: {size} bytes, the record says {want['size']} (truncated or replaced)")
        if file_sha256(path) != want["sha256"]:
            raise _Damaged(f"{name}: its SHA-256 differs from the record's (the bytes are garbled)")
    return record


def complete_tags(ckpt_dir: str) -> List[Tuple[str, Optional[Dict[str, Any]]]]:
    """Tags of ``ckpt_dir`` that have a completion record, newest first (record ``seq``, then
    step), each with its record; ``None`` for a record that cannot be read (a damaged tag, put
    first)."""
    found = []
    for tag in _tag_dirs(ckpt_dir):
        if not os.path.isfile(os.path.join(ckpt_dir, tag, RECORD)):
            continue
        try:
            record = _read_record(ckpt_dir, tag)
        except _Damaged:
            record = None
        found.append((tag, record))

    def key(item):  # an unreadable record first: it may be the newest, and is reported before any is taken
        tag, record = item
        step, suffix = _parse_tag(tag)
        if record is None:
            return (1 << 62, step, suffix)
        return (int(record.get("seq", 0)), int(record.get("step", step)), suffix)

    return sorted(found, key=key, reverse=True)


def _read_latest(ckpt_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """``(tag, problem)``: the tag ``latest`` names, or why it names none (garbled, no such tag)."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        return None, None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{path} is garbled (not text)"
    if not _parse_tag(tag):
        return None, f"{path} is garbled ({raw[:40]!r} is not a tag name)"
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        return None, f"{path} names {tag}, which is not there"
    return tag, None


def _note(msg: str) -> None:
    print(f"[ds_infcl] resume: {msg}", flush=True)


def _newest_intact(ckpt_dir: str, below: Optional[Tuple[int, int]] = None):
    """``(tag, problems)``: the newest complete tag of ``ckpt_dir`` that verifies (``below``: only
    tags older than this ``(seq, step)``), and ``[(tag, problem)]`` for the damaged ones passed."""
    problems = []
    for tag, record in complete_tags(ckpt_dir):
        if below is not None and record is not None and (int(record.get("seq", 0)), record["step"]) >= below:
            continue
        try:
            verify_tag(ckpt_dir, tag)
        except _Damaged as e:
            problems.append((tag, str(e)))
            continue
        return tag, problems
    return None, problems


def _resolve_dir(resume: str, ckpt_dir: str, verify: bool):
    from ds_infcl.errors import ConfigError

    latest, latest_problem = _read_latest(ckpt_dir)
    tags = complete_tags(ckpt_dir)
    if not tags:  # nothing complete: a directory of an older version follows its latest
        if latest is not None and not any(os.path.isfile(os.path.join(ckpt_dir, t, RECORD)) for t in _tag_dirs(ckpt_dir)):
            if not any(f.endswith("model_states.pt") for f in os.listdir(os.path.join(ckpt_dir, latest))):
                return None  # a first write cut short (no record, no model states): nothing to resume
            return ckpt_dir, latest
        if latest_problem:
            _note(f"{latest_problem}; no complete checkpoint in {ckpt_dir}")
        return None
    if not verify:
        return ckpt_dir, tags[0][0]
    tag, problems = _newest_intact(ckpt_dir)
    for bad, problem in problems:
        _note(f"checkpoint {ckpt_dir}/{bad} is damaged: {problem}" + (f"; using the newest intact checkpoint {tag}" if tag else ""))
    if tag is None:
        raise ConfigError(
            f"--resume {resume}: no intact checkpoint in {ckpt_dir}: "
            + "; ".join(f"{bad} is damaged ({problem})" for bad, problem in problems)
            + ". Restore the files from a copy, or start a new run with --fresh (checkpoint.overwrite=true)"
        )
    if latest_problem:
        _note(f"{latest_problem}; the newest complete checkpoint is {tag}")
    elif latest is not None and latest != tag:
        _note(f"{ckpt_dir}/latest names {latest}; the newest complete checkpoint is {tag}")
    return ckpt_dir, tag


def resolve_resume(resume: str, default_dir: str, verify: bool = True) -> Optional[Tuple[str, str]]:
    """``--resume`` value -> ``(checkpoint_dir, tag)`` or ``None`` (nothing to resume).

    ``auto``: the newest intact complete tag in ``default_dir`` (``None`` if it holds none, or does
    not exist). A checkpoint directory (one holding tags): the same there. A tag directory
    (``.../step00000100``): that tag, which must be complete and intact. ``verify``: check the
    files' sizes and SHA-256 against the records (``False``: only find the tag).

    Raises:
        ConfigError: a path that holds no checkpoint; an explicit tag that is incomplete or
            damaged (naming the file and the previous intact tag); no intact tag left.
    """
    from ds_infcl.errors import ConfigError

    if resume == "auto":
        return _resolve_dir(resume, default_dir, verify)
    path = os.path.normpath(resume)
    if os.path.isdir(path) and (_tag_dirs(path) or os.path.isfile(os.path.join(path, "latest"))):
        found = _resolve_dir(resume, path, verify)
        if found is not None:
            return found
    parent, tag = os.path.dirname(path), os.path.basename(path)
    is_tag = os.path.isdir(path) and (os.path.isfile(os.path.join(path, RECORD))
                                      or any(f.endswith("model_states.pt") for f in os.listdir(path)))
    if not is_tag:
        raise ConfigError(
            f"--resume {resume}: no checkpoint there (expected a checkpoint directory, a tag directory such as "
            ".../step00000100, or 'auto')"
        )
    has_records = any(os.path.isfile(os.path.join(parent, t, RECORD)) for t in _tag_dirs(parent))
    try:
        record = verify_tag(parent, tag) if verify else _read_record(parent, tag)
    except _Damaged as e:
        record, damage = None, str(e)
    else:
        damage = None
        if record is not None or not has_records:  # complete, or of a version before records
            return parent, tag
    previous, _ = _newest_intact(parent, below=_order_of(parent, tag)) if verify else (None, [])
    where = (f"resume from {parent}/{previous} (--resume {os.path.join(parent, previous)})" if previous
             else "no intact checkpoint is before it")
    if damage is not None:
        raise ConfigError(f"--resume {resume}: the checkpoint is damaged: {damage}; {where}, or with --resume auto")
    raise ConfigError(
        f"--resume {resume}: the checkpoint {parent}/{tag} was not completed (its write was cut short: "
        f"no {RECORD}); {where}, or with --resume auto"
    )


def _order_of(ckpt_dir: str, tag: str) -> Tuple[int, int]:
    try:
        record = _read_record(ckpt_dir, tag) or {}
    except _Damaged:
        record = {}
    return int(record.get("seq", 1 << 62)), int(record.get("step", _parse_tag(tag)[0]))


def check_fresh_start(ckpt_dir: str, overwrite: bool) -> None:
    """A run that starts fresh (no ``--resume``, or nothing to resume) into ``ckpt_dir``: refused
    while the directory holds a complete checkpoint, unless ``checkpoint.overwrite`` is set.

    Raises:
        ConfigError: naming the newest complete tag, ``--resume`` and ``--fresh``.
    """
    from ds_infcl.errors import ConfigError

    if overwrite:
        return
    tags = complete_tags(ckpt_dir)
    if tags:
        raise ConfigError(
            f"checkpoint.dir {ckpt_dir} holds complete checkpoints (newest: {tags[0][0]}) and this run would start "
            "fresh there; pass --resume to continue from the newest, or --fresh (checkpoint.overwrite=true) "
            "to start a new run beside them, or set checkpoint.dir to another folder"
        )


def run_id_after(found: Optional[Tuple[str, str]]) -> str:
    """The ``run_id`` of a run that resumed from ``found`` (``None``: a fresh start): the tag's
    own where it is the newest complete tag of its directory (the run continues), else a new one
    (a new run: it may not delete or rewrite the other run's checkpoints)."""
    if found is not None:
        tags = complete_tags(found[0])
        if tags and tags[0][0] == found[1] and tags[0][1] is not None and tags[0][1].get("run_id"):
            return str(tags[0][1]["run_id"])
    return uuid.uuid4().hex


def _tag_to_write(ckpt_dir: str, step: int, run_id: str, overwrite: bool) -> str:
    """The tag name for ``step``: ``stepNNNNNNNN``, or with a suffix where that name holds a
    complete checkpoint of another run (never rewritten unless ``overwrite``). Removes the record
    of a tag of this run that is rewritten (incomplete until written again)."""
    base = tag_for_step(step)
    for n in range(0, 1000):
        tag = base if n == 0 else f"{base}-{n + 1}"
        path = os.path.join(ckpt_dir, tag, RECORD)
        if not os.path.isfile(path):
            return tag
        try:
            record = _read_record(ckpt_dir, tag) or {}
        except _Damaged:
            record = {}
        if overwrite or record.get("run_id") == run_id:
            os.remove(path)
            _fsync_dir(os.path.dirname(path))
            return tag
    raise RuntimeError(f"{ckpt_dir}: 1000 complete checkpoints of other runs at step {step}")


def publish_record(ckpt_dir: str, tag: str, record: Dict[str, Any]) -> None:
    """Rank 0, after every rank's files are written: the completion record (with ``seq``, one
    more than the directory's highest), then ``latest``; each rename followed by a directory fsync."""
    seqs = [int(r.get("seq", 0)) for t, r in complete_tags(ckpt_dir) if r is not None and t != tag]
    record = {**record, "seq": max(seqs, default=0) + 1}
    _write_atomic(os.path.join(ckpt_dir, tag, RECORD), json.dumps(record, indent=1))
    _write_atomic(os.path.join(ckpt_dir, "latest"), tag)


def prune(ckpt_dir: str, keep_last: int, run_id: str, keep: str) -> List[str]:
    """``keep_last``: delete the complete tags of run ``run_id`` but the ``keep_last`` highest
    steps, never ``keep`` (the tag just written) nor another run's. Returns the deleted tags."""
    if not keep_last:
        return []
    mine = [(r["step"], t) for t, r in complete_tags(ckpt_dir) if r is not None and r.get("run_id") == run_id]
    mine.sort(key=lambda st: (st[0], _parse_tag(st[1])[1]))
    removed = []
    for _, tag in mine[:-keep_last]:
        if tag != keep:
            # The record first: an interrupted removal leaves an incomplete tag, never a damaged one.
            os.remove(os.path.join(ckpt_dir, tag, RECORD))
            shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)
            removed.append(tag)
    if removed:
        _fsync_dir(ckpt_dir)
    return removed


def _broadcast(obj):
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _file_digests(folder: str, rank: int, world: int) -> Dict[str, Dict[str, Any]]:
    """Size and SHA-256 of every file in ``folder``: rank 0 lists them, each rank fsyncs and hashes
    its share, every rank gets them all (a collective)."""
    import torch.distributed as tdist

    names = sorted(f for f in os.listdir(folder) if f != RECORD and ".tmp" not in f) if rank == 0 else None
    names = _broadcast(names)
    mine = {}
    for n in names[rank::world]:
        path = os.path.join(folder, n)
        fd = os.open(path, os.O_RDONLY)  # DeepSpeed does not fsync its files: durable before the record
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        mine[n] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    if rank == 0:
        _fsync_dir(folder)
    if world == 1 or not tdist.is_initialized():
        return mine
    parts = [None] * world
    tdist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def save_checkpoint(
    engine, ckpt_dir: str, step: int, run_state: Dict[str, Any], device: torch.device, keep_last: int = 0,
    *, run_id: Optional[str] = None, overwrite: bool = False,
) -> str:
    """Save the engine and ``run_state`` as tag ``step<step>`` (see the module docstring); all
    ranks call it. ``run_id``: this run's (``run_id_after``; ``None``: a new one). Returns the tag."""
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    run_id = _broadcast(run_id or (uuid.uuid4().hex if rank == 0 else None))
    tag = _broadcast(_tag_to_write(ckpt_dir, step, run_id, overwrite) if rank == 0 else None)
    dist.barrier()
    # DeepSpeed's own "latest" would point at the tag as soon as rank 0's files are written.
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={_CLIENT_KEY: run_state}, save_latest=False)
    path = os.path.join(ckpt_dir, tag, f"rng_rank{rank:05d}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        torch.save(rng_state(device), f)
        f.flush()
        os.fsync(f.fileno())
    if rank == 0 and settings.get(_KILL_IN_CHECKPOINT) == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # every rank's files are complete
    files = _file_digests(os.path.join(ckpt_dir, tag), rank, world)
    if rank == 0:
        record = {
            "tag": tag, "step": step, "samples": run_state.get("samples"), "world_size": world,
            "zero_stage": int(engine.zero_optimization_stage()), "global_batch_size": run_state.get("global_batch_size"),
            "run_id": run_id, "written_at": time.time(),
        }
        if "scheduler" in run_state:  # a resume checks its schedule before anything is loaded (train/preflight.py)
            record["scheduler"] = run_state["scheduler"]
        # and its parameters' shapes before the engine is built (ZeRO-3 keeps a partition's: ds_shape)
        record["param_shapes"] = {name: list(getattr(p, "ds_shape", p.shape))
                                  for name, p in engine.module.named_parameters()}
        record["files"] = files
        publish_record(ckpt_dir, tag, record)
        prune(ckpt_dir, keep_last, run_id, keep=tag)
    dist.barrier()
    return tag


def _deepspeed_safe_globals() -> list:
    """The plain DeepSpeed classes its model and optimizer files pickle (found by loading the
    files of ZeRO 0-3 runs in fp32, bf16 and fp16 with ``weights_only=True``)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


DEEPSPEED_SAFE_GLOBALS = ("LossScaler", "DynamicLossScaler", "ZeroStageEnum", "fragment_address")


def load_weights_only(path: str, map_location=None):
    """``torch.load(path, weights_only=True)`` with DeepSpeed's plain classes allowed.

    Raises:
        ConfigError: the file holds anything else (a pickle that could run code), naming it.
    """
    import pickle

    from ds_infcl.errors import ConfigError

    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line for line in str(e).splitlines() if "Unsupported" in line or "GLOBAL" in line),
                   str(e).splitlines()[0] if str(e) else "")
        raise ConfigError(
            f"--resume: refused to load {path}: it is not plain tensors and values ({why.strip()}); loading it "
            "could run code. Resume only from checkpoints written by ds_infcl.train"
        ) from None


def load_checkpoint(engine, ckpt_dir: str, tag: str, device: torch.device) -> Dict[str, Any]:
    """Load engine, optimizer and scheduler state and this rank's RNG; return the run state.
    Every file loads with ``weights_only=True`` (``load_weights_only``)."""
    import deepspeed.comm as dist

    from ds_infcl.errors import ConfigError
    from ds_infcl.train.dist import is_comm_failure

    ce = getattr(engine, "checkpoint_engine", None)
    if ce is not None and type(ce).__name__ == "TorchCheckpointEngine":
        ce.load = load_weights_only  # DeepSpeed's own loads with weights_only=False
    rank = dist.get_rank()
    rng_path = os.path.join(ckpt_dir, tag, f"rng_rank{rank:05d}.pt")
    rng = None
    try:
        load_path, client_state = engine.load_checkpoint(ckpt_dir, tag=tag)
        if load_path is None:
            raise ConfigError(f"--resume: DeepSpeed found no checkpoint {tag!r} in {ckpt_dir}")
        run_state = (client_state or {}).get(_CLIENT_KEY)
        if run_state is None:
            raise ConfigError(f"--resume: checkpoint {ckpt_dir}/{tag} has no ds_infcl run state (not written by "
                              "ds_infcl.train)")
        if os.path.isfile(rng_path) and run_state.get("world_size") == dist.get_world_size():
            rng = load_weights_only(rng_path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- a file that does not load (no record to verify it): one line
        if is_comm_failure(e):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"--resume: the checkpoint {ckpt_dir}/{tag} does not load ({type(e).__name__}: {first}); "
                          "resume from an earlier tag") from None
    if rng is not None:
        set_rng(rng, device)
    elif rank == 0:
        print(
            f"[ds_infcl] resume: world size changed ({run_state.get('world_size')} -> "
            f"{dist.get_world_size()}) or RNG file missing; RNG states start fresh",
            flush=True,
        )
    return run_state


def check_world_size(ckpt_dir: str, tag: str, world_size: int, zero_stage: int, global_batch_size: int) -> None:
    """Refuse, before anything is loaded, a resume that cannot continue the saved run: another
    global batch, or another number of ranks where ZeRO (stage >= 1) shards the optimizer state
    per rank (DeepSpeed's plain loader needs the same partitioning).

    Raises:
        ConfigError: naming what differs and how to go on.
    """
    from ds_infcl.errors import ConfigError

    record = read_record(ckpt_dir, tag)
    if record is None:  # a checkpoint of an older version: nothing to compare
        return
    saved_gbs = record.get("global_batch_size")
    if saved_gbs is not None and saved_gbs != global_batch_size:
        raise ConfigError(
            f"--resume: the checkpoint {ckpt_dir}/{tag} was trained with a global batch of {saved_gbs}, this run "
            f"has {global_batch_size}; the data position and the schedule assume the saved one: set "
            f"batch.global_batch_size={saved_gbs}"
        )
    saved_world = record.get("world_size")
    if saved_world != world_size and max(zero_stage, int(record.get("zero_stage", 0))) >= 1:
        raise ConfigError(
            f"--resume: the checkpoint {ckpt_dir}/{tag} was written by {saved_world} ranks under ZeRO stage "
            f"{record.get('zero_stage')}, which shards the optimizer state per rank; this run has {world_size} "
            f"ranks. Resume on {saved_world} ranks (the global batch stays {saved_gbs}), or convert the "
            "checkpoint with DeepSpeed's universal checkpoint tools first (deepspeed.checkpoint.ds_to_universal)"
        )
