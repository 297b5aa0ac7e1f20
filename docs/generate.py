"""The generated parts of docs/: the API reference of the public surface (from docstrings),
the command-line reference (from the parser's own help) and the table of which features
combine (from ``layer_boundary.capabilities``).

    python docs/generate.py          # rewrite the generated blocks in place
    python docs/generate.py --check  # exit 1, naming the file, where a block is stale

A generated block stands between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``;
everything else in the file is written by hand. ``tests/test_docs.py`` runs ``--check``.
"""

from __future__ import annotations

import enum
import inspect
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
SURFACE = ("layer_boundary", "layer_boundary.residual.batch", "layer_boundary.runtime",
           "layer_boundary.capabilities")
HELP_WIDTH = "96"


def _summary(obj) -> str:
    # a class's own docstring, never one inherited (an enum's would be Enum's)
    doc = (inspect.cleandoc(obj.__dict__.get("__doc__") or "") if inspect.isclass(obj)
           else inspect.getdoc(obj) or "")
    first = doc.split("\n\n")[0].replace("\n", " ").strip()
    return first or "(no docstring)"


def _signature(name: str, obj) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _public(module_name: str) -> list[str]:
    import importlib

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:  # a module of functions: those it defines itself
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and inspect.isfunction(v) and v.__module__ == module_name]
    return [n for n in names if n != "__version__"]


def api_reference() -> str:
    import importlib

    out = []
    for module_name in SURFACE:
        module = importlib.import_module(module_name)
        out.append(f"### `{module_name}`\n")
        for name in sorted(_public(module_name), key=str.lower):
            obj = getattr(module, name)
            if isinstance(obj, enum.EnumMeta):
                members = ", ".join(m.name for m in obj)
                out.append(f"- `{name}` (enum: {members}): {_summary(obj)}")
            elif inspect.isclass(obj) or inspect.isfunction(obj):
                kind = "class" if inspect.isclass(obj) else "function"
                out.append(f"- `{_signature(name, obj)}` ({kind}): {_summary(obj)}")
            else:
                out.append(f"- `{name}` ({type(obj).__name__}): {_summary_of_value(obj)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _summary_of_value(value) -> str:
    """A literal's value; an instance's class docstring (a repr may hold an address)."""
    if isinstance(value, (str, int, float, tuple)) and len(repr(value)) <= 70:
        return f"`{value!r}`"
    return f"an instance: {_summary(type(value))}"


def cli_reference() -> str:
    os.environ["COLUMNS"] = HELP_WIDTH  # argparse wraps to the terminal: a fixed width
    from layer_boundary.engine.args import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = ["### `layer-boundary`\n", "```", parser.format_help().rstrip(), "```", ""]
    for name, command in sub.choices.items():
        out += [f"### `layer-boundary {name}`\n", "```", command.format_help().rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def combinations_reference() -> str:
    """The table of which features combine (``layer_boundary.capabilities``): the pair matrix,
    each refused pair with why, and what each feature needs of the model and the layout."""
    from layer_boundary.capabilities import (GRAPH_RULES, LAYOUT_RULES, MODEL_RULES, PAIRS,
                                             Feature, pair_rule)

    features = list(Feature)
    number = {rule: i + 1 for i, rule in enumerate(PAIRS)}
    out = ["| | " + " | ".join(f.short for f in features) + " |",
           "| --- |" + " :---: |" * len(features)]
    for a in features:
        cells = []
        for b in features:
            rule = None if a is b else pair_rule(a, b)
            cells.append("" if a is b else "yes" if rule is None else f"no ({number[rule]})")
        out.append(f"| **{a.short}** | " + " | ".join(cells) + " |")
    out += ["", "Refused pairs (each message as the command line and the library give it):", ""]
    out += [f"{number[r]}. {r.message()}" for r in PAIRS]
    out += ["", "The features (column, command line, library):", ""]
    out += [f"- **{f.short}** {f.value}: `{f.flag}`, `{f.field}`" for f in features]
    out += ["", "What a feature needs of the model, its draft and the layout (checked with the "
            "pairs):", ""]
    out += [f"- {'every run' if r.feature is None else f'**{r.feature.short}**'}: {r.needs}"
            for r in MODEL_RULES + LAYOUT_RULES]
    out += ["", "Where decode steps run eagerly rather than from CUDA graphs on `--device cuda` "
            "(not a refusal: the report says why; `engine.graphs.decide_graphs`):", ""]
    out += [f"- **{r.feature.short}**: {r.why}" for r in GRAPH_RULES]
    return "\n".join(out) + "\n"


BLOCKS = {"api.md": ("api", api_reference), "cli.md": ("cli", cli_reference),
          "combinations.md": ("combinations", combinations_reference)}
MARK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(path: Path) -> str:
    text = path.read_text()
    name, make = BLOCKS[path.name]
    if f"<!-- generated: {name} -->" not in text:
        raise SystemExit(f"{path}: no <!-- generated: {name} --> block")
    return MARK.sub(lambda m: m.group(1) + make() + m.group(4), text)


def main(argv) -> int:
    stale = []
    for file in BLOCKS:
        path = DOCS / file
        new = render(path)
        if new != path.read_text():
            if "--check" in argv:
                stale.append(str(path))
            else:
                path.write_text(new)
    if stale:
        print(f"stale generated docs (run python docs/generate.py): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
