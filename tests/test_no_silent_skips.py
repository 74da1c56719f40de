"""A module of this package, or of a package pinned in requirements-ci.txt, that fails to import
fails its tests: no test skips over it (``pytest.importorskip``) or catches its ``ImportError``.

Skips for what a machine may legitimately lack stay, with their reason: no CUDA, or an optional
package that requirements-ci.txt does not pin (open_clip_torch, matplotlib, torchvision).
"""

import ast
import importlib.metadata
import pathlib
import re

TESTS = pathlib.Path(__file__).resolve().parent
REQUIREMENTS = TESTS.parent / "requirements-ci.txt"
# Handlers that would catch an ImportError.
CATCHES_IMPORT_ERROR = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def pinned_distributions(requirements: pathlib.Path = REQUIREMENTS) -> set:
    names = set()
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_normalize(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]))
    return names


def must_import(module: str, pinned: set, distributions=None) -> bool:
    """Whether ``module`` is part of this package or comes from a pinned distribution."""
    top = module.split(".")[0]
    if top == "ds_infcl":
        return True
    distributions = importlib.metadata.packages_distributions() if distributions is None else distributions
    return any(_normalize(dist) in pinned for dist in distributions.get(top, ()))


def _imported(nodes):
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                yield from (alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                yield sub.module


def _handler_names(handler: ast.ExceptHandler):
    if handler.type is None:
        return {"BaseException"}
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in types}


def silent_skips(root: pathlib.Path, pinned: set, distributions=None):
    """``file:line what`` for every ``importorskip`` of, and every ``try`` that catches the import
    error of, a module that ``must_import``, in the ``.py`` files under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and must_import(node.args[0].value, pinned, distributions)):
                found.append((where, node.lineno, f"importorskip({node.args[0].value!r})"))
            elif isinstance(node, ast.Try) and any(_handler_names(h) & CATCHES_IMPORT_ERROR for h in node.handlers):
                for module in _imported(node.body):
                    if must_import(module, pinned, distributions):
                        found.append((where, node.lineno, f"catches the import error of {module}"))
    return [f"{where}:{line} {what}" for where, line, what in sorted(found)]


def test_no_test_skips_over_a_module_that_must_import():
    assert silent_skips(TESTS, pinned_distributions()) == [], (
        "import these directly (a broken import must fail the tests, not skip them)")


def test_the_rule_catches_silent_skips(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "ring = pytest.importorskip('ds_infcl.loss.ring')\n"
        "peft = pytest.importorskip('peft')\n"
        "oc = pytest.importorskip('open_clip')\n"  # optional: allowed
        "def ring_available():\n"
        "    try:\n"
        "        from ds_infcl.loss.ring import ring_infonce\n"
        "    except ImportError:\n"
        "        return False\n"
        "    return True\n"
        "try:\n"
        "    import matplotlib\n"  # optional: allowed
        "except ImportError:\n"
        "    matplotlib = None\n"
        "try:\n"
        "    import yaml\n"
        "except (OSError, Exception):\n"
        "    pass\n"
        "try:\n"
        "    import torch\n"
        "except ValueError:\n"  # does not catch an import error
        "    pass\n"
    )
    pinned = pinned_distributions(_write(tmp_path / "req.txt", "peft==0.21.2\npyyaml>=6.0  # yaml\ntorch==2.13.0\n"))
    assert pinned == {"peft", "pyyaml", "torch"}
    dists = {"peft": ["peft"], "yaml": ["PyYAML"], "torch": ["torch"], "open_clip": ["open_clip_torch"],
             "matplotlib": ["matplotlib"]}
    assert silent_skips(tmp_path, pinned, dists) == [
        "test_a.py:2 importorskip('ds_infcl.loss.ring')",
        "test_a.py:3 importorskip('peft')",
        "test_a.py:6 catches the import error of ds_infcl.loss.ring",
        "test_a.py:15 catches the import error of yaml",
    ]


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    return path
