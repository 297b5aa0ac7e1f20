"""Model declarations, local sequence assembly, and stage factories.

The layer stack (``stack.py``) builds on these: it imports this module, never the reverse.
Factories find the stack a model is building through the construction scope kept here
(``open_stack``), which ``layer_stack`` opens.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass, field

from .construction import UnsupportedBoundary
from .contracts import ProducerReduction, StageKind
from .output import OutputTransform, TransformedUpdate
from .residual import (LayerResidual, StageRead, StageUpdate, default_layer_residual, is_plain,
                       is_portable, update_refusal)
from .runtime.arguments import flag, optional_flag
from .stage import StageBoundary, stage_boundaries

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
    # compute honours a sequence-parallel scope: it takes scattered rows, its column-parallel
    # linears all-gather their input and its row-parallel linears reduce-scatter their output
    sequence_parallel: bool = False
    # a MoE that dispatches its routed tokens itself (an expert-parallel all-to-all): it
    # computes on the residual's rows and returns its output complete there
    dispatches: bool = False
    # contribution processing before the residual update (output.OutputTransform); after the
    # sum it is also folded into ``residual.update``
    output_transform: OutputTransform | None = None
    residual: LayerResidual = field(default_factory=default_layer_residual)
    previous: StageDeclaration | None = None
    prepared_from: StageDeclaration | None = None
    terminal: bool = False
    # a parallel block's FFN (Cohere, GPT-NeoX): it reads the residual its previous stage (a
    # PARTIAL attention) read, and that attention's partial output joins this FFN's own sum
    parallel: bool = False
    # what the compute is, as plans name it (e.g. "mamba2" for a single-stage Mamba2 mixer);
    # None: its kind says it. A label only: no path depends on it, neighbours need not say it
    mixer: str | None = field(default=None, compare=False)

    @property
    def transform_first(self) -> OutputTransform | None:
        """The output transform compute's output takes at the exit, before its sum (None:
        none, or one folded into the update after the sum)."""
        t = self.output_transform
        return t if t is not None and t.before_reduce_scatter else None

    def describe(self) -> str:
        sparse = " sparse" if self.sparse else ""
        update = self.residual.update
        sp = ", sequence-parallel compute" if self.sequence_parallel else ""
        sp += ", all-to-all dispatch" if self.dispatches else ""
        kind = self.kind.value if self.mixer is None else f"{self.mixer} {self.kind.value}"
        sp += ", parallel to the attention before it" if self.parallel else ""
        text = f"{kind}{sparse} ({self.reduction.value}{sp})"
        return text if is_plain(update) else f"{text} with update {update!r}"

    def facts(self) -> dict:
        """What this stage does, as a neighbour must describe it: the facts its paths are
        chosen by. Not its sources (``previous``, ``prepared_from``, ``terminal``), not its
        read (its own input's business), and not the identity of per-layer objects (a
        post-norm transform holding its layer's weights): a neighbour's declaration is
        rebuilt where it is needed, on another pipeline rank too."""
        transform = self.output_transform
        return {"kind": self.kind, "reduction": self.reduction, "sparse": self.sparse,
                "next_sparse": self.next_sparse, "gathers_tp_input": self.gathers_tp_input,
                "sequence_parallel": self.sequence_parallel, "dispatches": self.dispatches,
                "parallel": self.parallel,
                "output_transform": None if transform is None else transform.order,
                "update": UpdateFacts.of(self.residual.update)}


@dataclass(frozen=True)
class UpdateFacts:
    """A residual update as its neighbours may rely on it: what it is (its class, and the
    class it wraps after an output transform) and the capabilities it declares."""

    kind: str
    plain: bool
    portable: bool
    at_producer: bool

    @classmethod
    def of(cls, update) -> UpdateFacts:
        kind = type(update).__name__
        if isinstance(update, TransformedUpdate):
            kind = f"{kind}({type(update.update).__name__})"
        return cls(kind, is_plain(update), is_portable(update),
                   bool(getattr(update, "at_producer", False)))

    def __repr__(self) -> str:
        said = [c for c in ("plain", "portable", "at_producer") if getattr(self, c)]
        return f"{self.kind} [{', '.join(said) or 'no capability declared'}]"


def fact_differences(declared: StageDeclaration, built: StageDeclaration) -> str:
    """The facts in which two declarations of one stage differ, each as declared vs built
    (empty: they describe the same stage)."""
    said, real = declared.facts(), built.facts()
    return "; ".join(f"{name} (declared {said[name]!r}, built {real[name]!r})"
                     for name in said if said[name] != real[name])


_OPEN: ContextVar = ContextVar("layer_boundary_open_stack", default=None)


def open_stack():
    """The layer stack the current construction scope builds into, if any."""
    return _OPEN.get()


@contextlib.contextmanager
def building_into(stack):
    """The construction scope of ``stack``: factories called inside join it."""
    token = _OPEN.set(stack)
    try:
        yield stack
    finally:
        _OPEN.reset(token)


def _layer_residual(update: StageUpdate | None, read: StageRead | None,
                    transform: OutputTransform | None = None) -> LayerResidual:
    default = default_layer_residual()
    update = update or default.update
    if transform is not None and not transform.before_reduce_scatter:
        update = TransformedUpdate(update, transform)  # applied wherever the sum completes
    return LayerResidual(update, read or default.read)


def _check_transform(transform) -> None:
    if transform is not None and not isinstance(transform, OutputTransform):
        raise TypeError(f"output_transform must be an OutputTransform, got "
                        f"{type(transform).__name__}")


def _check_arguments(who: str, reduction, update, read, previous, prepared_from,
                     flags: dict) -> None:
    """A declaration's arguments, each by name before it is stored: its options real bools
    (a string ``"yes"`` or ``"no"`` is truthy and was stored as given), its reduction a
    ``ProducerReduction``, its update and read of the residual protocols (``apply``,
    ``update_and_read``), its sources declarations."""
    for name, value in flags.items():
        (optional_flag if name in ("next_sparse", "next_layer_sparse") else flag)(
            who, name, value)
    if not isinstance(reduction, ProducerReduction):
        raise TypeError(f"{who}(reduction={reduction!r}): reduction must be a "
                        "ProducerReduction")
    if update is not None and not callable(getattr(update, "apply", None)):
        raise TypeError(f"{who}(update={update!r}): update must be a StageUpdate (with "
                        "apply(residual, contribution)) or None")
    refusal = None if update is None else update_refusal(update)
    if refusal is not None:
        raise TypeError(f"{who}(update={update!r}): {refusal}")
    if read is not None and not callable(getattr(read, "update_and_read", None)):
        raise TypeError(f"{who}(read={read!r}): read must be a StageRead or None")
    for name, value in (("previous", previous), ("prepared_from", prepared_from)):
        if value is not None and not isinstance(value, StageDeclaration):
            raise TypeError(f"{who}({name}={value!r}): {name} must be a StageDeclaration "
                            "or None")


def declare_attn(*, reduction: ProducerReduction = ProducerReduction.PARTIAL,
                 gathers_tp_input: bool = True, update: StageUpdate | None = None,
                 read: StageRead | None = None, previous: StageDeclaration | None = None,
                 prepared_from: StageDeclaration | None = None,
                 terminal: bool = False, sequence_parallel: bool = False,
                 output_transform: OutputTransform | None = None,
                 mixer: str | None = None) -> StageDeclaration:
    """An attention (or, with ``reduction=SCOPED``, a single-stage mixer) declaration.

    Args:
        reduction: PARTIAL (the default: compute always leaves its attention-TP sum) or
            SCOPED (a mixer that obeys its exit's decision).
        gathers_tp_input: the boundary gathers its input over attention TP (False: a mixer
            that consumes its own rows).
        update, read: the residual update it applies and the read of its input.
        previous, prepared_from, terminal: its sources and whether it ends the stack.
        sequence_parallel: in a sequence-parallel batch its compute runs inside ``exit()``
            on the scattered rows: its column-parallel linears (over attention TP) gather
            their input, its row-parallel output projection reduce-scatters its output.
        output_transform: processing of its contribution before the residual update
            (``OutputTransform``; its ``before_reduce_scatter`` states the order kept).
        mixer: what the compute is, as plans label the stage (e.g. ``"mamba2"``; None: an
            attention).

    Every flag must be a bool (a TypeError names the one that is not).
    """
    _check_arguments("declare_attn", reduction, update, read, previous, prepared_from,
                     {"gathers_tp_input": gathers_tp_input, "terminal": terminal,
                      "sequence_parallel": sequence_parallel})
    if mixer is not None and not isinstance(mixer, str):
        raise TypeError(f"declare_attn(mixer={mixer!r}): mixer must be a string or None")
    if reduction is ProducerReduction.LOCAL_TAIL:
        raise ValueError("LOCAL_TAIL is not supported for attention stages")
    _check_transform(output_transform)
    return StageDeclaration(StageKind.ATTN, reduction, gathers_tp_input=gathers_tp_input,
                            sequence_parallel=sequence_parallel,
                            output_transform=output_transform,
                            residual=_layer_residual(update, read, output_transform),
                            previous=previous, prepared_from=prepared_from, terminal=terminal,
                            mixer=mixer)


def declare_ffn(*, sparse: bool = False, next_sparse: bool | None = None,
                reduction: ProducerReduction = ProducerReduction.SCOPED,
                update: StageUpdate | None = None, read: StageRead | None = None,
                previous: StageDeclaration | None = None,
                prepared_from: StageDeclaration | None = None,
                terminal: bool = False,
                next_layer_sparse: bool | None = None,
                sequence_parallel: bool = False, dispatches: bool = False,
                output_transform: OutputTransform | None = None,
                parallel: bool = False) -> StageDeclaration:
    """A dense or sparse FFN declaration.

    Args:
        sparse: a MoE (its output sums over the MoE output group).
        next_sparse: whether the FFN after this one's consumer is sparse (the two-batch
            overlap handoff rows derive from the pair); ``next_layer_sparse`` is the same
            (upstream's name).
        reduction: SCOPED (obeys the exit's decision) or LOCAL_TAIL.
        update, read: the residual update it applies and the read of its input.
        previous, prepared_from, terminal: its sources and whether it ends the stack
            (``make_attn_stage``/``make_ffn_stage``; a stack or ``make_stages`` sets them).
        sequence_parallel: in a sequence-parallel batch its compute runs on the scattered
            rows: its column-parallel linears (over TP) gather their input, its row-parallel
            linear reduce-scatters its output (a dense FFN; a MoE's experts do not).
        dispatches: a MoE that reaches its experts itself, with an all-to-all over the TP
            group (``BoundaryRuntime(moe_a2a_backend="all_to_all")``): its input is the
            residual's rows (no gather before it) and its output is complete on them (no
            sum after it).
        output_transform: processing of its contribution before the residual update
            (``OutputTransform``; its ``before_reduce_scatter`` states the order kept; a
            finalize handoff from a stage with one before the sum completes through it).
        parallel: the second stage of a parallel block (Cohere's ``x + attn(ln(x)) +
            mlp(ln(x))``, GPT-NeoX's with two norms): its input is read, with its own norm,
            from the residual the attention before it read, and the attention's partial
            output joins this FFN's sum, so one collective completes both (a dense SCOPED
            FFN after a PARTIAL attention, plain updates on both).

    Every flag must be a bool (``next_sparse``/``next_layer_sparse`` also None); a
    TypeError names the one that is not.
    """
    _check_arguments("declare_ffn", reduction, update, read, previous, prepared_from,
                     {"sparse": sparse, "next_sparse": next_sparse, "terminal": terminal,
                      "next_layer_sparse": next_layer_sparse,
                      "sequence_parallel": sequence_parallel, "dispatches": dispatches,
                      "parallel": parallel})
    _check_transform(output_transform)
    if parallel and (sparse or dispatches or sequence_parallel or output_transform is not None
                     or reduction is not ProducerReduction.SCOPED):
        raise ValueError("declare_ffn: parallel=True is for a dense SCOPED FFN without "
                         "sequence_parallel, dispatch or output_transform (its output and the "
                         "attention's partial are summed together)")
    if dispatches and not sparse:
        raise ValueError("declare_ffn: dispatches=True is for a MoE (sparse=True): a dense "
                         "FFN has no routed tokens to dispatch")
    if dispatches and reduction is ProducerReduction.LOCAL_TAIL:
        raise ValueError("declare_ffn: a dispatching MoE returns its output complete, so "
                         "there is no boundary sum for a LOCAL_TAIL tail to follow; declare it "
                         "SCOPED")
    if sequence_parallel and reduction is ProducerReduction.LOCAL_TAIL:
        raise ValueError("declare_ffn: a LOCAL_TAIL FFN adds its tail after its own sum; "
                         "sequence_parallel is for SCOPED FFNs")
    if sequence_parallel and sparse:
        raise ValueError("declare_ffn: a sparse FFN's experts are not column- and "
                         "row-parallel linears; sequence_parallel is for dense FFNs")
    if next_layer_sparse is not None:
        if next_sparse is not None and next_sparse != next_layer_sparse:
            raise ValueError(f"declare_ffn: next_sparse={next_sparse} and next_layer_sparse="
                             f"{next_layer_sparse} name the same fact")
        next_sparse = next_layer_sparse
    if reduction is ProducerReduction.PARTIAL:
        raise ValueError("PARTIAL is not supported for ffn stages")
    return StageDeclaration(StageKind.FFN, reduction, sparse=sparse, next_sparse=next_sparse,
                            sequence_parallel=sequence_parallel, dispatches=dispatches,
                            output_transform=output_transform,
                            residual=_layer_residual(update, read, output_transform),
                            previous=previous, parallel=parallel,
                            prepared_from=prepared_from, terminal=terminal)


def check_items(items, who: str = "make_stages") -> list:
    """Each ``(declaration, norm[, options])`` item checked: (declaration, norm, options)."""
    if not items:
        raise ValueError(f"{who} needs at least one (declaration, norm) item")
    return [_check_item(item, i, who) for i, item in enumerate(items)]


def _check_item(item, index: int, who: str = "make_stages"):
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError(f"{who} item {index} must be (declaration, norm[, options])")
    decl, norm = item[0], item[1]
    options = dict(item[2]) if len(item) == 3 else {}
    if not isinstance(decl, StageDeclaration):
        raise TypeError(f"{who} item {index}: {decl!r} is not a StageDeclaration")
    allowed = ATTN_OPTIONS if decl.kind is StageKind.ATTN else FFN_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"{who} item {index}: {decl.kind.value} stages do not accept "
                        f"options {unknown} (allowed: {sorted(allowed)})")
    if decl.previous is not None or decl.prepared_from is not None or decl.terminal:
        raise ValueError(f"{who} item {index}: a declaration passed to {who} must not "
                         f"carry previous, prepared_from or terminal; pass them to {who}")
    return decl, norm, options


def make_stages(*items, previous: StageDeclaration | None = None,
                following: StageDeclaration | None = None, terminal: bool = False,
                prepared_from=None, runtime=None, name: str | None = None,
                stack=None) -> list:
    """Connect local stages in order; return one independent ``StageBoundary`` per item.

    The spec's assembler, kept for engines and tests that give each sequence its neighbours
    themselves; the reference models build through a layer stack instead
    (``append_stages``), which supplies them.

    Args:
        *items: ``(declaration, norm[, options])``; options are ``fusions``, and
            ``qkv_latent_func`` for an attention.
        previous: the real producer before the first stage (None only where the stack
            starts).
        following: the consumer after the last one. Without it, a non-terminal sequence is
            taken to repeat: its first stage follows its last (a decoder layer followed by
            the next layer).
        terminal: the last stage ends the model's stack.
        prepared_from: a branch's source: the ``declaration`` of a stage on the open layer
            stack, or that ``StageBoundary`` itself.
        runtime: the ``BoundaryRuntime`` (default: the layer stack's, else the engine's).
        name: prefixes the stage names plans and the ledger report ("<name>.attn").
        stack: the layer stack the stages join (default: the open one, if any); there they
            are checked against the stages built next to them.
    """
    flag("make_stages", "terminal", terminal)
    checked = check_items(items)
    check_next_sparse(previous, [decl for decl, _, _ in checked])
    stack = open_stack() if stack is None else stack
    if runtime is None and stack is not None:
        runtime = stack.runtime
    source = prepared_from if isinstance(prepared_from, StageBoundary) else None
    prepared = source.declaration if source is not None else prepared_from
    decls = []
    prev = previous
    for i, (decl, _, _) in enumerate(checked):
        decl = dataclasses.replace(decl, previous=prev,
                                   prepared_from=prepared if i == 0 else None,
                                   terminal=terminal and i == len(checked) - 1)
        decls.append(decl)
        prev = decl
    if following is None and not terminal:
        following = dataclasses.replace(checked[0][0], previous=decls[-1])
    names = stage_names(name, [d.kind for d in decls])
    stages = []
    for i, (decl, (_, norm, options)) in enumerate(zip(decls, checked)):
        nxt = decls[i + 1] if i + 1 < len(decls) else following
        stages.append(StageBoundary(decl, norm, following=nxt, runtime=runtime,
                                    name=names[i], branch_source=prepared, **options))
    if stack is not None:
        stack.adopt(stages, source=source)
    elif source is not None:
        link_branch(source, stages[0])
    # outside a stack a branch prepared from a declaration has no source stage to enter from:
    # branch_input() names that
    return stages


def link_branch(source, entry) -> None:
    """``entry`` (the first stage of a branch) reads ``source``'s prepared input."""
    if source.branch is not None:
        raise UnsupportedBoundary(
            f"stage {entry.name}: a second branch prepared from the same declaration "
            "(one branch per source)")
    source.branch = entry


def check_next_sparse(previous: StageDeclaration | None, decls: list,
                      who: str = "make_stages") -> None:
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
                f"{who}: {where} declares next_sparse={decl.next_sparse}, but the next "
                f"FFN (item {nxt[1]}) is declared sparse={nxt[0].sparse}")


def stage_names(prefix: str | None, kinds: list[StageKind]) -> list[str]:
    short = {StageKind.ATTN: "attn", StageKind.FFN: "ffn"}
    base = [short[k] for k in kinds]
    names = [b if base.count(b) == 1 else f"{b}{base[:i + 1].count(b) - 1}"
             for i, b in enumerate(base)]
    return [f"{prefix}.{n}" if prefix else n for n in names]


def _make_single(kind: StageKind, decl: StageDeclaration, norm, following, runtime, name,
                 options):
    _check_item((dataclasses.replace(decl, previous=None, prepared_from=None, terminal=False),
                 norm, options), 0)
    if decl.kind is not kind:
        raise ValueError(f"make_{'attn' if kind is StageKind.ATTN else 'ffn'}_stage got a "
                         f"{decl.kind.value} declaration")
    if following is not None and following.previous != decl:
        raise ValueError("the following declaration must name this stage in its previous field")
    # Without ``following`` the consumer is unknown: the exit completes its own sums.
    stack = open_stack()
    if runtime is None and stack is not None:
        runtime = stack.runtime
    stage = StageBoundary(decl, norm, following=following, runtime=runtime, name=name, **options)
    if stack is not None:
        stack.adopt([stage])
    return stage


def make_attn_stage(declaration: StageDeclaration, norm, *, following=None, runtime=None,
                    name: str | None = None, **options):
    """One independently built attention stage; its declaration carries its own source."""
    return _make_single(StageKind.ATTN, declaration, norm, following, runtime, name, options)


def make_ffn_stage(declaration: StageDeclaration, norm, *, following=None, runtime=None,
                   name: str | None = None, **options):
    """One independently built FFN stage; its declaration carries its own source."""
    return _make_single(StageKind.FFN, declaration, norm, following, runtime, name, options)


def install_fusion(model, provider) -> int:
    """Install ``provider`` on every stage boundary a built model's layers hold (a decoder
    layer's ``attn_boundary`` and ``ffn_boundary``, and any other: a branch's stages, a
    single-stage block's), rebuilding each bound stage's plan once: a plan's fusion choices
    are made at construction, never per forward. Every stage takes the same provider, as a
    producer and its consumer must. Call it before the first forward and before
    ``torch.compile``.

    Args:
        model: the model (any ``nn.Module``) whose layers hold the boundaries.
        provider: the fusion provider (``fusions.FusionProvider``).

    Returns how many stages took it.
    """
    missing = [m for m in ("attention_input", "ffn_input", "can_defer_finalize",
                           "can_defer_all_reduce") if not callable(getattr(provider, m, None))]
    if provider is not None and missing:  # before any stage takes it (a string half-installed)
        raise TypeError(f"install_fusion(provider={provider!r}): not a fusion provider "
                        f"(fusions.FusionProvider): it lacks {', '.join(missing)} (build one "
                        "by name with engine.fusion_providers.make_fusions)")
    stages = stage_boundaries(model)
    if not stages:
        raise ValueError(f"install_fusion found no stage boundary in {type(model).__name__} "
                         "(a decoder layer's attn_boundary / ffn_boundary)")
    for boundary in stages:
        boundary.fusions = provider
        if boundary.bound:  # an unbound stage builds its plan with it when its stack binds it
            boundary.bind(boundary.declaration, boundary.following)
    return len(stages)
