"""Producer-specific output handoffs."""

from __future__ import annotations

import torch

from .residual import is_portable


class HandoffOutput:
    """Producer-specific work (such as a deferred MoE finalize) left for the next input.

    ``complete()`` is the unfused completion path; a fusion provider may do better. Its
    result owes whatever sum the exit that published ``defer_moe_finalize`` recorded.
    """

    def complete(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class OutputTransform:
    """Processing of a stage's contribution before the residual update: ``fn(x)``, acting on
    each row by itself (a scale, a soft cap), so it may run on whatever rows the value is on.

    ``before_reduce_scatter`` states the order the implementation keeps, and only that:

    * False: ``fn`` runs on the complete contribution, after its sum, wherever the sum runs
      (the consumer's all-reduce or reduce-scatter, compute's own, a final norm, a pipeline
      receiver). The declaration's update becomes a ``TransformedUpdate``, which is not a
      plain add: no fused add+norm and no add-before-sum shortcut stands in for it.
    * True: ``fn`` runs on compute's output as the exit receives it, each rank's partial
      before the sum. That is exact only where ``fn`` is linear, which the declaring model
      asserts; it is not a permission to move other work across a reduction, and such a
      stage takes no finalize handoff (its output must be a tensor at the exit).
    """

    def __init__(self, fn, *, before_reduce_scatter: bool, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"OutputTransform needs a callable, got {type(fn).__name__}")
        self.fn, self.before_reduce_scatter = fn, bool(before_reduce_scatter)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def __repr__(self) -> str:
        order = "before" if self.before_reduce_scatter else "after"
        return f"OutputTransform({self.name}, {order} the sum)"


class TransformedUpdate:
    """``update`` applied to ``transform(contribution)``: an after-sum ``OutputTransform``
    carried with the contribution, so every place that completes it applies it once."""

    plain = False  # declared: the transform is work a fused add+norm would skip

    def __init__(self, update, transform: OutputTransform) -> None:
        self.update, self.transform = update, transform

    @property
    def at_producer(self) -> bool:
        return getattr(self.update, "at_producer", False)

    @property
    def portable(self) -> bool:
        # a copy on another pipeline stage applies it identically where the update does
        # (the transform is the declaring model's function, on both stages)
        return is_portable(self.update)

    def apply(self, residual, contribution):
        return self.update.apply(residual, self.transform(contribution))

    def __eq__(self, other) -> bool:  # two declarations of one stage name the same update
        return (isinstance(other, TransformedUpdate) and other.update == self.update
                and other.transform == self.transform)

    def __hash__(self) -> int:
        return hash((type(self), self.transform))

    def __repr__(self) -> str:
        return f"{self.transform!r} then {self.update!r}"
