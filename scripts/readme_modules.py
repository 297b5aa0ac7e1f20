"""README.md's module list, drawn from the package tree: every package and module under
``layer_boundary/``, each with the first line of its docstring.

    python scripts/readme_modules.py          # print the list
    python scripts/readme_modules.py --write  # replace README.md's generated block with it

The list stands between ``<!-- generated: modules -->`` and ``<!-- end generated -->`` in
README.md; ``tests/test_readme.py`` checks it against the tree.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "layer_boundary"
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- generated: modules -->\n)(.*?)(<!-- end generated -->)", re.S)


def job(path: Path) -> str:
    """The docstring's first line, shortened to what it says whole: its first sentence, or
    its clauses that end on that line (a line that stops mid-clause ends in "…")."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        return ""
    line = doc.strip().splitlines()[0].strip().replace("``", "`")
    end = re.search(r"\.(\s|$)", line)
    if end:
        return line[:end.start()]
    depth, cut = 0, -1  # the last clause break outside parentheses
    for i, ch in enumerate(line):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and line.startswith((", ", ": ", "; "), i):
            cut = i
    # a break this early would drop most of the line: keep the line, marked as cut short
    return line[:cut] if depth == 0 and cut >= 0.6 * len(line) else line + " …"


def entries(package: Path = PACKAGE, depth: int = 0) -> list[tuple[int, str, str]]:
    """(depth, name, job) for the package, its modules, then its subpackages, by name."""
    out = [(depth, package.name + "/", job(package / "__init__.py"))]
    for module in sorted(package.glob("*.py")):
        if module.name != "__init__.py":
            out.append((depth + 1, module.name, job(module)))
    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        out += entries(sub, depth + 1)
    return out


def module_list() -> str:
    """The fenced block README.md holds."""
    rows = entries()
    width = max(2 * depth + len(name) for depth, name, _ in rows) + 2
    lines = [f"{'  ' * depth + name:<{width}}{text}".rstrip() for depth, name, text in rows]
    return "```\n" + "\n".join(lines) + "\n```\n"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        text = README.read_text()
        if not BLOCK.search(text):
            raise SystemExit(f"{README}: no <!-- generated: modules --> block")
        README.write_text(BLOCK.sub(lambda m: m[1] + module_list() + m[3], text))
        return 0
    if argv:
        raise SystemExit(__doc__)
    print(module_list(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
