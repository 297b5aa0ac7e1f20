"""Producer-specific output handoffs."""

from __future__ import annotations

import torch

from .residual import apply_update, is_portable, reads_batch
from .runtime.arguments import flag


class HandoffOutput:
    """Producer-specific work (such as a deferred MoE finalize) left for the next input.

    ``complete()`` is the unfused completion path; a fusion provider may do better. Its
    result owes whatever sum the exit that published ``defer_moe_finalize`` recorded.
    """

    def complete(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class TransformedHandoff(HandoffOutput):
    """A handoff from a stage whose ``OutputTransform`` runs before the sum: the transform
    runs on the completed value, on the producer's rows and before any sum, exactly where
    it would have run on a tensor output (it is row-wise and, before a sum, linear)."""

    def __init__(self, handoff: HandoffOutput, transform) -> None:
        self.handoff, self.transform = handoff, transform

    def complete(self) -> torch.Tensor:
        return self.transform(self.handoff.complete())


class OutputTransform:
    """Processing of a stage's contribution before the residual update: ``fn(x)``, acting on
    each row by itself (a scale, a soft cap, a post-norm), so it may run on whatever rows the
    value is on.

    ``before_reduce_scatter`` states the order the implementation keeps, and only that:

    * False: ``fn`` runs on the complete contribution, after its sum, wherever the sum runs
      (the consumer's all-reduce or reduce-scatter, compute's own, a final norm, a pipeline
      receiver). The declaration's update becomes a ``TransformedUpdate``, which is not a
      plain add: no fused add+norm and no add-before-sum shortcut stands in for it.
    * True: ``fn`` runs on compute's output as the exit receives it, each rank's partial
      before the sum. That is exact only where ``fn`` is linear, which the declaring model
      asserts; it is not a permission to move other work across a reduction. A finalize handoff
      from such a stage carries the transform into its completion (``TransformedHandoff``).

    ``portable`` states that a copy of the transform built elsewhere (the declaration a
    pipeline receiver rebuilds for its producer on another rank) computes the same ``fn``: a
    stateless function (a fixed scale or soft cap) may say so. A transform that holds a
    layer's own parameters (OLMo-2's post-norm with that layer's weights) is not portable,
    and may not say it is: a declared partial sum that crosses a pipeline cut is completed by
    the receiver with its own copy of the update, which does not hold those weights.
    """

    def __init__(self, fn, *, before_reduce_scatter: bool, name: str | None = None,
                 portable: bool = False) -> None:
        """Args:
            fn: the row-wise function of the contribution.
            before_reduce_scatter: where it runs (see the class).
            name: how plans and errors name it (default: ``fn``'s name).
            portable: a copy of it on another pipeline rank applies it identically (a
                function without per-layer state; refused for one that holds parameters).
        """
        if not callable(fn):
            raise TypeError(f"OutputTransform needs a callable, got {type(fn).__name__}")
        # a truthy string ("no") would move a non-linear fn before the sum
        self.fn = fn
        self.before_reduce_scatter = flag("OutputTransform", "before_reduce_scatter",
                                          before_reduce_scatter)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        if flag("OutputTransform", "portable", portable) and holds_parameters(fn):
            raise ValueError(f"OutputTransform {self.name}: portable=True, but it holds "
                             "parameters (a layer's own weights): a copy on another pipeline "
                             "rank would not hold them; leave portable False")
        self.portable = portable

    @property
    def order(self) -> str:
        """Where it runs, as neighbours compare it: before or after the sum."""
        return "before the sum" if self.before_reduce_scatter else "after the sum"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def __repr__(self) -> str:
        order = "before" if self.before_reduce_scatter else "after"
        return f"OutputTransform({self.name}, {order} the sum)"


def holds_parameters(fn) -> bool:
    """Whether ``fn`` is a module with parameters or buffers, or a method of one."""
    owner = getattr(fn, "__self__", fn)
    if not isinstance(owner, torch.nn.Module):
        return False
    return any(True for _ in owner.parameters()) or any(True for _ in owner.buffers())


class TransformedUpdate:
    """``update`` applied to ``transform(contribution)``: an after-sum ``OutputTransform``
    carried with the contribution, so every place that completes it applies it once.

    Two of them are equal when they do the same thing as far as any path can tell: the same
    update, a transform in the same order with the same portability. The transform object
    itself is per layer (a post-norm holds its layer's weights), and a neighbour's
    declaration rebuilt on another pipeline rank holds another one.
    """

    plain = False  # declared: the transform is work a fused add+norm would skip

    def __init__(self, update, transform: OutputTransform) -> None:
        self.update, self.transform = update, transform

    @property
    def at_producer(self) -> bool:
        return getattr(self.update, "at_producer", False)

    @property
    def portable(self) -> bool:
        # a pipeline receiver that completes a declared partial sum applies its own copy:
        # identical only where the transform says a copy computes the same function
        return self.transform.portable and is_portable(self.update)

    @property
    def reads_batch(self) -> bool:
        # declared on this class: the wrapped update's own declaration
        return reads_batch(self.update)

    def apply(self, residual, contribution, forward=None):
        """``forward``: handed where the wrapped update reads its batch."""
        return apply_update(self.update, residual, self.transform(contribution), forward)

    def _facts(self) -> tuple:
        return self.transform.before_reduce_scatter, self.transform.portable

    def __eq__(self, other) -> bool:
        return (isinstance(other, TransformedUpdate) and other.update == self.update
                and other._facts() == self._facts())

    def __hash__(self) -> int:
        return hash((type(self), self._facts()))

    def __repr__(self) -> str:
        return f"{self.transform!r} then {self.update!r}"
