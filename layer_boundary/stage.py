"""The model-facing ``StageBoundary``: prepare a stage's input, publish its output, capture."""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from .construction import UnsupportedBoundary, build_plan
from .contracts import ProducerReduction, StageKind
from .exit import FfnExit, MixerExit, check_output_dtype, publish
from .residual import LayerResidual, is_portable
from .residual import batch as residual_batch
from .residual.access import complete_onto
from .residual.stream import IN_COMPUTE, NOT_OURS, OwedOutput, START_FIRST, stream_of
from .runtime.args import get_runtime
from .runtime.ledger import active_observer

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


_ORDER = itertools.count()  # construction order, which is stack order
# per runtime, the stage built last: the producer of the next one built with a ``previous``
_LAST_BUILT: dict = {}
# a prepared branch's entry stage, by the identity of the declaration it is prepared from
_BRANCH_ENTRIES: dict = {}


def branch_entry(source) -> "StageBoundary":
    """The entry stage of the branch built with ``prepared_from=source.declaration``."""
    ref = _BRANCH_ENTRIES.get(id(source.declaration))
    entry = ref() if ref is not None else None
    if entry is None or entry.declaration.prepared_from is not source.declaration:
        raise RuntimeError(f"no branch was built with prepared_from={source.name}'s declaration")
    return entry


def _branch_entry_alive(source_decl) -> bool:
    ref = _BRANCH_ENTRIES.get(id(source_decl))
    entry = ref() if ref is not None else None
    return entry is not None and entry.declaration.prepared_from is source_decl


def _visible(read, residual):
    """The residual as a model sees it: a read may hold more beside it (mHC's coefficients)."""
    view = getattr(read, "visible", None)
    return residual if view is None else view(residual)


def _bare(decl):
    """A declaration without its neighbours, for comparing what two sides say of a stage. A
    producer's read is its own input's business: its consumer relies on its update only."""
    residual = LayerResidual(decl.residual.update, None)
    return dataclasses.replace(decl, previous=None, prepared_from=None, terminal=False,
                               residual=residual)


def _differences(declared, built) -> str:
    """The fields in which two bare declarations differ, each as declared vs built."""
    out = []
    for f in dataclasses.fields(declared):
        said, real = getattr(declared, f.name), getattr(built, f.name)
        if said != real:
            name = f.name
            if name == "residual":
                name, said, real = "update", said.update, real.update
            out.append(f"{name} (declared {said!r}, built {real!r})")
    return "; ".join(out)


def _check_neighbours(stage: "StageBoundary", runtime) -> None:
    """The stage built before this one is its producer: each must describe the other as it is.

    Stacks are built in stack order; a stage entering a stack (no ``previous``), a prepared
    branch, and the stage after a terminal one start afresh."""
    last = _LAST_BUILT.get(runtime)
    last = last() if last is not None else None
    _LAST_BUILT[runtime] = weakref.ref(stage)
    decl = stage.declaration
    if decl.previous is None or decl.prepared_from is not None or last is None:
        return
    if last.declaration.terminal or last.branch_source is not None:
        return  # after a branch, the merge (the model's) is the producer
    said, real = _bare(decl.previous), _bare(last.declaration)
    if said != real:
        raise UnsupportedBoundary(
            f"stage {stage.name} declares previous={decl.previous.describe()}, but its producer, "
            f"stage {last.name}, is {last.declaration.describe()}: they differ in "
            f"{_differences(said, real)}")
    if last.following is not None:
        said, real = _bare(last.following), _bare(decl)
        if said != real:
            raise UnsupportedBoundary(
                f"stage {last.name} declares following={last.following.describe()}, but the next "
                f"stage, {stage.name}, is {decl.describe()}: they differ in "
                f"{_differences(said, real)}")


class StageBoundary:
    """One stage's boundary: its own norm, its prebuilt plan, no forward tensors."""

    def __init__(self, declaration, norm, *, following=None, runtime=None, name=None,
                 fusions=None, qkv_latent_func=None, branch_source=None) -> None:
        runtime = runtime if runtime is not None else get_runtime()
        self.order = next(_ORDER)
        self.declaration = declaration
        # the declaration this stage's branch is prepared from (every stage of the branch)
        self.branch_source = branch_source or declaration.prepared_from
        self.following = following
        self.name = name or declaration.kind.value
        self.norm = norm if hasattr(norm, "normalize_fp32") else _Fp32Norm(norm)
        self.fusions = fusions
        self.qkv_latent_func = qkv_latent_func
        self.plan = build_plan(self.name, declaration, self.norm, following, runtime,
                               qkv_latent_func=qkv_latent_func, fusions=fusions)
        self._update = declaration.residual.update
        self._prepare_site = f"{self.name}.prepare"
        self._compute_site = f"{self.name}.compute"
        self._finish_site = f"{self.name}.finish"
        self._is_partial = declaration.reduction is ProducerReduction.PARTIAL
        self._is_attn = declaration.kind is StageKind.ATTN
        self._exit_cls = FfnExit if declaration.kind is StageKind.FFN else MixerExit
        _check_neighbours(self, runtime)
        if declaration.prepared_from is not None:
            if _branch_entry_alive(declaration.prepared_from):
                raise UnsupportedBoundary(
                    f"stage {self.name}: a second branch prepared from the same declaration "
                    "(one branch per source)")
            _BRANCH_ENTRIES[id(declaration.prepared_from)] = weakref.ref(self)

    def __repr__(self) -> str:
        return f"StageBoundary({self.name}: {self.declaration.describe()})"

    def to_compute_rows(self, x: torch.Tensor, forward_batch) -> torch.Tensor:
        """Per-token facts on this DP rank's local rows (token ids, a mask) onto the rows this
        stage computes on, in its input's order: the table's movement for a complete value
        (a gather over attention DP, or nothing)."""
        residual_batch.check_local_tensor(x, forward_batch, "to_compute_rows()'s tensor")
        path, rows = self.plan.select(forward_batch)
        move = path.entry.enter_input
        return move.run(rows, x) if move.moves else x

    def from_pp(self, tensors: dict, forward_batch):
        """A pipeline receiver's first stage: rebuild the stream from what the previous
        stage's ``to_pp()`` sent, from this stage's own declaration (its ``previous`` says
        whether a declared partial sum arrives, and on which rows). Returns the handle to
        pass to ``prepare()``."""
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

    def prepare(self, hidden_states, forward_batch, *, capture_output=None,
                captured_last_layer_outputs=None, post_residual_addition=None):
        """Complete what the previous producer owes, apply its update, read this stage's input.

        Attention only: ``capture_output(value, owned=...)`` receives the updated residual on
        local rows, after an unfused completion of the owed communication (at stack entry:
        the input, before enter; with ``post_residual_addition``: output plus residual before
        the addition). ``captured_last_layer_outputs`` receives the updated residual on the
        attention's compute-input rows. ``post_residual_addition`` (local rows) is added to
        the residual with the producer's output.
        """
        if self.declaration.prepared_from is not None:
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
        stream.prepared = (self, compute_input)  # what a branch forking here may take
        if observer is not None:
            observer.boundary(self._prepare_site, stream, rows)
            observer.enter(self._compute_site)
        return compute_input

    def finish(self, hidden_states, forward_batch):
        """Publish a PARTIAL attention's contribution; returns the handle to pass on."""
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
        observer = active_observer()
        if observer is not None:
            observer.enter(self._finish_site)
        handle = publish(stream, path.exit, path.exit.default, hidden_states, self._update, rows,
                         forward_batch.overlap)
        if observer is not None:
            observer.boundary(self._finish_site, stream, rows)
        return handle

    def exit(self, forward_batch):
        """Scope for an FFN's or mixer's compute; call the returned object's finish() once."""
        if self._is_partial:
            raise RuntimeError(f"stage {self.name} is PARTIAL: publish its output with finish()")
        stream = stream_of(forward_batch)
        if stream.handle is not IN_COMPUTE:
            raise RuntimeError(f"exit() on stage {self.name} without its prepare()")
        path, _ = self.plan.select(forward_batch)
        return self._exit_cls(stream, path.exit, forward_batch, self._update, self._compute_site,
                              self._finish_site)

    def postprocess(self, hidden_states, forward_batch):
        """The operation-scheduled FFN's output: compute ran without an exit() scope, so no
        flag was published and its output is complete, on the stage's output rows. Moves it
        to the layer's handoff rows (under attention DP, this DP rank's slice of the global
        rows) and leaves nothing owed; returns what the model passes on."""
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
                         rows, forward_batch.overlap)
        if observer is not None:
            observer.boundary(self._finish_site, stream, rows)
        return handle

    def capture_output(self, hidden_states, forward_batch):
        """(handle, snapshot): complete the exit-decided work on the main contribution (a
        deferred sum, a reduce-scatter, a finalize), but snapshot a statically declared sum
        (a PARTIAL attention's) on a copy and leave it owed. The snapshot is the updated
        residual on local rows, owned."""
        stream = stream_of(forward_batch)
        stream.check(hidden_states)
        c = stream.contribution
        if c is not None and not c.declared:
            hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
        return hidden_states, residual_batch.snapshot(hidden_states, forward_batch)

    def describe(self, mode=None) -> dict:
        """This stage's paths in row mode ``mode`` (default: all-reduce) as a table row."""
        return self.plan.describe() if mode is None else self.plan.describe(mode)




def stage_boundaries(module) -> list["StageBoundary"]:
    """Every stage boundary a model (or one layer) holds, in the order they were built."""
    found = {id(v): v for m in module.modules() for v in vars(m).values()
             if isinstance(v, StageBoundary)}
    return sorted(found.values(), key=lambda b: b.order)


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
