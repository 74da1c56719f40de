"""The import direction of DESIGN.md section 1, enforced on the source (no import-linter needed).

Every ``import`` / ``from ... import`` statement of a package, at any depth (lazy imports count),
is checked against the packages it must never reach.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ds_infcl"

FORBIDDEN = {
    "ops": ("torch.distributed", "deepspeed", "ds_infcl.ring", "ds_infcl.loss", "ds_infcl.adapters",
            "ds_infcl.data", "ds_infcl.train"),
    "ring": ("ds_infcl.ops", "ds_infcl.loss", "ds_infcl.adapters", "ds_infcl.data", "ds_infcl.train",
             "transformers", "sentence_transformers"),
    "loss": ("ds_infcl.adapters", "ds_infcl.data", "ds_infcl.train", "deepspeed"),
    "adapters": ("ds_infcl.train", "ds_infcl.data", "deepspeed", "ds_infcl.ops", "ds_infcl.ring"),
    "data": ("ds_infcl.loss", "ds_infcl.train", "ds_infcl.ops", "ds_infcl.ring", "ds_infcl.adapters", "deepspeed"),
}


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _violations(package: str):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for lineno, name in _imports(path):
            for bad in FORBIDDEN[package]:
                if name == bad or name.startswith(bad + "."):
                    found.append(f"{path.relative_to(ROOT.parent)}:{lineno} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    if not (ROOT / package).is_dir():
        pytest.skip(f"ds_infcl/{package} does not exist yet")
    assert _violations(package) == []
