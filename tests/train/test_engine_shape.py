"""The engine stays readable: no function in ``ds_infcl/train/*.py`` over 80 lines (split what is
longer where a job boundary exists), and the engine asks the task for nothing with ``hasattr``:
the ``Task`` base class has every method it calls."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "ds_infcl" / "train"
MAX_FUNCTION_LINES = 80


def _functions(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.lineno, node.end_lineno - start + 1


def test_no_function_in_the_engine_is_over_80_lines():
    long = [f"{path.name}:{line} {name} ({n} lines)"
            for path in sorted(ROOT.glob("*.py")) for name, line, n in _functions(path) if n > MAX_FUNCTION_LINES]
    assert long == [], f"split these functions (at most {MAX_FUNCTION_LINES} lines each): {long}"


def test_the_checker_counts_lines(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    path = tmp_path / "long.py"
    path.write_text(f"def short():\n    pass\n\n\n@staticmethod\ndef long():\n{body}\n")
    assert [(name, n) for name, _, n in _functions(path)] == [("short", 2), ("long", 87)]


def test_the_engine_does_not_probe_the_task():
    probes = []
    for path in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "task"):
                probes.append(f"{path.name}:{node.lineno}")
    assert probes == [], f"call the Task method instead (ds_infcl.tasks.base.Task has a default): {probes}"
