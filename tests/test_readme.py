"""The README runs as written, and the docs' links lead somewhere.

- Every ```python block of README.md runs, in order, in one fresh namespace (CPU, small sizes).
- Every ```json block of README.md is a run config that ``load_run_config`` accepts, and its
  ``task.args`` are arguments the named task takes.
- The shell blocks name files that exist (``ds_configs/*.json``, ``launch/*``) and modules that
  import (``python -m X``, ``--module X``).
- Every figure of the headline table is in the raw file its row links, at the precision written.
- Every relative link in README.md and docs/**/*.md points to an existing file, and an anchor
  (``page.md#heading``) to a heading of that page.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def fenced_blocks(text: str, lang: str) -> List[Tuple[int, str]]:
    """(first line number, body) of every fenced block of the language ``lang``."""
    return [(text[: m.start()].count("\n") + 2, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def run_python_blocks(text: str, source: str) -> Dict[str, object]:
    """Run the ```python blocks of ``text`` in order in one fresh namespace; a failing block
    raises with the line of the README where it starts."""
    namespace: Dict[str, object] = {"__name__": "__readme__"}
    blocks = fenced_blocks(text, "python")
    for line, body in blocks:
        # Line numbers of a traceback are the README's own.
        code = compile("\n" * (line - 1) + body, source, "exec")
        try:
            exec(code, namespace)  # noqa: S102 -- the README's own snippets
        except Exception as e:
            raise AssertionError(f"{source}: the python block at line {line} failed: {type(e).__name__}: {e}") from e
    return namespace


def test_readme_has_the_two_commands_and_three_recipes():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    for recipe in ("Recipe (a)", "Recipe (b)", "Recipe (c)"):
        assert f"## {recipe}" in text, f"README.md lost its heading '## {recipe}'"
    assert len(fenced_blocks(text, "python")) >= 1
    assert len(fenced_blocks(text, "json")) >= 2


def test_readme_python_blocks_run(capsys):
    namespace = run_python_blocks(README.read_text(), str(README))
    assert "loss_fn" in namespace  # recipe (a) ran to its end


def test_a_broken_snippet_fails():
    """The runner reports the failing block by its line (a snippet that breaks fails the test)."""
    text = "intro\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'x is not 2'\n```\n"
    with pytest.raises(AssertionError, match=r"line 10 failed: AssertionError: x is not 2"):
        run_python_blocks(text, "fake.md")
    text = "```python\nfrom ds_infcl.loss import NoSuchLoss\n```\n"
    with pytest.raises(AssertionError, match="NoSuchLoss"):
        run_python_blocks(text, "fake.md")


# The tasks the README's run configs name, and the classes the trainer builds for them.
README_TASKS = {"clip": "ds_infcl.tasks.clip:ClipTask", "retrieval": "ds_infcl.tasks.retrieval:RetrievalTask"}


def task_factory(name: str):
    assert name in README_TASKS, f"the README names task {name!r}; add its class to README_TASKS"
    module, _, attr = README_TASKS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("index", range(len(fenced_blocks(README.read_text(), "json"))))
def test_readme_run_configs_validate(index, tmp_path):
    from ds_infcl.train.config import load_run_config

    line, body = fenced_blocks(README.read_text(), "json")[index]
    raw = json.loads(body)
    path = tmp_path / "run.json"
    path.write_text(body)
    cfg = load_run_config(str(path))
    assert cfg.task.name == raw["task"]["name"]
    factory = task_factory(cfg.task.name)
    params = inspect.signature(factory).parameters
    unknown = set(cfg.task.args) - set(params)
    assert not unknown, f"README.md line {line}: task {cfg.task.name!r} takes no argument(s) {sorted(unknown)}"


def test_readme_clip_recipe_passes_check_on_img2dataset_shards(tmp_path, capsys):
    """Recipe (b)'s own ``--check`` line, on its run config pointed at a tiny folder in
    img2dataset's layout (tars of jpg + txt + json, and sizes.json)."""
    from ds_infcl.data.synth_jpeg_shards import write_synth_jpeg_shards
    from ds_infcl.train.cli import main

    text = README.read_text()
    recipe = text.split("## Recipe (b)", 1)[1].split("\n## ", 1)[0]
    (_, body), = fenced_blocks(recipe, "json")
    config = json.loads(body)
    shards = tmp_path / "shards"
    write_synth_jpeg_shards(str(shards), num_samples=8, samples_per_shard=4, image_size=32, processes=1)
    config["task"]["args"]["data_dir"] = str(shards)
    config["output_dir"] = str(tmp_path / "out")
    (tmp_path / "run.json").write_text(json.dumps(config))
    lines = [ln for _, b in fenced_blocks(recipe, "bash") for ln in b.splitlines() if "--check" in ln]
    assert len(lines) == 1, "recipe (b) should show one --check line"
    argv = lines[0].split()
    assert argv[:3] == ["python", "-m", "ds_infcl.train"], lines[0]
    argv = [str(tmp_path / "run.json") if a == "run.json" else a for a in argv[3:]]
    assert main(argv) == 0, capsys.readouterr().err
    assert "ok: world" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # --check writes nothing
    config["task"]["args"]["data_dir"] = str(tmp_path / "missing")
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert main(argv) == 2
    assert "task.args.data_dir" in capsys.readouterr().err


def shell_text() -> str:
    text = README.read_text()
    return "\n".join(body for _, body in fenced_blocks(text, "bash"))


def test_readme_shell_blocks_name_files_and_modules_that_exist():
    shell = shell_text()
    files = set(re.findall(r"\b((?:ds_configs|launch)/[\w./-]+)", README.read_text()))
    assert files, "the README names no ds_configs/ or launch/ file"
    for name in sorted(files):
        assert (ROOT / name.rstrip(".")).is_file(), f"README.md names {name}, which does not exist"
    modules = set(re.findall(r"(?:python -m|--module)\s+([\w.]+)", shell))
    assert "ds_infcl.train" in modules
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, f"README.md runs module {module}, which does not exist"
    targets = set(re.findall(r"^\s*make ([\w-]+)", shell, re.M))
    makefile = (ROOT / "Makefile").read_text()
    for target in sorted(targets):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"README.md runs make {target}: no such target"
    assert {"demo", "test"} <= targets


# --- the headline table against its raw files ------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(%?)")


def numbers_in(text: str) -> List[float]:
    return [float(m.group(0).rstrip("%").replace(",", "")) for m in NUMBER.finditer(text)]


def headline_rows() -> List[Tuple[str, str, Path]]:
    """(figures cell, baseline cell, raw file) of each row of the headline table."""
    text = README.read_text()
    section = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("what", "---"):
            continue
        link = re.search(r"\]\(([^)]+)\)", cells[3])
        assert link, f"headline row without a link to its raw file: {line}"
        rows.append((cells[1], cells[2], ROOT / link.group(1)))
    return rows


def found(figure: str, raw: List[float]) -> bool:
    """A figure as written (``34.9``, ``92.1%``, ``0.235``) matches a raw number at its precision;
    a percentage also matches a fraction (``0.9212``)."""
    text = figure.replace(",", "")
    percent = text.endswith("%")
    text = text.rstrip("%")
    decimals = len(text.split(".")[1]) if "." in text else 0
    value = float(text)
    half = 0.5 * 10 ** -decimals + 1e-9
    candidates = raw + ([100 * r for r in raw] if percent else [])
    return any(abs(c - value) <= half for c in candidates)


def test_headline_table_figures_match_their_raw_files():
    rows = headline_rows()
    assert len(rows) >= 4
    for figures, baseline, raw_path in rows:
        assert raw_path.is_file(), f"headline row links {raw_path}, which does not exist"
        raw = numbers_in(raw_path.read_text())
        for cell in (figures, baseline):
            # Sizes and counts in the row's own label ("1,536", "2,097,152") are in the first cell
            # only; here every figure with a decimal point or a percent sign is a measurement.
            for m in NUMBER.finditer(cell):
                figure = m.group(0)
                if "." not in figure and not figure.endswith("%"):
                    continue
                assert found(figure, raw), f"headline figure {figure} ({cell!r}) is not in {raw_path.name}"


def test_figure_check_rejects_a_wrong_figure():
    raw = numbers_in("gpu,ms,eff\nH100,34.8777,0.9212\n")
    assert found("34.9", raw) and found("92.1%", raw)
    assert not found("35.0", raw) and not found("93%", raw)


# --- links ---------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors_of(path: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        base, n = slug, 1
        while slug in out:
            slug = f"{base}-{n}"
            n += 1
        out.add(slug)
    return out


def broken_links(page: Path) -> List[str]:
    bad = []
    text = FENCE.sub("", page.read_text())
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#") and not target[1:]:
            continue  # http(s):, mailto:
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)")
    return bad


def test_every_relative_link_resolves():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    bad = [b for page in pages for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_link_check_finds_a_broken_link(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n## Some heading\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md) [ok](a.md#some-heading) [no](c.md) [no](a.md#other) [web](https://x.org)\n")
    assert broken_links(page) == ["b.md: c.md (no such file)", "b.md: a.md#other (no heading with that anchor)"]


def test_notes_index_lists_every_notes_page():
    notes = ROOT / "docs" / "notes"
    index = (notes / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in notes.glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/notes/README.md does not list {sorted(pages - listed)}"
