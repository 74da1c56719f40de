"""The import direction of DESIGN.md section 1 and the rooms of the package, enforced on the source
(no import-linter needed).

Every ``import`` / ``from ... import`` statement of a package, at any depth (lazy imports count),
is checked against the packages it must never reach:

    ops, ring -> loss -> adapters, data -> tasks -> train (the engine) -> demos, bench

with two refinements: the engine imports the task interface (``ds_infcl.tasks.base``) and no task
module, and DeepSpeed is imported by the engine only. There are no compatibility re-export modules:
every file is in a room and follows its rules.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ds_infcl"

_TOP = ("ds_infcl.tasks", "ds_infcl.train", "ds_infcl.demos", "ds_infcl.bench")
FORBIDDEN = {
    "errors": ("ds_infcl", "torch", "deepspeed"),
    "ops": ("torch.distributed", "deepspeed", "ds_infcl.ring", "ds_infcl.loss", "ds_infcl.adapters",
            "ds_infcl.data") + _TOP,
    "ring": ("ds_infcl.ops", "ds_infcl.loss", "ds_infcl.adapters", "ds_infcl.data",
             "transformers", "sentence_transformers", "deepspeed") + _TOP,
    "loss": ("ds_infcl.adapters", "ds_infcl.data", "deepspeed") + _TOP,
    "adapters": ("ds_infcl.data", "deepspeed", "ds_infcl.ops", "ds_infcl.ring") + _TOP,
    "data": ("ds_infcl.loss", "ds_infcl.ops", "ds_infcl.ring", "ds_infcl.adapters", "deepspeed") + _TOP,
    # Tasks join data and models: adapters, data, loss; never the engine, a demo or a benchmark.
    "tasks": ("deepspeed", "ds_infcl.train", "ds_infcl.demos", "ds_infcl.bench"),
    # The engine: the task interface only (ds_infcl.tasks.base, see ALLOWED), no demo, no benchmark.
    "train": ("ds_infcl.tasks", "ds_infcl.demos", "ds_infcl.bench"),
    # Nothing imports a demo; demos and benchmarks may import everything below them.
    "demos": ("deepspeed",),
    "bench": ("deepspeed", "ds_infcl.demos"),
}
ALLOWED = {"train": ("ds_infcl.tasks.base",)}

MAX_LINES = 500
OVERSIZE_REASON = "# Over 500 lines on purpose:"


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _package_files(root: pathlib.Path, package: str):
    single = root / f"{package}.py"
    return [single] if single.is_file() else sorted((root / package).rglob("*.py"))


def violations(root: pathlib.Path, package: str):
    """``file:line imports name`` for every import of ``package`` (under ``root``) that its rules
    forbid."""
    found = []
    for path in _package_files(root, package):
        for lineno, name in _imports(path):
            if any(_matches(name, ok) for ok in ALLOWED.get(package, ())):
                continue
            for bad in FORBIDDEN[package]:
                if _matches(name, bad):
                    found.append(f"{path.relative_to(root.parent)}:{lineno} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    assert (ROOT / package).is_dir() or (ROOT / f"{package}.py").is_file()
    assert violations(ROOT, package) == []


def test_every_module_is_in_a_room():
    rooms = set(FORBIDDEN)
    loose = [p.name for p in ROOT.glob("*.py") if p.stem not in rooms and p.name != "__init__.py"]
    unruled = [p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name not in rooms]
    assert loose == [] and unruled == []


def _fake_tree(tmp_path, files):
    root = tmp_path / "ds_infcl"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_rules_catch_what_they_forbid(tmp_path):
    # The checker itself: an engine module importing a task module (even lazily), a task importing
    # a demo, and DeepSpeed outside the engine are reported; the task interface is allowed.
    root = _fake_tree(tmp_path, {
        "train/loop.py": "from ds_infcl.tasks.base import Task\n\ndef f():\n    import ds_infcl.tasks.clip\n",
        "tasks/clip.py": "from ds_infcl.demos.trainer import main\nfrom ds_infcl.adapters.clip import ClipModel\n",
        "adapters/x.py": "import deepspeed\n",
    })
    assert violations(root, "train") == ["ds_infcl/train/loop.py:4 imports ds_infcl.tasks.clip"]
    assert violations(root, "tasks") == ["ds_infcl/tasks/clip.py:1 imports ds_infcl.demos.trainer"]
    assert violations(root, "adapters") == ["ds_infcl/adapters/x.py:1 imports deepspeed"]


def test_no_import_circle_in_the_loss_registry():
    # The registry is imported by the implementations; it must import none of them.
    imported = [name for _, name in _imports(ROOT / "loss" / "registry.py")]
    assert [name for name in imported if name.startswith("ds_infcl")] == []


def test_long_files_say_why():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES and not text.startswith(OVERSIZE_REASON):
            long.append(f"{path.relative_to(ROOT.parent)} ({len(text.splitlines())} lines)")
    assert long == [], f"split these where a job boundary exists, or start them with {OVERSIZE_REASON!r}"
