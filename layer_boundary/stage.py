"""The model-facing ``StageBoundary``: prepare a stage's input, publish its output, capture."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .construction import build_plan
from .contracts import BatchVariant, ProducerReduction, StageKind
from .exit import COMPUTED, NEW, AttnExit, FfnExit, MixerExit, check_output_dtype, publish
from .lane import Lane
from .residual import LayerResidual, is_plain, is_portable
from .residual import batch as residual_batch
from .residual.access import complete_onto
from .residual.add_norm import ACCUMULATE, FP32, PLAIN_ADD, accumulate_dtype
from .residual.stream import (COMPUTING, IN_COMPUTE, NOT_OURS, START_FIRST, Contribution,
                               OwedOutput, stream_of)
from .runtime.args import get_runtime
from .runtime.context import FORWARD_STATE, NO_ADAPTERS
from .runtime.ledger import HOOK, active_observer

if TYPE_CHECKING:
    from .runtime.forward_batch import ForwardBatch

_new = object.__new__

BRANCH_ENTRY = "a prepared branch must enter through branch_input, not prepare"
NOT_PLAIN_ADDITION = "post_residual_addition requires a plain residual update"


class _Fp32Norm:
    """Adapter for a norm without an fp32 entry point: rounds the fp32 sum, then normalises."""

    def __init__(self, norm) -> None:
        self.norm = norm

    def __call__(self, x):
        return self.norm(x)

    def normalize_fp32(self, x32, out_dtype):
        return self.norm(x32.to(out_dtype))


def _keep(collector, value, owned: bool) -> None:
    """Hand ``value`` to a collector: one with ``capture(value, owned=...)``, or a list (which
    keeps a copy of borrowed storage)."""
    capture = getattr(collector, "capture", None)
    if capture is not None:
        capture(value, owned=owned)
    else:
        collector.append(value if owned else value.clone())


class _Unbound:
    """The plan of a stage its layer stack has not bound yet: any use names the stage."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr):
        raise RuntimeError(f"stage {self.name} is not bound yet: it binds when its consumer is "
                           "known (the next stage appended to its layer stack, or the stack's "
                           "end)")


def _visible(read, residual):
    """The residual as a model sees it: a read may hold more beside it (mHC's coefficients)."""
    view = getattr(read, "visible", None)
    return residual if view is None else view(residual)


def _plain_input(stream, lane, hidden_states, rows):
    """The compute input of a plain ``prepare()`` (its checks passed): a plain add of an
    output owing at most its sum onto a residual on the update rows, then the add+norm read
    (what a read declaring kind "add_norm" computes), written out, as every stage of an
    ordinary forward after the first takes it; anything else through the entry's ``run``.
    The fp32 sum feeds the norm; the residual keeps it rounded."""
    c = stream.contribution
    complete = None if c is None else lane.arrivals.get(c.key)
    # the update rows imply a written residual
    if (complete is None or c.update is not PLAIN_ADD
            or stream.residual_rows is not lane.update_rows):
        return lane.path.entry.run(stream, hidden_states, rows)
    value = complete.run(rows, c.value) if complete.moves else c.value
    residual = stream.residual
    dtype = residual.dtype
    if dtype is FP32:  # the output has the residual's dtype: nothing to widen
        total = residual + value
    else:
        acc = ACCUMULATE.get(dtype) or accumulate_dtype(dtype)
        total = residual.to(dtype=acc) + value.to(dtype=acc)
    compute_input = lane.norm.normalize_fp32(total, dtype)
    stream.residual, stream.made_by = total.to(dtype=dtype), PLAIN_ADD
    stream.contribution, stream.handle = None, IN_COMPUTE
    move = lane.moving_input
    return compute_input if move is None else move.run(rows, compute_input)


class StageBoundary:
    """One stage's boundary: its own norm, its prebuilt plan, no forward tensors."""

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
        self.norm = norm if hasattr(norm, "normalize_fp32") else _Fp32Norm(norm)
        self.fusions = fusions
        self.qkv_latent_func = qkv_latent_func
        # the declaration this stage's branch is prepared from (every stage of the branch)
        self.branch_source = branch_source or declaration.prepared_from
        self.declaration, self.following, self.plan = declaration, following, _Unbound(self.name)
        # the plan's lanes by (variant, mode) key, once bound (none for a branch's entry,
        # which enters through branch_input)
        self._lanes = {}
        self._update = declaration.residual.update
        self._prepare_site = f"{self.name}.prepare"
        self._compute_site = f"{self.name}.compute"
        self._finish_site = f"{self.name}.finish"
        self._is_partial = declaration.reduction is ProducerReduction.PARTIAL
        self._is_attn = declaration.kind is StageKind.ATTN
        self._branch_entry = declaration.prepared_from is not None
        self._exit_cls = (FfnExit if declaration.kind is StageKind.FFN
                          else AttnExit if self._is_partial else MixerExit)
        # an OutputTransform declared before the sum runs on compute's output as published
        # (after the sum it travels in the declaration's update instead)
        self._transform = declaration.transform_first
        if bind:
            self.bind(declaration, following)

    def bind(self, declaration, following) -> None:
        """Build the plan once both neighbours are known: ``declaration`` with its final
        ``previous`` and ``terminal``, ``following`` the consumer's declaration (or None)."""
        self.declaration, self.following = declaration, following
        self.plan = build_plan(self.name, declaration, self.norm, following, self.runtime,
                               qkv_latent_func=self.qkv_latent_func, fusions=self.fusions)
        self._lanes = {} if self._branch_entry else {
            key: Lane(self, path) for key, path in self.plan.by_key.items()}

    @property
    def bound(self) -> bool:
        """Whether its plan is built (its layer stack knows its consumer)."""
        return not isinstance(self.plan, _Unbound)

    def __repr__(self) -> str:
        return f"StageBoundary({self.name}: {self.declaration.describe()})"

    def to_compute_rows(self, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Per-token facts onto the rows this stage computes on, in its input's order: the
        table's movement for a complete value (a gather over attention DP, or nothing).

        Args:
            x: one row per token of this DP rank (token ids, a mask), on its local rows.
            forward_batch: the forward; what was moved from ``x`` is kept for its other
                stages.
        """
        residual_batch.check_local_tensor(x, forward_batch, "to_compute_rows()'s tensor")
        path, rows = self.plan.select(forward_batch)
        move = path.entry.enter_input
        if not move.moves:
            return x
        # stages computing on the same rows share one movement: what it moved from ``x`` in
        # this forward is kept, so the next stage asking reuses it (no second gather)
        moved = forward_batch.boundary.moved
        kept = moved.get(move)
        if kept is None or kept[0] is not x:
            kept = moved[move] = (x, move.run(rows, x))
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
        path, rows = self.plan.select(forward_batch)
        entry = path.entry
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
            if tensors[name].shape[0] != rows.count(layout):
                raise RuntimeError(
                    f"stage {self.name}: the {name} from the previous pipeline stage has "
                    f"{tensors[name].shape[0]} rows; this rank holds {rows.count(layout)} on "
                    f"{layout} in this batch")
        stream.residual, stream.residual_rows = tensors["residual"], entry.residual_src
        stream.made_by = update
        if entry.declared is None:
            stream.handle = OwedOutput(stream)  # opaque: the residual is on the stream's rows
            return stream.handle
        return stream.leave(tensors["partial"], entry.declared.owed, update,
                            entry.declared.rows, declared=True)

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
        state = forward_batch.boundary
        if (state is not None and capture_output is None and captured_last_layer_outputs is None
                and post_residual_addition is None):
            # the plain call inside the stack (every stage of a decode step): a producer's
            # output arrives on this batch's own stream with nothing in flight, and no
            # observer watches; anything else takes the full path below (``stream_of``'s
            # checks name what is wrong). ``plan.select`` written out: the path of the key
            # this forward's facts were placed for, by this stage's runtime (a branch's
            # entry has no fast paths: it enters through branch_input)
            stream, lane = state.stream, self._lanes.get(state.path_key)
            if (lane is not None and stream is not None and hidden_states is stream.handle
                    and stream.pending is None and HOOK.observer is None
                    and state.runtime is lane.runtime and stream.owner is not None
                    and stream.owner() is forward_batch
                    and state.facts.counts == forward_batch.dp_token_counts):
                rows = state.facts
                compute_input = _plain_input(stream, lane, hidden_states, rows)
                stream.prepared = (self, compute_input, lane, rows)
                return compute_input
        if self._branch_entry:
            raise RuntimeError(BRANCH_ENTRY)
        if not self._is_attn and (capture_output is not None or post_residual_addition is not None
                                  or captured_last_layer_outputs is not None):
            for name, value in (("capture_output", capture_output),
                                ("captured_last_layer_outputs", captured_last_layer_outputs),
                                ("post_residual_addition", post_residual_addition)):
                if value is not None:
                    raise TypeError(f"FFN prepare() does not accept {name}")
        stream = stream_of(forward_batch)
        path, rows = self.plan.select(forward_batch)
        observer = active_observer()
        if observer is not None:
            observer.enter(self._prepare_site)
        entry = path.entry
        extra = post_residual_addition
        if extra is not None:
            residual_batch.check_local_tensor(extra, forward_batch, "post_residual_addition")
        captured = False
        if stream.handle is None:  # an initial stream: only the stack's input enters it
            if not entry.stack_entry:
                raise RuntimeError(f"stage {self.name} has a previous producer but the stream "
                                   "holds no residual; pipeline receivers enter through "
                                   "from_pp()")
            if isinstance(hidden_states, OwedOutput):
                raise RuntimeError(NOT_OURS)
            residual_batch.check_local_tensor(hidden_states, forward_batch,
                                              f"the input of stage {self.name}")
            if capture_output is not None:
                capture_output(hidden_states, owned=False)  # the input, before enter
                captured = True
        else:
            stream.check(hidden_states)
            if extra is not None:
                residual_batch.check_extra_joins(stream, NOT_PLAIN_ADDITION)
            c = stream.contribution
            if c is not None:  # refused here, before a capture's completion runs a collective
                entry.arrival(c)
            if c is not None and (capture_output is not None or extra is not None):
                # complete the owed communication unfused; the read below still adds and norms
                c = complete_onto(stream, rows, entry.update_rows)
            if capture_output is not None and extra is not None:
                # output plus residual, before the extra addition, back on local rows
                base = entry.residual(stream, rows)
                value = base.clone() if c is None else c.update.apply(base, c.value)
                capture_output(entry.capture_move(rows, value), owned=True)
                captured = True
        compute_input = entry.run(stream, hidden_states, rows, extra=extra,
                                  fused=capture_output is None)
        if capture_output is not None and not captured:
            # the updated residual, back on the producer's (local) rows
            capture_output(_visible(entry.read, entry.capture_move(rows, stream.residual)),
                           owned=entry.capture_move.allocates)
        if captured_last_layer_outputs is not None:
            _keep(captured_last_layer_outputs,
                  _visible(entry.read, entry.input_move(rows, stream.residual)),
                  entry.input_move.allocates)
        # what a branch forking here may take, and the lane this stage's exit() takes
        stream.prepared = (self, compute_input, self._lanes.get(forward_batch.boundary.path_key),
                           rows)
        if observer is not None:
            observer.boundary(self._prepare_site, stream, rows)
            observer.enter(self._compute_site)
        return compute_input

    def finish(self, hidden_states, forward_batch: ForwardBatch):
        """Publish a PARTIAL attention's contribution.

        Args:
            hidden_states: compute's output tensor (a partial over attention TP).
            forward_batch: the forward.

        Returns the handle to pass to the next boundary (an ``OwedOutput`` while the sum is
        owed).
        """
        state = forward_batch.boundary
        stream = None if state is None else state.stream
        prepared = None if stream is None else stream.prepared
        if (prepared is not None and prepared[0] is self and stream.handle is IN_COMPUTE
                and HOOK.observer is None and type(hidden_states) is torch.Tensor
                and stream.owner is not None and stream.owner() is forward_batch
                and not forward_batch.overlap):
            # right after this stage's prepare() on this batch's stream, with nobody
            # watching: ``publish`` of a plain tensor that stays where compute left it,
            # written out (every attention of an ordinary forward comes here)
            lane, residual = prepared[2], stream.residual
            decision = None if lane is None else lane.unscoped
            if decision is not None and (residual is None
                                         or hidden_states.dtype == residual.dtype):
                owed, where, declared = decision.leaves
                stream.contribution = Contribution(hidden_states, owed, lane.update, where,
                                                   False, declared, False, decision.key)
                handle = stream.handle = hidden_states if owed is None else OwedOutput(stream)
                return handle
        if not self._is_partial:
            raise RuntimeError(f"stage {self.name} is {self.declaration.reduction.value}: "
                               "publish its output through exit(), not finish()")
        stream = stream_of(forward_batch)
        if stream.handle is not IN_COMPUTE:
            raise RuntimeError(f"finish() on stage {self.name} without its prepare()")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"finish() takes the compute output tensor, got {type(hidden_states).__name__}")
        check_output_dtype(stream, hidden_states, self.name)
        path, rows = self.plan.select(forward_batch)
        if path.exit.default.flags.sequence_parallel is not None:
            raise RuntimeError(
                f"stage {self.name} computes on scattered rows in a "
                f"{forward_batch.variant.value} batch: run its compute inside exit(), whose "
                "scope lets its linears gather and reduce-scatter, and publish with the "
                "exit's finish()")
        observer = active_observer()
        if observer is not None:
            observer.enter(self._finish_site)
        handle = publish(stream, path.exit, path.exit.default, hidden_states, self._update, rows,
                         forward_batch.overlap, transform=self._transform)
        if observer is not None:
            observer.boundary(self._finish_site, stream, rows)
        return handle

    def exit(self, forward_batch: ForwardBatch):
        """The scope of a stage's compute: it publishes the exit's flags while open; call the
        returned object's ``finish(output)`` once, after the scope. A PARTIAL attention may
        publish with ``finish()`` alone, except where its compute runs on scattered rows (a
        sequence-parallel batch): its linears then need this scope.

        Args:
            forward_batch: the forward (after this stage's ``prepare()``).
        """
        state = forward_batch.boundary
        stream = None if state is None else state.stream
        prepared = None if stream is None else stream.prepared
        if (prepared is not None and prepared[0] is self and prepared[2] is not None
                and stream.handle is IN_COMPUTE and stream.owner is not None
                and stream.owner() is forward_batch):
            # right after this stage's prepare() on this batch's stream: its checks and
            # its selection stand (nothing can be in flight while a stage computes).
            # ``StageExit.__init__`` written out
            _, _, lane, rows = prepared
            scope = _new(self._exit_cls)
            scope._stream, scope._lane, scope._forward_batch, scope._rows = (
                stream, lane, forward_batch, rows)
            scope._decision = scope._previous = None
            scope._state = NEW
            scope._adapter_rows = (NO_ADAPTERS if forward_batch.lora_ids is None
                                   else self._adapter_rows(forward_batch))
            stream.handle = scope
            return scope
        stream = stream_of(forward_batch)
        if stream.handle is not IN_COMPUTE:
            raise RuntimeError(f"exit() on stage {self.name} without its prepare()")
        path, rows = self.plan.select(forward_batch)  # a branch's entry, prepared for it
        return self._exit_cls(stream, Lane(self, path), forward_batch, rows,
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
        state = forward_batch.boundary
        stream = None if state is None else state.stream
        lane = None if stream is None else self._lanes.get(state.path_key)
        if (lane is not None and hidden_states is stream.handle and stream.pending is None
                and HOOK.observer is None and state.runtime is lane.runtime
                and stream.owner is not None and stream.owner() is forward_batch
                and state.facts.counts == forward_batch.dp_token_counts):
            # prepare()'s plain call, then ``_plain_input``'s body, written out (a frame
            # fewer per stage; keep the two alike)
            rows = state.facts
            c = stream.contribution
            complete = None if c is None else lane.arrivals.get(c.key)
            if (complete is None or c.update is not PLAIN_ADD
                    or stream.residual_rows is not lane.update_rows):
                x = lane.path.entry.run(stream, hidden_states, rows)
            else:
                value = complete.run(rows, c.value) if complete.moves else c.value
                residual = stream.residual
                dtype = residual.dtype
                if dtype is FP32:
                    total = residual + value
                else:
                    acc = ACCUMULATE.get(dtype) or accumulate_dtype(dtype)
                    total = residual.to(dtype=acc) + value.to(dtype=acc)
                x = lane.norm.normalize_fp32(total, dtype)
                stream.residual, stream.made_by = total.to(dtype=dtype), PLAIN_ADD
                stream.contribution, stream.handle = None, IN_COMPUTE
                # the consumed output and the old residual must not stay alive through
                # compute (a frame's locals would hold them; the allocator reuses their memory)
                del c, value, residual, total
                if lane.moving_input is not None:
                    x = lane.moving_input.run(rows, x)
            stream.prepared = (self, x, lane, rows)
        else:  # the stack's first stage, or anything prepare() must check or take whole
            x = self.prepare(hidden_states, forward_batch)
            stream = forward_batch.boundary.stream
            _, _, lane, rows = stream.prepared
        if (lane is None or lane.scoped is None or HOOK.observer is not None
                or forward_batch.lora_ids is not None or forward_batch.overlap):
            with self.exit(forward_batch) as output:
                out = compute(*leading, x, forward_batch)
            return output.finish(out)
        # an exit whose decision needs no choice and no scattered rows, with nobody
        # watching, no adapter to run and nothing to issue early: exit() and finish()
        # written out
        scope = FORWARD_STATE
        previous, scope.scope = scope.scope, lane.scope
        scope.open_scopes += 1
        stream.handle = COMPUTING
        try:  # an FFN's compute takes no leading arguments: a call without unpacking
            out = compute(*leading, x, forward_batch) if leading else compute(x, forward_batch)
        finally:
            scope.scope = previous
            scope.open_scopes -= 1
        residual, decision = stream.residual, lane.scoped
        if type(out) is torch.Tensor and (residual is None or out.dtype == residual.dtype):
            owed, where, declared = decision.leaves
            c = stream.contribution = _new(Contribution)  # ``Contribution()`` without a frame
            (c.value, c.owed, c.update, c.rows, c.handoff, c.declared, c.completed_declared,
             c.key) = out, owed, lane.update, where, False, declared, False, decision.key
            handle = stream.handle = out if owed is None else OwedOutput(stream)
            return handle
        # a handoff, or an output to refuse: as the exit's finish() takes it
        output = self._exit_cls(stream, lane, forward_batch, rows, NO_ADAPTERS)
        output._decision, output._state = decision, COMPUTED
        return output.finish(out)

    def _adapter_rows(self, forward_batch: ForwardBatch):
        """Each compute row's LoRA adapter slot, for the adapted linears inside the scope
        (the table's movement of the batch's per-token slots: a gather over attention DP,
        kept for the forward's other stages on the same rows)."""
        ids = forward_batch.lora_ids
        if ids is None:
            return NO_ADAPTERS
        if forward_batch.variant is BatchVariant.SEQUENCE_PARALLEL:
            raise RuntimeError(f"stage {self.name}: LoRA adapters do not run in a "
                               "sequence-parallel batch yet (its linears gather their rows "
                               "themselves)")
        return self.to_compute_rows(ids, forward_batch)

    def postprocess(self, hidden_states, forward_batch: ForwardBatch):
        """The operation-scheduled FFN's output: compute ran without an exit() scope, so no
        flag was published and its output is complete. Moves it to the layer's handoff rows
        (under attention DP, this DP rank's slice of the global rows) and leaves nothing owed.

        Args:
            hidden_states: the complete output, on the stage's output rows.
            forward_batch: the forward.

        Returns what the model passes on.
        """
        if self._is_attn:
            raise RuntimeError(f"postprocess() is for FFN stages; stage {self.name} publishes "
                               "with finish() or exit()")
        stream = stream_of(forward_batch)
        if (stream.handle is not IN_COMPUTE or stream.prepared is None
                or stream.prepared[0] is not self):
            raise RuntimeError(f"postprocess() on stage {self.name} without its prepare()")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError("postprocess() takes the complete compute output tensor, got "
                            f"{type(hidden_states).__name__}")
        path, rows = self.plan.select(forward_batch)
        output = path.decl.output
        if hidden_states.shape[0] != rows.count(output.rows):
            raise ValueError(f"postprocess() on stage {self.name} takes its complete output on "
                             f"{output.rows} rows ({rows.count(output.rows)} here), got "
                             f"{hidden_states.shape[0]}")
        check_output_dtype(stream, hidden_states, self.name)
        observer = active_observer()
        if observer is not None:
            observer.enter(self._finish_site)
        handle = publish(stream, path.exit, path.exit.completed, hidden_states, self._update,
                         rows, forward_batch.overlap, transform=self._transform)
        if observer is not None:
            observer.boundary(self._finish_site, stream, rows)
        return handle

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

    def describe(self, mode=None) -> dict:
        """This stage's paths in row mode ``mode`` (default: all-reduce) as a table row."""
        return self.plan.describe() if mode is None else self.plan.describe(mode)


def stage_boundaries(module) -> list["StageBoundary"]:
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
    on every call (hundreds of guards in a few layers) only costs time. Guards on tensors, on
    the batch and on the model's own modules stay.
    """
    import re

    attrs = sorted({name for module in model.modules() for name, value in vars(module).items()
                    if isinstance(value, StageBoundary)})
    through = re.compile(r"\.(" + "|".join(map(re.escape, attrs)) + r")(\.|\[|$)") if attrs else None

    def keep(entries):
        if through is None:
            return [True] * len(entries)
        return [e.guard_type == "TENSOR_MATCH" or not through.search(e.name) for e in entries]

    return keep


__all__ = ["StageBoundary", "OwedOutput", "START_FIRST", "BRANCH_ENTRY", "boundary_guard_filter",
           "stage_boundaries"]
