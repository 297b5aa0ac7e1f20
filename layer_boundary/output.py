"""Internal reduction handoffs and producer-specific finalize handoffs.

A completion step finishes one kind of owed work on the rows the consumer reads. Steps are
built once per stage plan; a forward looks the contribution's ``Owed`` up and runs the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .contracts import Owed
from .layout import SumGroup, sum_group
from .ops import all_reduce_rows
from .runtime.parallel import Parallel


class HandoffOutput:
    """Producer-specific work (such as a deferred MoE finalize) left for the next input.

    ``complete()`` is the unfused completion path; a fusion provider may do better.
    """

    def complete(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class UnreducedOutput:
    """Internal adapter form: a value and the work it owes, before the stream takes it."""

    value: torch.Tensor
    owed: Owed


@dataclass(frozen=True)
class CompletionStep:
    """Finish ``owed`` by an all-reduce over its group; rows stay where they are."""

    owed: Owed
    run: Callable[[torch.Tensor], torch.Tensor]
    kind: str

    def __repr__(self) -> str:
        return f"{self.kind}({self.owed.group.value})"


def all_reduce_completion(owed: Owed) -> CompletionStep:
    group = owed.via
    return CompletionStep(owed, lambda x: all_reduce_rows(x, group), "all_reduce")


def sum_owed(parallel: Parallel, which: SumGroup, rows) -> Owed | None:
    """The owed sum over ``which``, or None where that group has one rank."""
    group = sum_group(parallel, which)
    return Owed(which, rows, group) if group.size > 1 else None


def complete_unfused(value, owed: Owed | None) -> torch.Tensor:
    """The plain completion any accessor may run: finalize a handoff, all-reduce a sum."""
    if isinstance(value, HandoffOutput):
        value = value.complete()
    if owed is None:
        return value
    return all_reduce_rows(value, owed.via)
