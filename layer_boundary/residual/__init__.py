"""Residual update/read protocols and the default plain add + norm pair.

The producer owns its ``StageUpdate`` (how its contribution changes the residual); the
consumer owns its ``StageRead`` (how it turns the residual into compute input). The update
travels with the contribution, so the consumer can fuse update and read when the update
declares that it may.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StageUpdate(Protocol):
    """How a producer's contribution changes the residual: ``apply(residual, contribution)``
    (the plain add, ``PlainAdd``, by default; mHC's hyper-connection update, a transform after
    the sum), or ``apply(residual, contribution, forward)`` where it declares ``reads_batch``
    (a short convolution along each request's tokens). Declared on the producer
    (``declare_attn``/``declare_ffn(update=)``), it travels with the contribution to the next
    input, which applies it, fused with its read where the update declares ``plain``."""

    # Capabilities (``plain``, ``portable``) count only where the update's own class (or the
    # object itself) declares them: a subclass that changes ``apply`` does not inherit a fast
    # path promised for its parent (see ``declared``).
    # A plain add may join a fused add+norm and may move before a sum (added on one rank).
    plain: bool
    # Its whole state is its parameters, or travels in the residual (mHC's coefficients): a
    # copy of it on another pipeline stage applies it identically, so a producer's declared
    # partial sum may cross a pipeline cut with the update still pending.
    portable: bool
    # Apply at the producer's exit instead of the consumer's input.
    at_producer: bool

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor: ...

    # Optional, declared on the class (``declared``): ``token_rows``: the update needs each DP
    # rank's complete output on its own token rows, in order (a short convolution), so the
    # consumer completes it onto the local rows and applies it there in every row mode.
    # ``apply_fp32(residual, contribution)``,
    # the updated residual in fp32, unrounded; the add+norm read then rounds it once for the
    # residual and normalises the fp32 sum, as for the plain add (``ScaledAdd``).
    # ``reads_batch = True``: ``apply`` takes a third argument, ``forward``, the ForwardBatch
    # the update is applied in (its requests, its cache), handed by whoever applies it: a
    # consumer's input, ``residual.batch``'s fold, final norm and ``to_pp``. Never inherited:
    # a subclass that keeps the three-argument ``apply`` declares it again. An update that
    # reads its batch is neither plain nor reads as one (``apply_fp32``): a fused kernel
    # standing in for its ``apply`` would hand it nothing; both are refused at declaration.


@runtime_checkable
class StageRead(Protocol):
    """How a consumer turns the residual into its compute input, returning (input, residual):
    ``enter`` at the stack's entry, ``read`` where the update was applied already,
    ``update_and_read`` to apply the producer's update and read in one step (the plain
    add + norm, ``AddNormRead``, by default; FP8's quantized read; mHC's). Declared on the
    consumer (``declare_attn``/``declare_ffn(read=)``)."""

    # Reads that must run on the source rows before a DP gather.
    before_gather: bool
    # What fused kernels may stand in for it (``ReadKind``; "add_norm" for the plain add+norm
    # read). A read without a kind of its own (a custom one, a subclass that does not
    # re-declare it) is never replaced by a fusion candidate.
    kind: str | None

    # Optional: ``visible(residual)`` gives what captures see of the residual this read leaves,
    # when the read keeps more beside it (mHC keeps its coefficients beside the streams).

    def enter(self, hidden: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...

    def read(self, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_and_read(self, update: StageUpdate, residual: torch.Tensor | None,
                        contribution: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]: ...


def declared(obj, name: str, default=None):
    """The capability ``name`` as ``obj`` declares it itself: set on the object or named by its
    own class, never inherited from a base class. A read that subclasses the add+norm read to
    change what it computes must not keep the fused kernel that stands in for its parent; one
    that still computes the same opts in by declaring ``kind = "add_norm"`` again."""
    if name in getattr(obj, "__dict__", ()) or name in type(obj).__dict__:
        return getattr(obj, name)
    return default


def is_plain(update) -> bool:
    """Whether ``update`` declares itself a plain add."""
    return declared(update, "plain", False) is True


def is_portable(update) -> bool:
    """Whether ``update`` declares that a copy of it on another process applies it identically."""
    return declared(update, "portable", False) is True


def needs_token_rows(update) -> bool:
    """Whether ``update`` declares that it needs each DP rank's own token rows, in order
    (``token_rows = True``: a short convolution)."""
    return declared(update, "token_rows", False) is True


def reads_batch(update) -> bool:
    """Whether ``update`` declares that its ``apply`` takes the forward batch
    (``reads_batch = True``)."""
    return declared(update, "reads_batch", False) is True


def apply_update(update, residual: torch.Tensor | None, contribution: torch.Tensor,
                 forward) -> torch.Tensor:
    """``update`` applied to ``residual`` and ``contribution`` in the forward batch
    ``forward``, which it is handed where it declares ``reads_batch``."""
    if reads_batch(update):
        return update.apply(residual, contribution, forward)
    return update.apply(residual, contribution)


def update_refusal(update) -> str | None:
    """Why ``update`` cannot be declared as it says it applies (None: it can): an update
    that reads its batch and also says it is plain or reads as one (``apply_fp32``), or an
    ``apply`` that cannot take the arguments it will be handed: ``(residual, contribution,
    forward)`` where it declares ``reads_batch``, ``(residual, contribution)`` otherwise (a
    subclass that keeps a three-argument ``apply`` without declaring it again)."""
    reads = reads_batch(update)
    fused = "plain" if is_plain(update) else (
        "apply_fp32" if declared(update, "apply_fp32") is not None else None)
    if reads and fused is not None:
        return (f"it declares reads_batch and {fused}: a fused add+norm standing in for its "
                "apply would hand it no forward")
    try:
        signature = inspect.signature(update.apply)
    except (TypeError, ValueError):  # a builtin without one: nothing to check
        return None
    try:
        signature.bind(*(None,) * (3 if reads else 2))
    except TypeError:
        if reads:
            return (f"it declares reads_batch, so its apply is handed (residual, contribution, "
                    f"forward); its apply takes {signature}")
        return (f"its apply{signature} takes more than (residual, contribution); an update "
                "that reads its batch declares reads_batch = True on its own class")
    return None


def in_forward(update, forward):
    """What a read's ``update_and_read`` receives for ``update`` applied in ``forward``: the
    update itself, or, where it reads its batch, the update with its forward
    (``UpdateInForward``), so a read calls ``apply(residual, contribution)`` alike for
    every update."""
    return UpdateInForward(update, forward) if reads_batch(update) else update


class UpdateInForward:
    """An update that reads its batch (``reads_batch``), with the forward batch it is
    applied in: ``apply(residual, contribution)`` hands it that forward. Made per
    application (``in_forward``), never stored: no module holds a forward."""

    __slots__ = ("update", "forward")
    plain = False  # refused beside reads_batch at declaration
    portable = False
    at_producer = False

    def __init__(self, update, forward) -> None:
        self.update, self.forward = update, forward

    def apply(self, residual: torch.Tensor | None, contribution: torch.Tensor) -> torch.Tensor:
        return self.update.apply(residual, contribution, self.forward)

    def __repr__(self) -> str:
        return repr(self.update)


class ReadKind(str, enum.Enum):
    """What a fused kernel may stand in for a read. A str, so a read that declares
    ``kind = "add_norm"`` names the same kind."""

    ADD_NORM = "add_norm"  # the plain add+norm read: fp32 sum, rounded residual, norm
    # the add+norm read, its output then quantized to FP8 per token and group of channels
    # (``residual.quant.QuantizedRead``)
    FP8_ADD_NORM = "fp8_add_norm"


def read_kind(read) -> ReadKind | None:
    """The fused-kernel kind ``read`` declares itself (None: a custom read, or a kind this
    package does not know)."""
    kind = declared(read, "kind")
    try:
        return None if kind is None else ReadKind(kind)
    except ValueError:
        return None


@dataclass(frozen=True)
class LayerResidual:
    """The update a producer applies and the read a consumer performs."""

    update: StageUpdate
    read: StageRead


def default_layer_residual() -> LayerResidual:
    from .add_norm import ADD_NORM_READ, PLAIN_ADD

    return LayerResidual(PLAIN_ADD, ADD_NORM_READ)
