"""docs/ and the README: the generated references are current, every runnable code block
runs, every relative link reaches a file of the repository, and the README points nowhere
outside it."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"```python runnable\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_generated_references_are_current(monkeypatch, capsys):
    # in this process (no interpreter and torch import); generate sets COLUMNS for argparse,
    # which monkeypatch restores afterwards
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    monkeypatch.setenv("COLUMNS", os.environ.get("COLUMNS", "80"))
    assert generate.main(["--check"]) == 0, capsys.readouterr().out


def _blocks():
    for page in PAGES:
        for i, block in enumerate(RUNNABLE.findall(page.read_text())):
            yield pytest.param(block, id=f"{page.name}-{i}")


def test_there_are_runnable_blocks():
    assert len(list(_blocks())) >= 1


@pytest.mark.parametrize("block", list(_blocks()))
def test_each_runnable_block_runs(block):
    exec(compile(block, "<docs block>", "exec"), {"__name__": "docs_block"})


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_of_the_repository(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        assert ROOT in path.parents or path == ROOT, f"{page.name} links outside: {target}"


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert "../" not in text  # nothing outside the repository
    # the generated module list (folded, tests/test_readme.py) is not what a reader pages past
    prose = re.sub(r"<!-- generated: modules -->.*?<!-- end generated -->", "", text, flags=re.S)
    assert len(prose.splitlines()) < 200
    for page in ("concepts", "features", "models", "adding-a-model", "engine-integration",
                 "api", "cli", "benchmarks"):
        assert f"(docs/{page}.md)" in text


def test_every_public_name_is_documented():
    """Every entry of the API reference says what it is (its own docstring)."""
    text = (ROOT / "docs" / "api.md").read_text()
    assert "(no docstring)" not in text
    assert "Create a collection of name/value pairs" not in text  # an enum's inherited one
