"""Build a ``StagePlan`` at construction and select its batch variant at forward."""

from __future__ import annotations

from dataclasses import dataclass

from .boundary import make_boundary, make_output_boundary, static_owed
from .contracts import BatchVariant, EdgeDecl, StageDecl, StageInput, StageKind, StageOutput
from .exit import ExitPath
from .layout import (REPLICATED, BatchRows, Layout, RowMode, SumGroup, TokenAxis,
                     token_axis_sizes)
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


def select_mode(runtime, counts: tuple[int, ...]) -> tuple[RowMode, str]:
    """The row mode of a forward with these DP token counts, and why (policy is permission)."""
    dims = runtime.parallel.dims
    if dims.tp == 1:
        return RowMode.AR, "tp=1"
    if runtime.allows_rsv:
        if dims.attn_dp > 1:
            return RowMode.RSV, "rsv"
        reason = "rsv needs attention DP"
    else:
        reason = ""
    if runtime.allows_rs:
        a = dims.attn_tp
        seg = -(-max(counts) // a) * a if counts else 0
        if runtime.rs_padding or all(c == seg for c in counts):
            return RowMode.RS, "rs" if not reason else f"rs ({reason})"
        why = f"rs needs padding: DP rows {list(counts)} vs attn_tp={a}, padding disallowed"
        reason = f"{reason}; {why}" if reason else why
    if runtime.boundary_reduction == "ar":
        return RowMode.AR, "ar"
    return RowMode.AR, f"fallback to ar ({reason})"


class StagePlan:
    """Every path a stage supports, per batch variant and row mode, built once."""

    __slots__ = ("name", "declaration", "paths", "runtime")

    def __init__(self, name: str, declaration, paths: dict, runtime) -> None:
        self.name, self.declaration, self.paths, self.runtime = name, declaration, paths, runtime

    def rows(self, forward_batch) -> BatchRows:
        """This forward's row facts; the first boundary of a forward computes them for all."""
        rows = forward_batch.rows
        if rows is None:
            counts = forward_batch.dp_token_counts
            mode, _ = select_mode(self.runtime, counts)
            rows = forward_batch.rows = BatchRows(mode, counts, self.runtime.parallel)
        return rows

    def select(self, forward_batch) -> tuple[StagePath, BatchRows]:
        rows = self.rows(forward_batch)
        path = self.paths.get((forward_batch.variant, rows.mode))
        if path is None:
            raise no_path_error(forward_batch.variant)
        return path, rows

    def describe(self, mode: RowMode = RowMode.AR,
                 variant: BatchVariant = BatchVariant.ORDINARY) -> dict:
        path = self.paths.get((variant, mode))
        if path is None:
            return {"stage": self.name, "entry": "unsupported", "exit": "unsupported"}
        return {"stage": self.name, "kind": self.declaration.describe(),
                "residual": str(path.edge.residual_dst), "compute": str(path.decl.input.rows),
                "entry": path.entry.describe(),
                "exit": " | ".join(d.label for d in path.exit.decisions)}


def supported_modes(runtime) -> list[RowMode]:
    dims = runtime.parallel.dims
    modes = [RowMode.AR]
    if dims.tp > 1 and runtime.allows_rs:
        modes.append(RowMode.RS)
    if dims.tp > 1 and dims.attn_dp > 1 and runtime.allows_rsv:
        modes.append(RowMode.RSV)
    return modes


def build_plan(name: str, declaration, norm, following, runtime, qkv_latent_func=None,
               fusions=None) -> StagePlan:
    dims = runtime.parallel.dims
    if dims.attn_cp > 1 or dims.pp > 1:
        raise UnsupportedBoundary(
            f"stage {name}: no boundary path for attn_cp={dims.attn_cp}, pp={dims.pp} yet "
            "(supported: attn_cp=1, pp=1)")
    variant = BatchVariant.ORDINARY
    prev = declaration.previous
    own_sum = SumGroup.ATTN_TP if declaration.kind is StageKind.ATTN else SumGroup.TP
    sizes = token_axis_sizes(runtime.parallel)
    local = Layout.of(TokenAxis.ATTN_DP, sizes=sizes)
    paths = {}
    for mode in supported_modes(runtime):
        exit_path = make_output_boundary(declaration, following, runtime, mode, fusions=fusions,
                                         name=name)
        entry = make_boundary(name, declaration, norm, runtime, mode,
                              qkv_latent_func=qkv_latent_func, fusions=fusions)
        residual = local if mode is RowMode.AR else Layout.of(
            TokenAxis.ATTN_DP, TokenAxis.ATTN_TP_SCATTER, sizes=sizes)
        compute = local if declaration.kind is StageKind.ATTN else REPLICATED
        producer = None if prev is None else StageOutput(
            local if prev.kind is StageKind.ATTN else REPLICATED, prev.reduction,
            SumGroup.ATTN_TP if prev.kind is StageKind.ATTN else SumGroup.TP)
        stage_input = StageInput(compute, static_owed(runtime, declaration))
        stage_output = StageOutput(
            compute, declaration.reduction, own_sum,
            leaves_for_all_reduce=any(d.flags.fuse_mlp_allreduce for d in exit_path.decisions),
            leaves_for_reduce_scatter=any(d.flags.mlp_reduce_scatter for d in exit_path.decisions))
        paths[(variant, mode)] = StagePath(
            StageDecl(variant, stage_input, stage_output),
            EdgeDecl(producer, stage_input, residual, residual), entry, exit_path)
    return StagePlan(name, declaration, paths, runtime)
