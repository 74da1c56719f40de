"""The import direction of DESIGN.md section 1 and the rooms of the package, enforced on the source
(no import-linter needed).

Every ``import`` / ``from ... import`` statement of a package, at any depth (lazy imports count),
is checked against the packages it must never reach:

    ops, ring -> loss -> adapters, data -> tasks -> train (the engine) -> demos, bench

with two refinements: the engine imports the task interface (``ds_infcl.tasks.base``) and no task
module, and DeepSpeed is imported by the engine only. Beneath them all, ``ds_infcl.settings`` (the
table of ``DS_INFCL_*`` environment settings) imports nothing of ds_infcl, and no other module
touches a ``DS_INFCL_*`` variable in ``os.environ`` (``stray_environment_reads``). There are no
compatibility re-export modules: every file is in a room and follows its rules.

No import circle between two files of ds_infcl either (``import_circles``). A module's imports are
every ``import``/``from ... import`` at any depth (module level, inside a function, under ``if``):
``import a.b.c`` and ``from a.b import c`` reach the module ``a.b.c`` when it is a file of the
tree, and the ``__init__`` of every package on the way (``a``, ``a.b``) that is not one of the
importer's own packages (those are always initialized before the importer runs). So a package's
``__init__`` that re-exports its own submodules is not in a circle with them, and neither is
``from ds_infcl.loss import peer_copy`` (a submodule) inside ``ds_infcl.loss.ring``; but a submodule
that takes a name from its own package's ``__init__`` (``from ds_infcl.loss import ContrastiveLoss``
inside ``ds_infcl.loss.y``) while that ``__init__`` imports it is a circle and is reported.

And one class per public name: two files defining a public class of the same name (as
``ds_infcl.loss.ClipLoss`` and the OpenCLIP drop-in's ``ClipLoss`` once did) is reported.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ds_infcl"

_TOP = ("ds_infcl.tasks", "ds_infcl.train", "ds_infcl.demos", "ds_infcl.bench")
FORBIDDEN = {
    "errors": ("ds_infcl", "torch", "deepspeed"),
    # The exit cleanups (ds_infcl.exits.at_exit): every layer may register one.
    "exits": ("ds_infcl", "torch", "deepspeed"),
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

# Import circles allowed for now, as unordered pairs of modules. Each entry must still be a circle
# (``test_known_circles_are_still_circles``), so an entry is removed as soon as its circle is broken.
# None: loss/ring.py <-> loss/ring_fused.py was the last (its shared steps now live in
# loss/ring_steps.py and loss/algorithm.py).
KNOWN_CIRCLES: set = set()
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


@pytest.mark.parametrize("package, source, name", [
    ("ops", "from ds_infcl.loss.functional import lse\n", "ds_infcl.loss.functional"),
    ("ring", "def f():\n    import ds_infcl.ops.tiled\n", "ds_infcl.ops.tiled"),
    ("loss", "from ds_infcl.adapters.clip import ClipModel\n", "ds_infcl.adapters.clip"),
    ("data", "from ds_infcl.tasks.clip import ClipTask\n", "ds_infcl.tasks.clip"),
    ("tasks", "import ds_infcl.train.loop\n", "ds_infcl.train.loop"),
    ("train", "def f():\n    from ds_infcl.bench.engine import main\n", "ds_infcl.bench.engine"),
    ("train", "from ds_infcl.demos import trainer\n", "ds_infcl.demos"),
])
def test_an_import_that_runs_back_up_is_caught(tmp_path, package, source, name):
    # One import against the direction ops, ring -> loss -> adapters, data -> tasks -> train ->
    # demos, bench in an otherwise clean fake tree; lazy ones count too.
    root = _fake_tree(tmp_path, {f"{package}/x.py": source})
    line = source.count("\n", 0, source.index("ds_infcl")) + 1
    assert violations(root, package) == [f"ds_infcl/{package}/x.py:{line} imports {name}"]


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path):
    """``{module: {module it imports}}`` over the files of the tree at ``root`` (the rule of the
    module docstring: lazy imports count; the ``__init__`` of the importer's own packages counts
    only where the import names it)."""
    files = {_module_name(root, path): path for path in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        own = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        reached = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # 'from a.b import c': the module a.b.c if that is a file, else the name c of a.b
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                named = [sub if sub in files else node.module for sub in subs]
            else:
                continue
            for name in named:
                parts = name.split(".")
                on_the_way = {".".join(parts[:i]) for i in range(1, len(parts))}
                reached |= {name} | (on_the_way - own)
        graph[module] = {name for name in reached if name in files and name != module}
    return graph


def import_circles(root: pathlib.Path, known=frozenset()):
    """Every import circle between files of the tree at ``root``, each as ``"a -> b -> ... -> a"``:
    for each group of modules that reach each other, the shortest circle through the group's first
    module in name order. Imports between the two modules of a pair in ``known`` are left out."""
    graph = import_graph(root)
    allowed = {(a, b) for pair in known for a, b in (pair, pair[::-1])}
    graph = {a: sorted(b for b in out if (a, b) not in allowed) for a, out in graph.items()}

    def shortest_paths_from(start):
        parent, frontier = {start: None}, [start]
        while frontier:
            frontier = [parent.setdefault(b, a) and b for a in frontier for b in graph[a] if b not in parent]
        return parent

    reached = {module: shortest_paths_from(module) for module in graph}
    circles, placed = [], set()
    for module in sorted(graph):
        back = [a for a in reached[module] if module in graph[a]]
        if module in placed or not back:
            continue
        placed |= {other for other in reached[module] if module in reached[other]}
        # the shortest path module -> ... -> a with an import a -> module closes the circle
        def path_to(a):
            path = []
            while a is not None:
                path.append(a)
                a = reached[module][a]
            return path[::-1]
        circles.append(" -> ".join(min((path_to(a) for a in back), key=len) + [module]))
    return circles


def test_no_import_circle_between_files():
    circles = import_circles(ROOT, KNOWN_CIRCLES)
    assert circles == [], ("import circles (imports must go one way: move what both sides need into the "
                           f"lower module or a small new one): {circles}")


def test_known_circles_are_still_circles():
    graph = import_graph(ROOT)
    stale = [(a, b) for a, b in sorted(KNOWN_CIRCLES) if not (b in graph.get(a, ()) and a in graph.get(b, ()))]
    assert stale == [], f"these are no longer import circles: remove them from KNOWN_CIRCLES: {stale}"


def test_the_circle_rule_catches_circles(tmp_path):
    root = _fake_tree(tmp_path, {
        "__init__.py": "",
        # a re-exporting __init__ is no circle with its submodules, which import each other one way
        "loss/__init__.py": "from ds_infcl.loss.module import M\nfrom ds_infcl.loss import helpers\n",
        "loss/module.py": "from ds_infcl.loss.helpers import h\nfrom ds_infcl.loss import helpers\nimport ds_infcl.ring.x\n",
        "loss/helpers.py": "import torch\n",
        "ring/__init__.py": "",
        "ring/x.py": "",
        # a lazy import back is a circle
        "adapters/__init__.py": "",
        "adapters/a.py": "from ds_infcl.adapters.b import f\n",
        "adapters/b.py": "def f():\n    from ds_infcl.adapters import a\n",
        # three files round, the last one through 'import x.y'
        "data/__init__.py": "",
        "data/p.py": "from ds_infcl.data.q import g\n",
        "data/q.py": "from ds_infcl.data import r\n",
        "data/r.py": "import ds_infcl.data.p\n",
        # a submodule importing its own package's __init__, which imports it
        "tasks/__init__.py": "from ds_infcl.tasks.t import T\n",
        "tasks/t.py": "from ds_infcl.tasks import registry_name\n",
        # through another package's __init__: importing ds_infcl.train.u runs ds_infcl.train's __init__
        "train/__init__.py": "from ds_infcl.bench.v import V\n",
        "train/u.py": "",
        "bench/__init__.py": "",
        "bench/v.py": "import ds_infcl.train.u\n",
    })
    assert import_circles(root) == [
        "ds_infcl.adapters.a -> ds_infcl.adapters.b -> ds_infcl.adapters.a",
        "ds_infcl.bench.v -> ds_infcl.train -> ds_infcl.bench.v",
        "ds_infcl.data.p -> ds_infcl.data.q -> ds_infcl.data.r -> ds_infcl.data.p",
        "ds_infcl.tasks -> ds_infcl.tasks.t -> ds_infcl.tasks",
    ]
    # an allowed pair is left out; the other circles stay
    assert import_circles(root, {("ds_infcl.adapters.a", "ds_infcl.adapters.b")}) == [
        "ds_infcl.bench.v -> ds_infcl.train -> ds_infcl.bench.v",
        "ds_infcl.data.p -> ds_infcl.data.q -> ds_infcl.data.r -> ds_infcl.data.p",
        "ds_infcl.tasks -> ds_infcl.tasks.t -> ds_infcl.tasks",
    ]


def public_classes_defined_twice(root: pathlib.Path):
    """``{name: [files]}`` for every public class name (no leading ``_``) that more than one file
    of the tree at ``root`` defines at module level."""
    where = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(path.relative_to(root.parent).as_posix())
    return {name: files for name, files in where.items() if len(files) > 1}


def test_one_class_per_public_name():
    # Two classes of one name (ds_infcl.loss.ClipLoss and the OpenCLIP drop-in's ClipLoss had
    # different signatures) leave users guessing which one an example means.
    assert public_classes_defined_twice(ROOT) == {}


def test_the_class_name_rule_catches_a_duplicate(tmp_path):
    root = _fake_tree(tmp_path, {
        "loss/module.py": "class ClipLoss:\n    pass\nclass _Helper:\n    pass\n",
        "adapters/open_clip_loss.py": "class ClipLoss:\n    pass\nclass _Helper:\n    pass\n",
    })
    assert public_classes_defined_twice(root) == {
        "ClipLoss": ["ds_infcl/adapters/open_clip_loss.py", "ds_infcl/loss/module.py"]}


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
