"""docs/settings.md is generated from the table in ds_infcl/settings.py (``python -m ds_infcl.settings
--markdown > docs/settings.md``): the committed page must be that text, and the table must name every
``DS_INFCL_*`` variable the package mentions, so that the users' list of settings follows the code."""

import os
import pathlib
import re
import subprocess
import sys

from ds_infcl import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"DS_INFCL_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")  # full names (a trailing "_" is a prefix being built)


def test_the_page_is_the_generated_text():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == settings.markdown(), (
        "docs/settings.md differs from the table in ds_infcl/settings.py: regenerate it with "
        "python -m ds_infcl.settings --markdown > docs/settings.md")


def test_the_command_prints_the_page():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "ds_infcl.settings", "--markdown"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out == (ROOT / "docs" / "settings.md").read_text()


def test_every_name_in_the_code_is_declared_and_on_the_page():
    in_code = set()
    for path in (ROOT / "ds_infcl").rglob("*.py"):
        if path.name != "settings.py" or path.parent.name != "ds_infcl":
            in_code |= set(NAME.findall(path.read_text()))
    declared = {s.name for s in settings.SETTINGS}
    assert in_code - declared == set(), f"mentioned in ds_infcl/, not declared in settings.py: {sorted(in_code - declared)}"
    assert declared - in_code == set(), f"declared in settings.py, used nowhere: {sorted(declared - in_code)}"
    page = set(NAME.findall((ROOT / "docs" / "settings.md").read_text()))
    assert declared <= page
