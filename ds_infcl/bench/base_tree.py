"""Another version of this package, imported beside the current one, for paired comparisons.

A change to the loss is judged by timing it against the code before it. On the GPU machines the
same code spreads by 0.1-0.3 ms between runs at 16k rows per GPU (docs/distributed.md), more than
most changes; two versions timed in one process, in rotating rounds, differ by what changed. This
module makes the older version importable next to the current one: it copies its ``ds_infcl/``
tree (from a git revision of this repository, or from a folder that holds it) into a temporary
folder as the package ``ds_infcl_base``, with every import of ``ds_infcl`` in it renamed, and
imports that. The two share nothing but torch, Triton and the process: each has its own kernels,
graph caches and settings (read from the same environment).

``python -m ds_infcl.bench.ring --paired N --base REV`` uses it (the row ``infcl@REV``).
"""

from __future__ import annotations

import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from types import ModuleType

from ds_infcl.exits import at_exit

__all__ = ["PACKAGE", "load_base", "rename_imports"]

PACKAGE = "ds_infcl_base"
_NAME = re.compile(r"\bds_infcl\b(?!_)")


def rename_imports(text: str) -> str:
    """``text`` (Python source of the package) with each reference to ``ds_infcl`` as a name
    (``import ds_infcl``, ``from ds_infcl.x import``, ``ds_infcl.x.y``) renamed to ``PACKAGE``;
    longer names (``ds_infcl_base``) and the upper-case settings (``DS_INFCL_*``) stay."""
    return _NAME.sub(PACKAGE, text)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _extract_revision(rev: str, dest: str) -> str:
    """``git archive REV ds_infcl`` of this repository, unpacked under ``dest``; returns the
    revision's short commit hash (what the tables name it by: ``HEAD~3`` moves)."""
    root = _repo_root()
    try:
        out = subprocess.run(["git", "-C", root, "archive", "--format=tar", rev, "ds_infcl"],
                             capture_output=True, timeout=120)
    except FileNotFoundError as err:
        raise ValueError(f"--base {rev!r}: git is not installed; pass a folder that holds a ds_infcl/ tree "
                         "instead") from err
    if out.returncode != 0:
        msg = out.stderr.decode(errors="replace").strip()
        raise ValueError(f"--base {rev!r} is neither a folder nor a revision of the git checkout at {root} "
                         f"(git archive: {msg}); pass a folder that holds a ds_infcl/ tree, or a revision "
                         "(a commit, tag or branch)")
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        tar.extractall(dest, filter="data")
    short = subprocess.run(["git", "-C", root, "rev-parse", "--short", f"{rev}^{{commit}}"], capture_output=True,
                           text=True, timeout=60)
    return short.stdout.strip() if short.returncode == 0 and short.stdout.strip() else rev


def load_base(spec: str) -> ModuleType:
    """Import the version ``spec`` of ``ds_infcl`` as ``PACKAGE`` and return it. ``spec`` is a
    folder holding a ``ds_infcl/`` tree (for instance a checkout of another commit, or what
    ``git archive REV ds_infcl | tar -x -C FOLDER`` wrote), or a git revision of this repository.
    Raises ``ValueError`` naming what is wrong when it is neither. Once per process: a second
    call with another ``spec`` is an error (the name is taken). The module's ``_base_label``
    names the version: the revision's short commit hash, or the folder's name."""
    loaded = sys.modules.get(PACKAGE)
    if loaded is not None:
        if getattr(loaded, "_base_spec", None) != spec:
            raise ValueError(f"{PACKAGE} is already imported from {getattr(loaded, '_base_spec', '?')!r}; "
                             f"one base version per process (asked for {spec!r})")
        return loaded
    tmp = tempfile.mkdtemp(prefix="ds_infcl_base_")
    at_exit(shutil.rmtree, tmp, True)  # at the process's end (read by lazy imports until then)
    if os.path.isdir(spec):
        src = os.path.join(spec, "ds_infcl")
        if not os.path.isfile(os.path.join(src, "__init__.py")):
            raise ValueError(f"--base {spec!r}: the folder holds no ds_infcl/ package (no {src}/__init__.py); "
                             "pass the folder above ds_infcl/, or a git revision")
        label = os.path.basename(os.path.normpath(spec))
    else:
        label = _extract_revision(spec, tmp)
        src = os.path.join(tmp, "ds_infcl")
    dest = os.path.join(tmp, PACKAGE)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for folder, _, files in os.walk(dest):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                with open(path, "w", encoding="utf-8") as f:
                    f.write(rename_imports(text))
    sys.path.insert(0, tmp)
    try:
        module = importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(tmp)
    module._base_spec, module._base_label = spec, label
    return module
