"""Residual update/read protocols and the default plain add + norm pair.

The producer owns its ``StageUpdate`` (how its contribution changes the residual); the
consumer owns its ``StageRead`` (how it turns the residual into compute input). The update
travels with the contribution, so the consumer can fuse update and read when the update
declares that it may.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StageUpdate(Protocol):
    # A plain add may join a fused add+norm and may move before a sum (added on one rank).
    plain: bool
    # Apply at the producer's exit instead of the consumer's input.
    at_producer: bool

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class StageRead(Protocol):
    # Reads that must run on the source rows before a DP gather.
    before_gather: bool
    # What fused kernels may stand in for it: "add_norm" for the plain add+norm read. A read
    # without a kind (a custom one) is never replaced by a fusion candidate.
    kind: str | None

    # Optional: ``visible(residual)`` gives what captures see of the residual this read leaves,
    # when the read keeps more beside it (mHC keeps its coefficients beside the streams).

    def enter(self, hidden: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...

    def read(self, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_and_read(self, update: StageUpdate, residual: torch.Tensor | None,
                        contribution: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class LayerResidual:
    """The update a producer applies and the read a consumer performs."""

    update: StageUpdate
    read: StageRead


def default_layer_residual() -> LayerResidual:
    from .add_norm import ADD_NORM_READ, PLAIN_ADD

    return LayerResidual(PLAIN_ADD, ADD_NORM_READ)
