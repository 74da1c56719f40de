"""The clip task's data folders: the built-in digits by name, shard folders with manifests, their
checks at load (config errors naming the path) and the sample-index scan FastCLIP needs.

Split out of ``ds_infcl.tasks.clip`` (which re-exports these names) to keep that file readable.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional

from ds_infcl.data import read_manifest
from ds_infcl.data.digits import read_digits_info, write_digits_shards
from ds_infcl import settings
from ds_infcl.errors import ConfigError
from ds_infcl.tasks.base import checking

__all__ = ["BUILTIN_DATA", "builtin_digits_dir", "ensure_digits_shards", "resolve_data_dir", "scan_index_bound"]

BUILTIN_DATA = ("builtin:digits",)
_DATA_FOLDER_HELP = (
    "a data folder holds .tar shards, with train.json (and optionally heldout.json, zero_shot.json) "
    "manifests as python -m ds_infcl.data.write_shards writes them, or without (every .tar trains); give "
    "data_dir: \"builtin:digits\" for the built-in digits, or train_shards: a brace pattern"
)


def ensure_digits_shards(data_dir: str, seed: int = 0) -> Dict[str, Any]:
    """``read_digits_info(data_dir)``, writing the shards first if missing. Safe when several
    ranks call it at once: each writes to a private folder and the first rename wins."""
    if not os.path.exists(os.path.join(data_dir, "digits.json")):
        parent = os.path.dirname(os.path.abspath(data_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".digits-", dir=parent)
        try:
            write_digits_shards(tmp, seed=seed)
            try:
                os.rename(tmp, data_dir)
            except OSError:  # another rank (or an existing empty folder) got there first
                if not os.path.exists(os.path.join(data_dir, "digits.json")):
                    if os.path.isdir(data_dir) and not os.listdir(data_dir):
                        os.rmdir(data_dir)
                        os.rename(tmp, data_dir)
                    else:
                        raise
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return read_digits_info(data_dir)


def builtin_digits_dir() -> str:
    """Where ``builtin:digits`` lives: ``$DS_INFCL_DIGITS``, else ``data/digits`` (relative to the
    working directory, as the demo writes it)."""
    return settings.get("DS_INFCL_DIGITS") or os.path.join("data", "digits")


def _manifest_shards(manifest: Dict[str, Any], path: str) -> None:
    from ds_infcl.data import expand_shard_urls

    missing = [u for u in expand_shard_urls(manifest["urls"]) if not os.path.isfile(u)]
    if missing:
        raise ConfigError(
            f"task.args.data_dir: {path} names {len(missing)} shard(s) that do not exist, first "
            f"{missing[0]}; rewrite the manifest or restore the shards"
        )


def _read_manifest_checked(path: str) -> Dict[str, Any]:
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"task.args.data_dir: cannot read the manifest {path}: {e}") from None
    _manifest_shards(manifest, path)
    return manifest


def checked_shard_list(source, key: str):
    """``resolve_shards(source)`` (sizes counted unless under ``--check``), its errors as
    ``ConfigError`` naming ``task.args.<key>``."""
    from ds_infcl.data import resolve_shards

    try:
        return resolve_shards(source, count=not checking())
    except ValueError as e:
        raise ConfigError(f"task.args.{key}: {e}") from None


def _with_digits_bound(info: Dict[str, Any]) -> Dict[str, Any]:
    # The digits' global index is the row of load_digits(): both splits number one data set.
    info["index_bound"] = info["train"]["num_samples"] + info["heldout"]["num_samples"]
    return info


def scan_index_bound(urls) -> int:
    """One more than the largest global sample index in the shards (the json's ``idx``, else a
    numeric key), reading tar headers and json members only (no image is decoded); a damaged
    shard is read up to its damage, with a warning."""
    import logging

    from ds_infcl.data import expand_shard_urls
    from ds_infcl.data.shards import ShardReport, iter_shard_samples

    top = -1
    for url in expand_shard_urls(urls):
        report = ShardReport(url)
        for sample in iter_shard_samples(url, report, read={"json"}):
            idx = None
            if "json" in sample:
                try:
                    idx = int(json.loads(sample["json"]).get("idx"))
                except (ValueError, TypeError, AttributeError):
                    idx = None
            key = os.path.basename(str(sample.get("__key__", "")))
            if idx is None and key.isdigit():
                idx = int(key)
            if idx is not None:
                top = max(top, idx)
        if report.damage:
            logging.getLogger(__name__).warning("sample index scan: shard %s is damaged at byte %s (%s); "
                                                "read up to there", url, report.offset, report.damage)
    return top + 1


def resolve_data_dir(data_dir: str, seed: int = 0) -> Optional[Dict[str, Any]]:
    """The data of ``data_dir``: ``{"train": manifest, "heldout"?: manifest, "class_names"?,
    "zero_shot_templates"?}`` with absolute shard patterns in ``manifest["urls"]``.

    ``"builtin:digits"`` writes the digits on first use (``None`` under ``--check`` when they are
    not written yet: nothing is written then). Anything else must be an existing folder with a
    ``train.json`` manifest (or one the digits writer wrote) whose shards all exist.

    Raises:
        ConfigError: naming the path and what a data folder holds.
    """
    if data_dir.startswith("builtin:"):
        if data_dir not in BUILTIN_DATA:
            raise ConfigError(f"task.args.data_dir: unknown built-in data {data_dir!r}; built-in: {list(BUILTIN_DATA)}")
        folder = builtin_digits_dir()
        if not os.path.exists(os.path.join(folder, "digits.json")):
            if checking():
                print(f"[ds_infcl] --check: the built-in digits are not written yet; the run will write them "
                      f"to {folder}", flush=True)
                return None
        return _with_digits_bound(ensure_digits_shards(folder, seed=seed))
    if not os.path.exists(data_dir):
        raise ConfigError(f"task.args.data_dir: {data_dir} does not exist; {_DATA_FOLDER_HELP}")
    if not os.path.isdir(data_dir):
        raise ConfigError(f"task.args.data_dir: {data_dir} is not a folder; {_DATA_FOLDER_HELP}")
    if os.path.exists(os.path.join(data_dir, "digits.json")):
        info = read_digits_info(data_dir)
        for split in ("train", "heldout"):
            _manifest_shards(info[split], os.path.join(data_dir, "digits.json"))
        return _with_digits_bound(info)
    train = os.path.join(data_dir, "train.json")
    if not os.path.exists(train):
        if any(name.endswith(".tar") for name in os.listdir(data_dir)):
            return {"train": {"urls": data_dir}}  # a folder of shards: every .tar in it, no held-out split
        raise ConfigError(f"task.args.data_dir: {data_dir} holds no train.json manifest and no .tar shards; "
                          f"{_DATA_FOLDER_HELP}")
    info: Dict[str, Any] = {"train": _read_manifest_checked(train)}
    heldout = os.path.join(data_dir, "heldout.json")
    if os.path.exists(heldout):
        info["heldout"] = _read_manifest_checked(heldout)
    zero_shot = os.path.join(data_dir, "zero_shot.json")
    if os.path.exists(zero_shot):
        try:
            with open(zero_shot) as f:
                prompts = json.load(f)
            info["class_names"] = prompts["class_names"]
            info["zero_shot_templates"] = prompts["templates"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"task.args.data_dir: {zero_shot} needs class_names and templates: {e!r}") from None
    return info
