"""Pipeline stages of a model's layer stack: which layers this rank holds, which checkpoint
tensors it loads, and one forward's pass over them (whole, or a split-prefill segment).

Layers keep their global index (their names in plans and ledgers, ``terminal``, their KV-cache
layer); the stage's module list holds only its own, so checkpoint names are renumbered on
load. The stack starts on the segment that runs the stage's first layer: with the embedding on
the first stage, from the previous stage's tensors (``from_pp``) on the others; it leaves on
the segment that runs the stage's last layer: through the final norm on the last stage, as the
tensors for the next stage (``to_pp``) on the others.

Each rank's layer stack knows its neighbours across the cuts (``pipeline_stack``): the last
stage of the layer before its first, on the rank before, and the first stage of the layer
after its last, on the rank after; both come from the same declaration function the layers
append with, so the two ranks of a cut describe it alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import layer_stack, run_two_batches
from ..residual import batch as residual_batch


def split_layers(num_layers: int, pp: int, explicit: tuple[int, ...] | None = None) -> list:
    """Each stage's layers as a range of global indices: an even split with the remainder
    on the first stages, or ``explicit`` counts (``--pp-layers``)."""
    if explicit is not None:
        given = ",".join(map(str, explicit))
        if len(explicit) != pp:
            raise ValueError(f"--pp-layers {given} gives {len(explicit)} stages; pp={pp}")
        if any(n < 1 for n in explicit):
            raise ValueError(f"--pp-layers {given}: every stage needs at least one layer")
        if sum(explicit) != num_layers:
            raise ValueError(f"--pp-layers {given} holds {sum(explicit)} layers; the model has "
                             f"{num_layers}")
        sizes = list(explicit)
    else:
        if pp > num_layers:
            raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (i < extra) for i in range(pp)]
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


@dataclass(frozen=True)
class PipelineStage:
    index: int
    count: int
    layers: range  # global indices of this stage's layers
    total: int  # layers of the whole stack

    @classmethod
    def of(cls, runtime, num_layers: int) -> PipelineStage:
        par = runtime.parallel
        ranges = split_layers(num_layers, par.dims.pp, runtime.pp_layers)
        return cls(par.pp_rank, par.dims.pp, ranges[par.pp_rank], num_layers)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def locator(self, layer_prefix: str, *, first_only=(), last_only=(),
                embedding: str | None = None, head: str | None = None):
        """``locate(checkpoint name)``: the parameter name this stage loads it into, or None.
        Its layers' names are renumbered to the local module list, ``first_only`` names load
        on the first stage, ``last_only`` prefixes on the last; a tied head on a last stage
        that holds no embedding reads ``embedding`` as ``head``."""
        pattern = re.compile(re.escape(layer_prefix) + r"(\d+)\.")

        def locate(name: str) -> str | None:
            m = pattern.match(name)
            if m is not None and int(m.group(1)) < self.total:
                layer = int(m.group(1))
                if layer not in self.layers:
                    return None  # another stage's layer
                return f"{layer_prefix}{layer - self.layers.start}.{name[m.end():]}"
            if name in first_only:
                if self.first:
                    return name
                return head if name == embedding and head is not None and self.last else None
            if any(name.startswith(p) for p in last_only) and not self.last:
                return None
            if name == head and not self.first:
                return None  # tied: the head is the embedding, read above
            return name

        return locate


def pipeline_stack(stage: PipelineStage, runtime, declarations):
    """This pipeline rank's layer stack (a ``layer_stack``), opened with its real neighbours.

    Args:
        stage: this rank's place in the model.
        runtime: the ``BoundaryRuntime`` the stages are built on.
        declarations: ``declarations(index)``: layer ``index``'s main-line stage declarations
            in order, as the layer appends them (the layer class's ``declarations``).
    """
    lo, hi = stage.layers.start, stage.layers.stop
    previous = declarations(lo - 1)[-1] if lo > 0 else None
    following = declarations(hi)[0] if hi < stage.total else None
    return layer_stack(runtime, previous=previous, following=following)


def _call_layer(layer, h, fb):
    return layer(fb.positions, h, fb)


def run_stack(stage: PipelineStage, stack, layers, forward_batch, run_layer, embed, leave,
              pp_input=None, dp_rank: int = 0):
    """One forward over this stage's layers, or over ``forward_batch.layer_segment`` (global
    [start, stop)) of them. Returns ``leave(h, fb)`` on the last stage, the tensors to send on
    the others, and None after a segment that does not end the stage's layers.

    Args:
        stage: this pipeline rank's place in the model.
        stack: the ``LayerStack`` the layers were built in (its first stage receives).
        layers: this rank's layers; ``run_layer(layer, h, fb)`` runs one (None: the layer
            is called as ``layer(fb.positions, h, fb)``).
        embed, leave: the stack's input, and ``leave(h, fb)`` its final norm.
        pp_input: what the previous pipeline stage sent (not on the first).
        dp_rank: this rank's attention-DP rank (two-batch overlap splits by it).

    With ``forward_batch.tbo`` the stack runs as two interleaved microbatches (one stage,
    whole stack) and their outputs merge in request order."""
    fb = forward_batch
    lo, hi = stage.layers.start, stage.layers.stop
    if fb.tbo:
        if stage.count > 1 or fb.layer_segment is not None:
            raise ValueError("two-batch overlap runs the whole stack on one pipeline stage "
                             "(no --pp, no --split-prefill)")
        return run_two_batches(fb, embed(), dp_rank, layers, run_layer or _call_layer, leave)
    start, stop = fb.layer_segment or (lo, hi)
    if not lo <= start < stop <= hi:
        raise ValueError(f"layer segment [{start}, {stop}) is not inside this pipeline stage's "
                         f"layers [{lo}, {hi})")
    if start == lo:
        residual_batch.start(fb)  # a fresh per-forward state: nothing carried
        if stage.first:
            h = embed()
        elif pp_input is None:
            raise RuntimeError(f"pipeline stage {stage.index} receives its input from stage "
                               f"{stage.index - 1}: pass the received tensors as pp_input")
        else:
            h = stack.first.from_pp(pp_input, fb)
    else:
        state = fb.boundary
        carried = None if state is None else state.segment
        if carried is None or fb.residual_stream is None:
            raise RuntimeError(residual_batch.START_FIRST)
        state.segment = None
        if carried[0] != start:
            raise RuntimeError(f"layer segment [{start}, {stop}) does not continue the previous "
                               f"segment, which ended at layer {carried[0]}")
        h = carried[1]
    if run_layer is None:  # each layer called as layer(positions, h, fb), no wrapper
        positions = fb.positions
        for i in range(start, stop):
            h = layers[i - lo](positions, h, fb)
    else:
        for i in range(start, stop):
            h = run_layer(layers[i - lo], h, fb)
    if stop < hi:
        fb.boundary.segment = (stop, h)  # where the next segment resumes, and with what
        return None
    return leave(h, fb) if stage.last else residual_batch.to_pp(h, fb)
