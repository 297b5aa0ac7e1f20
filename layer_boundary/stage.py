"""The model-facing ``StageBoundary``: prepare a stage's input, publish its output, capture.

Its methods check the call, select the stage's bound step for this forward (``step.py``) and
delegate to it: the step enters (complete, update, read, move), decides and scopes compute,
and publishes. Nothing here moves rows or makes a contribution itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .construction import build_plan
from .contracts import BatchVariant, ProducerReduction, StageKind
from .exit import AttnExit, FfnExit, MixerExit
from .residual import is_plain, is_portable
from .residual import batch as residual_batch
from .residual.add_norm import Fp32Norm
from .residual.stream import COMPUTING, NOT_OURS, START_FIRST, OwedOutput, Turn, stream_of
from .runtime.args import get_runtime
from .runtime.context import NO_ADAPTERS, close_scope, open_scope
from .runtime.ledger import HOOK, active_observer
from .step import Sites, StageStep

if TYPE_CHECKING:
    from .runtime.forward_batch import ForwardBatch

BRANCH_ENTRY = "a prepared branch must enter through branch_input, not prepare"

__all__ = ["StageBoundary", "OwedOutput", "START_FIRST", "BRANCH_ENTRY", "boundary_guard_filter",
           "stage_boundaries"]


class _Unbound:
    """The plan of a stage its layer stack has not bound yet: any use names the stage."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr):
        raise RuntimeError(f"stage {self.name} is not bound yet: it binds when its consumer is "
                           "known (the next stage appended to its layer stack, or the stack's "
                           "end)")


class StageBoundary:
    """One stage's boundary: its own norm, its prebuilt plan and steps, no forward tensors."""

    def __init__(self, declaration, norm, *, following=None, runtime=None, name=None,
                 fusions=None, qkv_latent_func=None, branch_source=None,
                 bind: bool = True) -> None:
        """Args:
            declaration: what the stage's compute does (``declare_attn``/``declare_ffn``),
                with its ``previous``, ``prepared_from`` and ``terminal``.
            norm: the stage's own input norm (one without ``normalize_fp32`` normalises the
                rounded fp32 sum).
            following: the declaration of the stage after this one (None: unknown, so the
                exit completes its own sums).
            runtime: the ``BoundaryRuntime`` (default: the engine's, ``get_runtime()``).
            name: how plans and the ledger name the stage.
            fusions: a fusion provider.
            qkv_latent_func: an attention's latent hook, run before its input gather.
            branch_source: the declaration the stage's branch is prepared from.
            bind: build the plan now; a layer stack passes False for a stage whose consumer
                is not known yet, and binds it with ``bind()`` once it is.
        """
        self.runtime = runtime if runtime is not None else get_runtime()
        self.stack = None  # the layer stack that holds it, and its place there (``order``)
        self.order = 0
        self.branch = None  # the entry stage of the branch prepared from this stage
        self.name = name or declaration.kind.value
        self.sites = Sites.of(self.name)
        self.norm = norm if hasattr(norm, "normalize_fp32") else Fp32Norm(norm)
        self.fusions = fusions
        self.qkv_latent_func = qkv_latent_func
        # the declaration this stage's branch is prepared from (every stage of the branch)
        self.branch_source = branch_source or declaration.prepared_from
        self.declaration, self.following, self.plan = declaration, following, _Unbound(self.name)
        # the bound steps by the (variant, mode) key a forward's placement selects, and the
        # ones prepare() may take (none for a branch's entry: it enters through branch_input)
        self._steps: dict = {}
        self._entry_steps: dict = {}
        self._is_partial = declaration.reduction is ProducerReduction.PARTIAL
        self.is_attention = declaration.kind is StageKind.ATTN  # an attention (or mixer) stage
        self._branch_entry = declaration.prepared_from is not None
        self._exit_cls = (FfnExit if declaration.kind is StageKind.FFN
                          else AttnExit if self._is_partial else MixerExit)
        if bind:
            self.bind(declaration, following)

    def bind(self, declaration, following) -> None:
        """Build the plan and its steps once both neighbours are known: ``declaration`` with
        its final ``previous`` and ``terminal``, ``following`` the consumer's declaration (or
        None)."""
        self.declaration, self.following = declaration, following
        self.plan = build_plan(self.name, declaration, self.norm, following, self.runtime,
                               qkv_latent_func=self.qkv_latent_func, fusions=self.fusions)
        self._steps = {key: StageStep(self, path) for key, path in self.plan.by_key.items()}
        self._entry_steps = {} if self._branch_entry else self._steps

    @property
    def bound(self) -> bool:
        """Whether its plan is built (its layer stack knows its consumer)."""
        return not isinstance(self.plan, _Unbound)

    def __repr__(self) -> str:
        return f"StageBoundary({self.name}: {self.declaration.describe()})"

    # -- selecting the turn

    def turn(self, hidden_states, forward_batch: ForwardBatch):
        """(stream, step, row facts) of this stage's entry, after the checks every entry
        makes. This batch's own stream handed exactly the object the last call returned,
        nothing in flight, rows placed for these counts by this stage's runtime: identity
        checks pass it; anything else is checked in full and refused by name."""
        state = forward_batch.boundary
        if state is not None:
            stream, step = state.stream, self._entry_steps.get(state.path_key)
            if (step is not None and stream is not None and hidden_states is stream.handle
                    and hidden_states is not None and stream.pending is None
                    and state.runtime is self.runtime and stream.owner is not None
                    and stream.owner() is forward_batch
                    and state.facts.counts == forward_batch.dp_token_counts):
                return stream, step, state.facts
        return self._checked_turn(hidden_states, forward_batch)

    def _checked_turn(self, hidden_states, forward_batch):
        if self._branch_entry:
            raise RuntimeError(BRANCH_ENTRY)
        stream = stream_of(forward_batch)  # waits for collectives still in flight
        step, facts = self._select(forward_batch)
        if stream.handle is None:  # an initial stream: only the stack's input enters it
            if not step.entry.stack_entry:
                raise RuntimeError(f"stage {self.name} has a previous producer but the stream "
                                   "holds no residual; pipeline receivers enter through "
                                   "from_pp()")
            if isinstance(hidden_states, OwedOutput):
                raise RuntimeError(NOT_OURS)
            residual_batch.check_local_tensor(hidden_states, forward_batch,
                                              f"the input of stage {self.name}")
        else:
            stream.check(hidden_states)
            if stream.contribution is not None:  # what arrived, refused before any work
                step.entry.arrival(stream.contribution)
        return stream, step, facts

    def _select(self, forward_batch):
        """This forward's step (its rows placed by the first boundary) and row facts."""
        _, facts = self.plan.select(forward_batch)
        return self._steps[forward_batch.boundary.path_key], facts

    def _turn_taken(self, forward_batch, call: str):
        """(stream, step, facts) for a call after this stage's prepare() (or, for a
        branch's entry, branch_input)."""
        stream = stream_of(forward_batch)
        if stream.handle is not Turn.PREPARED or stream.stage is not self:
            raise RuntimeError(f"{call} on stage {self.name} without its prepare()")
        step = stream.step
        if step is None:  # a branch's entry: branch_input prepared it
            step, facts = self._select(forward_batch)
            stream.bind_step(step)
            return stream, step, facts
        return stream, step, forward_batch.boundary.facts

    # -- the calls

    def prepare(self, hidden_states, forward_batch: ForwardBatch, *, capture_output=None,
                captured_last_layer_outputs=None, post_residual_addition=None):
        """Complete what the previous producer owes, apply its update, read this stage's input.

        Args:
            hidden_states: what the last boundary call returned (at stack entry: the
                embedding, on this DP rank's local rows).
            forward_batch: the forward.
            capture_output: attention only; ``capture(value, owned=...)`` receives the
                updated residual on local rows, after an unfused completion of the owed
                communication (at stack entry: the input, before enter; with
                ``post_residual_addition``: output plus residual before the addition).
            captured_last_layer_outputs: attention only; receives the updated residual on
                the attention's compute-input rows (a collector or a list).
            post_residual_addition: attention only; a [T, D] tensor on local rows added to
                the residual with the producer's output (plain updates only).

        Returns the compute input, in the read's format, on the rows compute consumes.
        """
        if (capture_output is not None or captured_last_layer_outputs is not None
                or post_residual_addition is not None):
            from .capture import prepare_capturing  # the capture module builds on this one

            return prepare_capturing(self, hidden_states, forward_batch, capture_output,
                                     captured_last_layer_outputs, post_residual_addition)
        stream, step, facts = self.turn(hidden_states, forward_batch)
        observer = active_observer() if HOOK.observer is not None else None
        if observer is not None:
            observer.enter(self.sites.prepare)
        x = step.entry.enter(stream, hidden_states, facts, forward_batch)
        stream.begin(self, step, x)
        if observer is not None:
            observer.boundary(self.sites.prepare, stream, facts)
            observer.enter(self.sites.compute)
        return x

    def finish(self, hidden_states, forward_batch: ForwardBatch):
        """Publish a PARTIAL attention's contribution.

        Args:
            hidden_states: compute's output tensor (a partial over attention TP).
            forward_batch: the forward.

        Returns the handle to pass to the next boundary (an ``OwedOutput`` while the sum is
        owed).
        """
        if not self._is_partial:
            raise RuntimeError(f"stage {self.name} is {self.declaration.reduction.value}: "
                               "publish its output through exit(), not finish()")
        stream, step, facts = self._turn_taken(forward_batch, "finish()")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError("finish() takes the compute output tensor, got "
                            f"{type(hidden_states).__name__}")
        decision = step.exit.default
        if decision.flags.sequence_parallel is not None:
            raise RuntimeError(
                f"stage {self.name} computes on scattered rows in a "
                f"{forward_batch.variant.value} batch: run its compute inside exit(), whose "
                "scope lets its linears gather and reduce-scatter, and publish with the "
                "exit's finish()")
        return step.publish(stream, hidden_states, decision, facts, forward_batch)

    def exit(self, forward_batch: ForwardBatch):
        """The scope of a stage's compute: it publishes the exit's flags while open; call the
        returned object's ``finish(output)`` once, after the scope. A PARTIAL attention may
        publish with ``finish()`` alone, except where its compute runs on scattered rows (a
        sequence-parallel batch): its linears then need this scope.

        Args:
            forward_batch: the forward (after this stage's ``prepare()``).
        """
        stream, step, facts = self._turn_taken(forward_batch, "exit()")
        return self._exit_cls(stream, step, forward_batch, facts,
                              self._adapter_rows(forward_batch))

    def run(self, hidden_states, forward_batch: ForwardBatch, compute, *leading):
        """The stage whole: ``prepare()`` its input, run ``compute(*leading, input,
        forward_batch)`` inside its exit scope, and publish the output, in one call. What
        ``x = stage.prepare(h, fb)``, ``with stage.exit(fb) as output: y = compute(*leading,
        x, fb)`` and ``output.finish(y)`` do; compute reads the scope's flags through
        ``get_forward()`` (it is handed no exit object).

        Args:
            hidden_states: what the last boundary call returned (as ``prepare()``).
            forward_batch: the forward.
            compute: the stage's compute, called as ``compute(*leading, input,
                forward_batch)``; it returns the stage's output (a ``HandoffOutput`` only
                where the exit publishes ``defer_moe_finalize``).
            leading: its arguments before the input (an attention's positions).

        Returns what the model passes on, as ``finish()`` does.
        """
        stream, step, facts = self.turn(hidden_states, forward_batch)
        scope = step.scope
        if scope is None or HOOK.observer is not None or not forward_batch.boundary.plain:
            # the exit object's way: a per-batch choice, scattered rows, adapters, overlap,
            # or an observer to tell
            x = self.prepare(hidden_states, forward_batch)
            with self.exit(forward_batch) as output:
                out = compute(*leading, x, forward_batch)
            return output.finish(out)
        x = step.entry.enter(stream, hidden_states, facts, forward_batch)
        stream.begin(self, step, x)
        # the step's prebuilt scope: no exit object, the same two calls
        previous = open_scope(scope)
        stream.hold(COMPUTING)
        try:
            out = compute(*leading, x, forward_batch)
        finally:
            close_scope(previous)
        return step.publish(stream, out, step.fixed, facts, forward_batch)

    def _adapter_rows(self, forward_batch: ForwardBatch):
        """Each compute row's LoRA adapter slot, for the adapted linears inside the scope
        (the table's movement of the batch's per-token slots: a gather over attention DP,
        kept for the forward's other stages on the same rows)."""
        if forward_batch.lora_ids is None:
            return NO_ADAPTERS
        if forward_batch.variant is BatchVariant.SEQUENCE_PARALLEL:
            raise RuntimeError(f"stage {self.name}: LoRA adapters do not run in a "
                               "sequence-parallel batch yet (its linears gather their rows "
                               "themselves)")
        return self.to_compute_rows(forward_batch.lora_ids, forward_batch)

    def postprocess(self, hidden_states, forward_batch: ForwardBatch):
        """The operation-scheduled FFN's output: compute ran without an exit() scope, so no
        flag was published and its output is complete. Moves it to the layer's handoff rows
        (under attention DP, this DP rank's slice of the global rows) and leaves nothing owed.

        Args:
            hidden_states: the complete output, on the stage's output rows.
            forward_batch: the forward.

        Returns what the model passes on.
        """
        if self.is_attention:
            raise RuntimeError(f"postprocess() is for FFN stages; stage {self.name} publishes "
                               "with finish() or exit()")
        if self.declaration.parallel:
            raise RuntimeError(f"stage {self.name} is a parallel block's FFN: its sum also "
                               "completes the attention's partial, so it publishes through "
                               "exit(), not postprocess()")
        stream, step, facts = self._turn_taken(forward_batch, "postprocess()")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError("postprocess() takes the complete compute output tensor, got "
                            f"{type(hidden_states).__name__}")
        output = step.path.decl.output
        if hidden_states.shape[0] != facts.count(output.rows):
            raise ValueError(f"postprocess() on stage {self.name} takes its complete output on "
                             f"{output.rows} rows ({facts.count(output.rows)} here), got "
                             f"{hidden_states.shape[0]}")
        return step.publish(stream, hidden_states, step.exit.completed, facts, forward_batch)

    def capture_output(self, hidden_states, forward_batch: ForwardBatch):
        """Complete the exit-decided work on the main contribution (a deferred sum, a
        reduce-scatter, a finalize), but snapshot a statically declared sum (a PARTIAL
        attention's) on a copy and leave it owed.

        Args:
            hidden_states: what the last boundary call returned.
            forward_batch: the forward.

        Returns (handle to pass on, the updated residual on local rows, owned).
        """
        stream = stream_of(forward_batch)
        stream.check(hidden_states)
        c = stream.contribution
        if c is not None and not is_plain(c.update):
            # refused before the completion below runs a collective and takes the handle
            raise RuntimeError(residual_batch.SNAPSHOT_NOT_PLAIN)
        if c is not None and not c.declared:
            hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
        return hidden_states, residual_batch.snapshot(hidden_states, forward_batch)

    def to_compute_rows(self, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Per-token facts onto the rows this stage computes on, in its input's order: the
        table's movement for a complete value (a gather over attention DP, or nothing).

        Args:
            x: one row per token of this DP rank (token ids, a mask), on its local rows.
            forward_batch: the forward; what was moved from ``x`` is kept for its other
                stages.
        """
        residual_batch.check_local_tensor(x, forward_batch, "to_compute_rows()'s tensor")
        step, facts = self._select(forward_batch)
        move = step.entry.enter_input
        if not move.moves:
            return x
        # stages computing on the same rows share one movement: what it moved from ``x`` in
        # this forward is kept, so the next stage asking reuses it (no second gather)
        moved = forward_batch.boundary.moved
        kept = moved.get(move)
        if kept is None or kept[0] is not x:
            kept = moved[move] = (x, move.move(facts, x))
        return kept[1]

    def from_pp(self, tensors: dict, forward_batch: ForwardBatch):
        """A pipeline receiver's first stage: rebuild the stream from what the previous
        stage's ``to_pp()`` sent, from this stage's own declaration (its ``previous`` says
        whether a declared partial sum arrives, and on which rows).

        Args:
            tensors: ``{"residual"}`` or ``{"residual", "partial"}`` as received.
            forward_batch: the forward, started (``residual_batch.start``) and not yet
                entered.

        Returns the handle to pass to ``prepare()``.
        """
        stream = stream_of(forward_batch)
        if stream.handle is not None or stream.residual is not None:
            raise RuntimeError(f"from_pp() rebuilds the stream at stage {self.name}, the first "
                               "stage of this pipeline rank; this stream is already in use")
        if self.declaration.previous is None:
            raise RuntimeError(f"stage {self.name} enters the stack (previous=None): it takes "
                               "the stack's input through prepare(), not from_pp()")
        step, facts = self._select(forward_batch)
        entry = step.entry
        update = self.declaration.previous.residual.update
        if entry.declared is not None and not is_portable(update):
            raise RuntimeError(
                f"stage {self.name}: its producer's residual update {update!r} does not declare "
                "itself portable, so its declared partial sum cannot cross a pipeline cut (this "
                "stage would apply its own copy of the update); cut where the producer "
                "completes its output")
        expected = {"residual"} | ({"partial"} if entry.declared is not None else set())
        if set(tensors) != expected:
            raise RuntimeError(f"stage {self.name} expects {sorted(expected)} from the previous "
                               f"pipeline stage, got {sorted(tensors)}")
        layouts = [("residual", entry.residual_src)]
        if entry.declared is not None:
            layouts.append(("partial", entry.declared.rows))
        for name, layout in layouts:
            if tensors[name].shape[0] != facts.count(layout):
                raise RuntimeError(
                    f"stage {self.name}: the {name} from the previous pipeline stage has "
                    f"{tensors[name].shape[0]} rows; this rank holds {facts.count(layout)} on "
                    f"{layout} in this batch")
        handle = stream.rebuild(tensors["residual"], entry.residual_src, update)
        if entry.declared is None:
            return handle  # opaque: the residual is on the stream's rows
        return stream.leave(tensors["partial"], entry.declared.owed, update,
                            entry.declared.rows, declared=True)

    def describe(self, mode=None) -> dict:
        """This stage's paths in row mode ``mode`` (default: all-reduce) as a table row."""
        return self.plan.describe() if mode is None else self.plan.describe(mode)


def stage_boundaries(module) -> list[StageBoundary]:
    """Every stage boundary a model (or one layer) holds, in the order they were built: each
    layer stack's stages in stack order (the stacks in the order their stages are found),
    then stages built outside any stack, as found."""
    found = {id(v): v for m in module.modules() for v in vars(m).values()
             if isinstance(v, StageBoundary)}
    stacks: dict[int, int] = {}
    for b in found.values():
        stacks.setdefault(id(b.stack), len(stacks))
    return sorted(found.values(), key=lambda b: (b.stack is None, stacks[id(b.stack)], b.order))


def boundary_guard_filter(model):
    """A ``torch.compile`` ``guard_filter_fn`` that drops the guards on a model's stage
    boundaries (``options={"guard_filter_fn": boundary_guard_filter(model)}``).

    A boundary's plan is built at construction and never changes afterwards, so re-checking it
    on every call (hundreds of guards in a few layers) only costs time. Guards on the batch,
    on the model's own modules and on tensors stay, but for the model's own parameters and
    buffers where the trace reached them through a plan (a fused norm's weight, which the
    plan's step holds): those are the model's, fixed with the plan, and the walk down the
    plan to each one cost about as much as every guard on the modules' own tensors (45 us
    against 33 for a hand-written forward's whole check, hidden 64, 8 layers). Such a tensor
    stays an input of the graph, read where the plan holds it, and an inductor graph checks
    each input's size and strides itself. The check that a plan holds the placement a
    static-shape trace kept (``StagePlan.place``) stays too: that graph reads it, so it is
    that model's graph, never another instance's of the same class.
    """
    import re

    attrs = sorted({name for module in model.modules() for name, value in vars(module).items()
                    if isinstance(value, StageBoundary)})
    through = (re.compile(r"\.(" + "|".join(map(re.escape, attrs)) + r")(\.|\[|$)")
               if attrs else None)
    # the kept placement's token count: another instance's plan has no such entry, so its
    # forward fails this guard and traces its own graph
    kept = re.compile(r"\._traced\[[^\]]*\]\[1\]$")

    def keep_one(e, owned) -> bool:
        if not through.search(e.name):
            return True
        if e.guard_type == "TENSOR_MATCH":
            return not (e.has_value and id(e.value) in owned)
        return e.guard_type == "EQUALS_MATCH" and bool(kept.search(e.name))

    def keep(entries):
        if through is None:
            return [True] * len(entries)
        # the model's tensors now (both they and the guarded values are alive: ids are theirs)
        owned = {id(t) for t in (*model.parameters(), *model.buffers())}
        return [keep_one(e, owned) for e in entries]

    return keep
