"""Model declarations, local sequence assembly, and stage factories."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .contracts import ProducerReduction, StageKind
from .residual import LayerResidual, StageRead, StageUpdate, default_layer_residual, is_plain

ATTN_OPTIONS = frozenset({"qkv_latent_func", "fusions"})
FFN_OPTIONS = frozenset({"fusions"})


@dataclass(frozen=True)
class StageDeclaration:
    """What a stage's compute does, as the boundary needs to know it. Owns no norm, no plan."""

    kind: StageKind
    reduction: ProducerReduction
    sparse: bool = False
    next_sparse: bool | None = None
    gathers_tp_input: bool = True
    residual: LayerResidual = field(default_factory=default_layer_residual)
    previous: "StageDeclaration | None" = None
    prepared_from: "StageDeclaration | None" = None
    terminal: bool = False

    def describe(self) -> str:
        sparse = " sparse" if self.sparse else ""
        update = self.residual.update
        text = f"{self.kind.value}{sparse} ({self.reduction.value})"
        return text if is_plain(update) else f"{text} with update {update!r}"


def _layer_residual(update: StageUpdate | None, read: StageRead | None) -> LayerResidual:
    default = default_layer_residual()
    return LayerResidual(update or default.update, read or default.read)


def declare_attn(*, reduction: ProducerReduction = ProducerReduction.PARTIAL,
                 gathers_tp_input: bool = True, update: StageUpdate | None = None,
                 read: StageRead | None = None, previous: StageDeclaration | None = None,
                 prepared_from: StageDeclaration | None = None,
                 terminal: bool = False) -> StageDeclaration:
    """An attention (or, with ``reduction=SCOPED``, a single-stage mixer) declaration."""
    if reduction is ProducerReduction.LOCAL_TAIL:
        raise ValueError("LOCAL_TAIL is not supported for attention stages")
    return StageDeclaration(StageKind.ATTN, reduction, gathers_tp_input=gathers_tp_input,
                            residual=_layer_residual(update, read), previous=previous,
                            prepared_from=prepared_from, terminal=terminal)


def declare_ffn(*, sparse: bool = False, next_sparse: bool | None = None,
                reduction: ProducerReduction = ProducerReduction.SCOPED,
                update: StageUpdate | None = None, read: StageRead | None = None,
                previous: StageDeclaration | None = None,
                prepared_from: StageDeclaration | None = None,
                terminal: bool = False) -> StageDeclaration:
    """A dense or sparse FFN declaration."""
    if reduction is ProducerReduction.PARTIAL:
        raise ValueError("PARTIAL is not supported for ffn stages")
    return StageDeclaration(StageKind.FFN, reduction, sparse=sparse, next_sparse=next_sparse,
                            residual=_layer_residual(update, read), previous=previous,
                            prepared_from=prepared_from, terminal=terminal)


def _check_item(item, index: int):
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError(f"make_stages item {index} must be (declaration, norm[, options])")
    decl, norm = item[0], item[1]
    options = dict(item[2]) if len(item) == 3 else {}
    if not isinstance(decl, StageDeclaration):
        raise TypeError(f"make_stages item {index}: {decl!r} is not a StageDeclaration")
    allowed = ATTN_OPTIONS if decl.kind is StageKind.ATTN else FFN_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"make_stages item {index}: {decl.kind.value} stages do not accept "
                        f"options {unknown} (allowed: {sorted(allowed)})")
    if decl.previous is not None or decl.prepared_from is not None or decl.terminal:
        raise ValueError(f"make_stages item {index}: a declaration passed to make_stages must not "
                         "carry previous, prepared_from or terminal; pass them to make_stages")
    return decl, norm, options


def make_stages(*items, previous: StageDeclaration | None = None,
                following: StageDeclaration | None = None, terminal: bool = False,
                prepared_from: StageDeclaration | None = None, runtime=None,
                name: str | None = None) -> list:
    """Connect local stages in order; return one independent ``StageBoundary`` per item.

    ``previous`` is the real producer before the first stage (None only at the start of the
    stack); ``following`` the consumer after the last one. Without ``following``, a
    non-terminal sequence is taken to repeat: its first stage follows its last (a decoder
    layer followed by the next layer). ``name`` prefixes the stage names that plans and the
    communication ledger report ("<name>.attn", "<name>.ffn").
    """
    from .stage import StageBoundary

    if not items:
        raise ValueError("make_stages needs at least one (declaration, norm) item")
    checked = [_check_item(item, i) for i, item in enumerate(items)]
    _check_next_sparse(previous, [decl for decl, _, _ in checked])
    decls = []
    prev = previous
    for i, (decl, _, _) in enumerate(checked):
        decl = dataclasses.replace(decl, previous=prev,
                                   prepared_from=prepared_from if i == 0 else None,
                                   terminal=terminal and i == len(checked) - 1)
        decls.append(decl)
        prev = decl
    if following is None and not terminal:
        following = dataclasses.replace(checked[0][0], previous=decls[-1])
    names = _stage_names(name, [d.kind for d in decls])
    stages = []
    for i, (decl, (_, norm, options)) in enumerate(zip(decls, checked)):
        nxt = decls[i + 1] if i + 1 < len(decls) else following
        stages.append(StageBoundary(decl, norm, following=nxt, runtime=runtime,
                                    name=names[i], branch_source=prepared_from, **options))
    return stages


def _check_next_sparse(previous: StageDeclaration | None, decls: list) -> None:
    """A declaration's ``next_sparse`` describes the FFN after its consumer: where that FFN is
    one of these items, the two must agree (the TBO handoff rows derive from the pair)."""
    producers = [(previous, "previous")] + [(d, f"item {i}") for i, d in enumerate(decls)]
    for start, (decl, where) in enumerate(producers):
        if decl is None or decl.kind is not StageKind.FFN or decl.next_sparse is None:
            continue
        nxt = next(((d, i) for i, d in enumerate(decls) if i >= start
                    and d.kind is StageKind.FFN), None)
        if nxt is not None and nxt[0].sparse != decl.next_sparse:
            raise ValueError(
                f"make_stages: {where} declares next_sparse={decl.next_sparse}, but the next "
                f"FFN (item {nxt[1]}) is declared sparse={nxt[0].sparse}")


def _stage_names(prefix: str | None, kinds: list[StageKind]) -> list[str]:
    short = {StageKind.ATTN: "attn", StageKind.FFN: "ffn"}
    base = [short[k] for k in kinds]
    names = [b if base.count(b) == 1 else f"{b}{base[:i + 1].count(b) - 1}"
             for i, b in enumerate(base)]
    return [f"{prefix}.{n}" if prefix else n for n in names]


def _make_single(kind: StageKind, decl: StageDeclaration, norm, following, runtime, name,
                 options):
    from .stage import StageBoundary

    _check_item((dataclasses.replace(decl, previous=None, prepared_from=None, terminal=False),
                 norm, options), 0)
    if decl.kind is not kind:
        raise ValueError(f"make_{'attn' if kind is StageKind.ATTN else 'ffn'}_stage got a "
                         f"{decl.kind.value} declaration")
    if following is not None and following.previous != decl:
        raise ValueError("the following declaration must name this stage in its previous field")
    # Without ``following`` the consumer is unknown: the exit completes its own sums.
    return StageBoundary(decl, norm, following=following, runtime=runtime, name=name, **options)


def make_attn_stage(declaration: StageDeclaration, norm, *, following=None, runtime=None,
                    name: str | None = None, **options):
    """One independently built attention stage; its declaration carries its own source."""
    return _make_single(StageKind.ATTN, declaration, norm, following, runtime, name, options)


def make_ffn_stage(declaration: StageDeclaration, norm, *, following=None, runtime=None,
                   name: str | None = None, **options):
    """One independently built FFN stage; its declaration carries its own source."""
    return _make_single(StageKind.FFN, declaration, norm, following, runtime, name, options)
