"""README.md's module list is the package tree: every module and package under
``layer_boundary/`` listed, none listed that is not there, each with its docstring's line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("readme_modules",
                                                  ROOT / "scripts" / "readme_modules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listed(block: str) -> set[str]:
    """The paths the README's list names, read from its indentation (two spaces a level)."""
    paths, parents = set(), []
    for line in block.strip().strip("`").strip("\n").splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del parents[depth:]
        paths.add("/".join([*parents, name]))
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
    return paths


def _tree() -> set[str]:
    package = ROOT / "layer_boundary"
    paths = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(ROOT)
        paths.add(f"{rel.parent}/" if path.name == "__init__.py" else str(rel))
    return paths


def test_the_readme_lists_every_module_of_the_package_and_no_other():
    generator = _generator()
    match = generator.BLOCK.search((ROOT / "README.md").read_text())
    assert match, "README.md has no <!-- generated: modules --> block"
    listed, tree = _listed(match[2]), _tree()
    wrong = [f"lacks {sorted(tree - listed)}"] if tree - listed else []
    wrong += [f"names {sorted(listed - tree)}, not in the tree"] if listed - tree else []
    assert not wrong, (f"README.md's module list {'; '.join(wrong)}: run "
                       "python scripts/readme_modules.py --write")
    assert match[2] == generator.module_list(), (
        "README.md's module list is stale (a docstring's first line changed): run "
        "python scripts/readme_modules.py --write")
