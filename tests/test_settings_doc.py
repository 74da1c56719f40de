"""docs/settings.md names every ``DS_INFCL_*`` environment variable the package reads, and only
those: the page is the users' list of settings, so it must follow the code."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"DS_INFCL_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")  # full names (a trailing "_" is a prefix being built)


def _in_code():
    names = set()
    for path in (ROOT / "ds_infcl").rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def test_every_setting_is_documented():
    code = _in_code()
    doc = set(NAME.findall((ROOT / "docs" / "settings.md").read_text()))
    assert code - doc == set(), f"read by the code, missing from docs/settings.md: {sorted(code - doc)}"
    assert doc - code == set(), f"in docs/settings.md, read nowhere: {sorted(doc - code)}"
