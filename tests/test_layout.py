"""The import direction of DESIGN.md section 1 and the rooms of the package, enforced on the source
(no import-linter needed).

Every ``import`` / ``from ... import`` statement of a package, at any depth (lazy imports count),
is checked against the packages it must never reach:

    ops, ring -> loss -> adapters, data -> tasks -> train (the engine) -> demos, bench

with two refinements: the engine imports the task interface (``ds_infcl.tasks.base``) and no task
module, and DeepSpeed is imported by the engine only. Beneath them all, ``ds_infcl.settings`` (the
table of ``DS_INFCL_*`` environment settings) imports nothing of ds_infcl, and no other module
touches a ``DS_INFCL_*`` variable in ``os.environ`` (``stray_environment_reads``). Old import paths kept for users are thin
re-export modules listed in ``COMPAT_SHIMS``; they are checked to stay thin.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ds_infcl"

_TOP = ("ds_infcl.tasks", "ds_infcl.train", "ds_infcl.demos", "ds_infcl.bench")
FORBIDDEN = {
    "errors": ("ds_infcl", "torch", "deepspeed"),
    # The declared environment settings: every layer imports it, so it imports none of them.
    "settings": ("ds_infcl", "torch.distributed", "deepspeed"),
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

# Old module paths users may have (python -m ds_infcl.train.demo, from ds_infcl.train.task import
# Task, ...): re-export modules of at most SHIM_LINES lines, exempt from the room rules.
COMPAT_SHIMS = {
    "demo.py": "ds_infcl.demos.loss",
    "train/demo.py": "ds_infcl.demos.trainer",
    "train/retrieval_demo.py": "ds_infcl.demos.retrieval",
    "train/bench_gpu.py": "ds_infcl.bench.engine",
    "train/task.py": "ds_infcl.tasks",
}
SHIM_LINES = 10
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
    files = [single] if single.is_file() else sorted((root / package).rglob("*.py"))
    return [p for p in files if p.relative_to(root).as_posix() not in COMPAT_SHIMS]


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
    loose = [p.name for p in ROOT.glob("*.py") if p.stem not in rooms and p.name != "__init__.py"
             and p.name not in COMPAT_SHIMS]
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


def test_compat_shims_stay_thin():
    for rel, target in COMPAT_SHIMS.items():
        path = ROOT / rel
        lines = path.read_text().splitlines()
        assert len(lines) <= SHIM_LINES, f"{rel} is a compatibility shim: keep it a re-export"
        imported = {name for _, name in _imports(path)}
        assert imported and all(_matches(name, target) for name in imported), (rel, imported)


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


# --------------------------------------------------------------------------------------------
# DS_INFCL_* settings are read (and written) through ds_infcl/settings.py only
# --------------------------------------------------------------------------------------------

SETTINGS_MODULE = "settings.py"
PREFIX = "DS_INFCL_"
_ENV_METHODS = ("get", "pop", "setdefault")  # os.environ.<method>(key, ...)
_ENV_FUNCTIONS = ("getenv", "putenv", "unsetenv")  # os.<function>(key, ...)


def _is_environ(node) -> bool:
    """``os.environ`` (or a bare ``environ`` imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _constants(tree):
    """Module-level ``NAME = <expression>`` bindings (the key of a read may be such a name)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def _key_problem(key, constants, depth=0):
    """Why an environment key is not allowed outside settings.py, or ``None``: a ``DS_INFCL_*``
    string, a name built from that prefix (f-string, ``+``, ``%``, ``.format``), a module constant
    that is one of these, or any key not known to be a plain string (it may be built from the
    prefix elsewhere)."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return f"reads {key.value}" if key.value.startswith(PREFIX) else None
    if isinstance(key, ast.Name) and key.id in constants and depth < 5:
        return _key_problem(constants[key.id], constants, depth + 1)
    texts = [n.value for n in ast.walk(key) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if any(t.startswith(PREFIX) for t in texts):
        return f"reads a name built from {PREFIX}"
    return "reads a key built at run time (it may be a DS_INFCL_ name)"


def stray_environment_reads(root: pathlib.Path):
    """``file:line <why>`` for every ``DS_INFCL_*`` environment access outside settings.py:
    ``os.environ.get/pop/setdefault(key)``, ``os.environ[key]`` (read, write or delete),
    ``os.getenv(key)``, ``key in os.environ``, ``os.environ.update`` with such a key."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == SETTINGS_MODULE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        constants = _constants(tree)
        for node in ast.walk(tree):
            keys = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner, name = node.func.value, node.func.attr
                if _is_environ(owner) and name in _ENV_METHODS and node.args:
                    keys.append(node.args[0])
                elif _is_environ(owner) and name == "update":
                    keys += [ast.Constant(kw.arg) for kw in node.keywords if kw.arg]
                    keys += [k for a in node.args if isinstance(a, ast.Dict) for k in a.keys if k is not None]
                elif name in _ENV_FUNCTIONS and isinstance(owner, ast.Name) and owner.id == "os" and node.args:
                    keys.append(node.args[0])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ENV_FUNCTIONS:
                if node.args:
                    keys.append(node.args[0])
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                keys.append(node.slice)
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                if any(_is_environ(c) for c in node.comparators):
                    keys.append(node.left)
            for key in keys:
                why = _key_problem(key, constants)
                if why:
                    found.append(f"ds_infcl/{rel}:{node.lineno} {why}")
    return found


def test_settings_are_read_through_the_settings_module():
    assert (ROOT / SETTINGS_MODULE).is_file()
    assert stray_environment_reads(ROOT) == [], (
        "read DS_INFCL_* settings with ds_infcl.settings.get (declare new ones in its table), and set them "
        "with settings.override / settings.put")


def test_the_settings_rule_catches_every_form(tmp_path):
    # Each form of a DS_INFCL_ environment access outside settings.py is reported, a name built
    # from the prefix and a key only known at run time included; settings.py itself, other
    # variables, and the environment passed whole are not.
    root = _fake_tree(tmp_path, {
        "settings.py": "import os\nX = os.environ.get('DS_INFCL_A')\n",
        "ops/a.py": (
            "import os\n"
            "A = os.environ.get('DS_INFCL_A', '0')\n"          # 2
            "B = os.environ['DS_INFCL_B']\n"                   # 3
            "C = os.getenv('DS_INFCL_C')\n"                    # 4
            "def f(kind, name):\n"
            "    os.environ.get(f'DS_INFCL_TRITON_{kind}')\n"  # 6
            "    os.environ.get('DS_INFCL_' + kind.upper())\n"  # 7
            "    os.environ.get(name)\n"                       # 8
            "    return 'DS_INFCL_D' in os.environ\n"          # 9
        ),
        "loss/b.py": (
            "import os\n"
            "from os import environ, getenv\n"
            "_KEY = 'DS_INFCL_KILL'\n"
            "os.environ[_KEY] = '1'\n"                         # 4
            "del os.environ['DS_INFCL_E']\n"                   # 5
            "os.environ.pop('DS_INFCL_F', None)\n"             # 6
            "environ.setdefault('DS_INFCL_G', '1')\n"          # 7
            "getenv('DS_INFCL_H')\n"                           # 8
            "os.environ.update(DS_INFCL_I='1')\n"              # 9
            "os.environ.update({'DS_INFCL_J': '1'})\n"         # 10
            "ok = os.environ.get('RANK', '0'), os.environ['LOCAL_RANK'], dict(os.environ)\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1')\n"
        ),
    })
    found = stray_environment_reads(root)
    assert [f.split(" ")[0] for f in found] == [
        "ds_infcl/loss/b.py:4", "ds_infcl/loss/b.py:5", "ds_infcl/loss/b.py:6", "ds_infcl/loss/b.py:7",
        "ds_infcl/loss/b.py:8", "ds_infcl/loss/b.py:9", "ds_infcl/loss/b.py:10",
        "ds_infcl/ops/a.py:2", "ds_infcl/ops/a.py:3", "ds_infcl/ops/a.py:4", "ds_infcl/ops/a.py:6",
        "ds_infcl/ops/a.py:7", "ds_infcl/ops/a.py:8", "ds_infcl/ops/a.py:9",
    ], found
    assert "reads DS_INFCL_KILL" in found[0] and "built from DS_INFCL_" in found[10]
    assert "built at run time" in found[12]
