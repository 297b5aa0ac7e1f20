"""The package imports only downward (checked on the source, so CI enforces it).

The host runtime stands below the library and imports nothing from it (the table of
combination rules lives in ``runtime/``; ``capabilities`` above it only re-exports it), nor
any third-party package but torch, numpy, safetensors and huggingface_hub; ``residual/`` never
imports the stage layer; models use the public surface (the package root, the runtime,
``residual.batch`` and the residual protocols), never internals such as ``ops`` or ``output``;
the engine (``engine/``: runner, command line, bench, generation drivers) stands on top, and
nothing of the core imports it (only ``python -m layer_boundary`` delegates to its CLI).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "layer_boundary"

# module (dotted, relative to the package) -> level; a module may import its own level or
# below. Longest prefix wins.
LEVELS = {
    "runtime": 0,
    "capabilities": 0,  # re-exports the table of combination rules, which the runtime holds
    "layout": 1, "contracts": 1, "ops": 1, "row_facts": 1, "primitives": 1,
    "output": 2, "residual": 2, "fusions": 2,
    "exit": 3, "prepare": 3, "boundary": 3, "construction": 3, "step": 3, "parallel_block": 3,
    "row_modes": 3,  # which row mode a forward takes: construction's decision, beside it
    "stage": 4, "capture": 4, "stack": 4, "factories": 4, "adapters": 4,
    "": 5,  # the package root: the public surface
    "models": 6,
    "engine": 7,
    "__main__": 8,  # ``python -m layer_boundary``: the engine's command line
}
MODEL_SURFACE = ("", "runtime", "residual", "residual.batch", "residual.mhc", "residual.quant",
                 "residual.scaled", "residual.short_conv", "models", "capabilities")


def level(module: str) -> int:
    best = max((p for p in LEVELS if module == p or module.startswith(p + ".") or p == ""),
               key=len)
    return LEVELS[best]


@functools.cache  # the tree does not change during a run
def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def imports_of(module: str, path: Path) -> frozenset[str]:
    """Package modules ``module`` imports (relative to the package), anywhere in the file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("layer_boundary"):
                target = node.module[len("layer_boundary"):].lstrip(".")
            else:
                continue
            names = [a.name for a in node.names]
            known = modules()
            subs = [f"{target}.{n}".lstrip(".") for n in names]
            hits = [m for m in subs if m in known]
            found.update(hits if hits else [target])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("layer_boundary"):
                    found.add(alias.name[len("layer_boundary"):].lstrip("."))
    found.discard(module)
    return frozenset(found)


MODULES = modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_only_downward(module):
    mine = level(module)
    for target in imports_of(module, MODULES[module]):
        assert level(target) <= mine, f"{module or 'layer_boundary'} (level {mine}) imports " \
                                      f"{target or 'layer_boundary'} (level {level(target)})"
        if module.startswith("runtime"):  # below the library: nothing of it
            assert _in_runtime(target), f"runtime module {module} imports {target}"
        if module == "capabilities":
            assert target.startswith("runtime."), f"capabilities imports {target}"
        if module.startswith("residual"):
            assert level(target) <= 2, f"{module} imports {target}"
        if module.startswith("models"):
            assert target in MODEL_SURFACE or target.startswith(("runtime.", "models.")), \
                f"model module {module} imports the internal {target}"
        if not _in_engine(module) and module != "__main__":
            assert not _in_engine(target), f"core module {module or 'layer_boundary'} " \
                                           f"imports the engine's {target}"


def _in_engine(module: str) -> bool:
    return module == "engine" or module.startswith("engine.")


def _in_runtime(module: str) -> bool:
    return module == "runtime" or module.startswith("runtime.")


# what a runtime module may import besides the runtime itself: the runtime serves engines
# that bring only these (and the standard library)
RUNTIME_THIRD_PARTY = frozenset({"torch", "numpy", "safetensors", "huggingface_hub"})


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names of the absolute imports in ``path``, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in_runtime(m)))
def test_the_runtime_imports_only_itself_torch_and_the_standard_library(module):
    """A runtime module imports runtime modules, the standard library, torch, numpy,
    safetensors and huggingface_hub: nothing of the library above it."""
    path = MODULES[module]
    for target in imports_of(module, path):
        assert _in_runtime(target), f"runtime module {module} imports {target or 'the root'}"
    allowed = set(sys.stdlib_module_names) | RUNTIME_THIRD_PARTY | {"__future__"}
    outside = _top_level_imports(path) - allowed
    # an absolute import of the package itself is checked above, as a package module
    assert outside <= {"layer_boundary"}, f"runtime module {module} imports {sorted(outside)}"


def test_the_engine_is_a_subpackage_at_the_top():
    """What plays the engine lives in ``engine/``; the package root holds none of it."""
    engine = {m for m in MODULES if _in_engine(m)}
    assert {"engine.runner", "engine.cli", "engine.bench", "engine.generate",
            "engine.speculative"} <= engine
    assert not {"runner", "cli", "bench", "models.generate", "models.speculative"} & set(MODULES)
    assert max(level(m) for m in MODULES if m != "__main__") == level("engine.cli")
    assert imports_of("__main__", MODULES["__main__"]) == {"engine.cli"}


def test_no_module_exceeds_500_lines_and_no_function_100():
    """Files of a few hundred lines with one job each; no function a reader must scroll."""
    for module, path in MODULES.items():
        source = path.read_text()
        assert len(source.splitlines()) <= 500, module
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 100, f"{module}.{node.name}"


# the residual stream's slots no other object of the package names: written only by the
# stream's own transitions (``residual/stream.py``)
STREAM_SLOTS = frozenset({"residual_rows", "contribution", "prepared_input", "branch_output",
                          "made_by", "beside", "handle", "pending", "residual", "owner"})


def stream_slot_writes(source: str) -> list[str]:
    """Assignments to a stream slot on anything but ``self`` (what another module writing a
    stream's slot looks like)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                   else [])
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if (isinstance(t, ast.Attribute) and t.attr in STREAM_SLOTS
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                    found.append(f"{ast.unparse(t)} (line {node.lineno})")
    return found


def test_only_the_stream_writes_its_slots():
    assert stream_slot_writes("branch.residual, branch.handle = r, h\ns.pending = None\n")
    assert not stream_slot_writes("self.handle = h\nstream.begin(stage, step, x)\n")
    for module, path in MODULES.items():
        if module != "residual.stream":
            assert not stream_slot_writes(path.read_text()), module


def test_the_check_sees_imports():
    """Guards the test above against finding nothing to check."""
    assert "runtime.collectives" in imports_of("primitives", MODULES["primitives"])
    assert "residual.batch" in imports_of("step", MODULES["step"])
    assert "" in imports_of("models.qwen3", MODULES["models.qwen3"])
    assert level("runtime.linear") == 0 and level("models.qwen3") == 6 and level("") == 5
    assert "models.pipeline" in imports_of("models.base", MODULES["models.base"])
    assert "engine.generate" in imports_of("engine.runner", MODULES["engine.runner"])
    # the runtime asks the rules table at its own level, not above it
    assert "runtime.capabilities" in imports_of("runtime.args", MODULES["runtime.args"])
    assert "torch" in _top_level_imports(MODULES["runtime.collectives"])


def test_no_two_modules_import_each_other():
    """Imports inside functions count too: two modules that need each other are one job in
    two files (a package importing its own submodule, which imports its parent, excepted)."""
    pairs = []
    for module, path in MODULES.items():
        for target in imports_of(module, path):
            if target not in MODULES or module in (target, "") or target == "":
                continue
            nested = module.startswith(target + ".") or target.startswith(module + ".")
            if not nested and module in imports_of(target, MODULES[target]):
                pairs.append(tuple(sorted((module, target))))
    assert sorted(set(pairs)) == []
    assert "factories" in imports_of("stack", MODULES["stack"])  # the check sees that edge
