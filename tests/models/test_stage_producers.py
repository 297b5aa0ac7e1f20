"""A stage's compute leaves to the boundary the sums the boundary owns.

At construction every reference model checks that no module computing a PARTIAL stage (an
attention whose output projection must never reduce) sums its output, and refuses by name.
On the source, every sum a model file runs (an all-reduce or reduce-scatter) sits where the
exit's flags leave the sum to compute, or is a named statistic that is no stage's output;
no model file talks to ``torch.distributed`` itself: collectives go through the runtime's
parallel linears and helpers, which honour the flags.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from model_configs import CONFIGS, build, config

import layer_boundary.models
from layer_boundary import ProducerReduction
from layer_boundary.models.base import check_stage_producers

MODELS = Path(layer_boundary.models.__file__).parent
# the engine's drivers (generation, speculative decoding): they run forwards and exchange
# sampled tokens and acceptance counts, no stage's compute
DRIVERS = {"generate.py", "speculative.py"}
# sums that are no stage's output, each with its reason
STATISTICS = {
    ("mamba2.py", "GatedRMSNorm.forward"): "the squares of a norm group split over ranks",
}
SUMS = ("all_reduce", "reduce_scatter")
GUARDS = ("reduce_results",)  # compute built to sum its own output
NEGATED_GUARDS = ("skips_reduction",)  # the exit leaves the sum to compute when this is False


def _name(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def _requires_own_sum(test) -> bool:
    """Whether ``test`` holds only where compute owns its output's sum: ``reduce_results``,
    ``not <flags>.skips_reduction``, or an ``and`` with one of them."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_requires_own_sum(v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _name(test.operand) in NEGATED_GUARDS
    return _name(test) in GUARDS


def unguarded_sums(source: str, file: str = "") -> list[str]:
    """Sum calls outside such a guard, and any use of ``torch.distributed``, as
    "line: code", once per line (a listed statistic excepted)."""
    found = {}

    def report(node):
        found.setdefault(node.lineno, f"{node.lineno}: {ast.unparse(node)}")

    def visit(node, guarded: bool, where: tuple):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.")
                   or (getattr(node, "module", None) == "torch" and n == "distributed")
                   for n in names):
                report(node)
        if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed"):
            report(node)
            return
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            where = where + (node.name,)
        if isinstance(node, ast.If) and _requires_own_sum(node.test):
            for child in node.body:
                visit(child, True, where)
            for child in node.orelse:
                visit(child, guarded, where)
            return
        if isinstance(node, ast.Call) and not guarded:
            name = _name(node.func) or ""
            if name.startswith(SUMS) and (file, ".".join(where)) not in STATISTICS:
                report(node)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded, where)

    visit(ast.parse(source), False, ())
    return [found[line] for line in sorted(found)]


def test_model_files_leave_stage_sums_to_the_boundary():
    checked, offenders = 0, {}
    for path in sorted(MODELS.glob("*.py")):
        if path.name in DRIVERS:
            continue
        checked += 1
        sums = unguarded_sums(path.read_text(), path.name)
        if sums:
            offenders[path.name] = sums
    assert checked >= 15
    assert offenders == {}


def test_the_scan_finds_what_it_must():
    source = (
        "import torch.distributed as dist\n"
        "class Moe:\n"
        "    def forward(self, x, flags):\n"
        "        if not flags.skips_reduction:\n"
        "            x = all_reduce_rows(x, self.group)\n"
        "        if self.reduce_results and x.numel():\n"
        "            x = all_reduce_rows(x, self.group)\n"
        "        if flags.skips_reduction:\n"
        "            x = all_reduce_rows(x, self.group)\n"
        "        if not self.reduce_results:\n"
        "            x = reduce_scatter_rows(x, self.group)\n"
        "        if x.numel() or self.reduce_results:\n"
        "            x = all_reduce_rows(x, self.group)\n"
        "        torch.distributed.all_reduce(x)\n"
        "        return all_reduce_rows(x, self.group)\n")
    assert unguarded_sums(source) == [
        "1: import torch.distributed as dist",
        "9: all_reduce_rows(x, self.group)",
        "11: reduce_scatter_rows(x, self.group)",
        "13: all_reduce_rows(x, self.group)",
        "14: torch.distributed.all_reduce(x)",
        "15: all_reduce_rows(x, self.group)"]


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_a_partial_stage_whose_compute_sums_is_refused_by_name(model_type):
    """Each model passes its own check; with one of its PARTIAL attention's output
    projections turned into one that reduces, the check names that module."""
    model_cls, cfg = config(model_type)
    (model,) = build(model_cls, cfg, tp=2, pp=1)
    layers = list(zip(model.stage.layers, model.model.layers))
    check_stage_producers(layers, "model.layers")
    partial = [(i, layer, stage, name) for i, layer in layers
               for stage, name in layer.stage_compute()
               if stage.declaration.reduction is ProducerReduction.PARTIAL]
    if model_type == "nemotron_h":  # its mixers are SCOPED: they sum unless the exit says not
        assert partial == []
        return
    i, layer, stage, name = partial[-1]
    projection = next(n for n, m in layer.get_submodule(name).named_modules()
                      if hasattr(m, "reduce_results"))
    layer.get_submodule(f"{name}.{projection}").reduce_results = True
    with pytest.raises(ValueError, match=f"^model.layers.{i}.{name}.{projection} sums its own "
                                         f"output \\(RowParallelLinear\\), but it computes stage "
                                         f"{stage.name}, which is PARTIAL"):
        check_stage_producers(layers, "model.layers")


ASSEMBLERS = ("make_stages", "make_attn_stage", "make_ffn_stage")
NEIGHBOURS = ("previous", "following", "terminal")


def test_model_files_build_through_the_layer_stack():
    """No model file assembles stages with explicit neighbours: layers append their
    declarations, and the stack (opened by ``pipeline.pipeline_stack``) supplies them."""
    offenders = []
    for path in sorted(MODELS.glob("*.py")):
        if path.name in DRIVERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            said = [k.arg for k in node.keywords if k.arg in NEIGHBOURS]
            if name in ASSEMBLERS or (said and name != "layer_stack"):
                offenders.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)} {said}")
    assert offenders == []
