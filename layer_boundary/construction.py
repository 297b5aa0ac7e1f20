"""Build a ``StagePlan`` at construction and select its batch variant at forward."""

from __future__ import annotations

from dataclasses import dataclass

from .boundary import make_boundary, make_output_boundary, static_owed
from .contracts import BatchVariant, EdgeDecl, StageDecl, StageInput, StageKind, StageOutput
from .exit import ExitPath
from .layout import REPLICATED, SumGroup
from .prepare import EntryPath


class UnsupportedBoundary(ValueError):
    """A transition this package has no correct implementation for."""


def no_path_error(variant: BatchVariant) -> RuntimeError:
    return RuntimeError(f"no stage boundary path for the active {variant.value} batch")


@dataclass(frozen=True)
class StagePath:
    decl: StageDecl
    edge: EdgeDecl
    entry: EntryPath
    exit: ExitPath


class StagePlan:
    """Every path a stage supports, one per batch variant, built once."""

    __slots__ = ("name", "declaration", "paths")

    def __init__(self, name: str, declaration, paths: dict) -> None:
        self.name, self.declaration, self.paths = name, declaration, paths

    def select(self, forward_batch) -> StagePath:
        path = self.paths.get(forward_batch.variant)
        if path is None:
            raise no_path_error(forward_batch.variant)
        return path

    def describe(self, variant: BatchVariant = BatchVariant.ORDINARY) -> dict:
        path = self.paths.get(variant)
        if path is None:
            return {"stage": self.name, "entry": "unsupported", "exit": "unsupported"}
        return {"stage": self.name, "kind": self.declaration.describe(),
                "entry": path.entry.describe(), "exit": path.exit.default.label}


def build_plan(name: str, declaration, norm, following, runtime) -> StagePlan:
    dims = runtime.parallel.dims
    if dims.attn_dp > 1 or dims.attn_cp > 1 or dims.pp > 1:
        raise UnsupportedBoundary(
            f"stage {name}: no boundary path for attn_dp={dims.attn_dp}, attn_cp={dims.attn_cp}, "
            f"pp={dims.pp} yet (supported: attn_dp=1, attn_cp=1, pp=1)")
    if declaration.sparse:
        raise UnsupportedBoundary(f"stage {name}: sparse FFN stages have no boundary path yet")

    exit_path = make_output_boundary(declaration, following, runtime)
    entry = make_boundary(name, declaration, norm, runtime)
    prev = declaration.previous
    producer = None if prev is None else StageOutput(
        REPLICATED, prev.reduction, SumGroup.ATTN_TP if prev.kind is StageKind.ATTN else SumGroup.TP)
    stage_input = StageInput(REPLICATED, static_owed(runtime, declaration))
    stage_output = StageOutput(
        REPLICATED, declaration.reduction,
        SumGroup.ATTN_TP if declaration.kind is StageKind.ATTN else SumGroup.TP,
        leaves_for_all_reduce=any(d.owed is not None for d in exit_path.decisions))
    variant = BatchVariant.ORDINARY
    path = StagePath(StageDecl(variant, stage_input, stage_output),
                     EdgeDecl(producer, stage_input, REPLICATED, REPLICATED), entry, exit_path)
    return StagePlan(name, declaration, {variant: path})
