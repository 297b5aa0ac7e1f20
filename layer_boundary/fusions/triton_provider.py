"""The Triton fusion provider: the add+norm read of an arriving sum as one kernel
(``fusions.kernels``), after the same movement the built-in path would run.

Where the built-in input path completes an arrival (its table's movement onto the update
rows), then adds it to the residual in fp32, rounds the residual and normalises the sum in
three to five ops, a candidate of this provider runs that movement and then one kernel. So it
can be offered wherever the consumer's movement table has a row onto the update rows: every
row mode (``ar``; ``rs``/``rsv`` with attention TP, whose residual is scattered), attention
DP and a rank with no tokens, CP batches, and after an output transform (which leaves a
complete value). What each candidate completes and from which rows is its table row's owed
sum and source, declared on the ``FusedInput``; the consumer offers it to those arrivals only.
Each stands in for the consumer's read by its kind: the add+norm read, or the quantized read
(``QuantizedRead``, a power-of-two group), whose kernel also quantizes the normalized output
to FP8 per token and group; a stage with any other read is offered nothing.

At run time a candidate declines (before moving anything) where the kernel does not apply:
an update that is not a plain add, no residual yet, a residual on other rows, a norm other
than ``RMSNorm`` or the zero-centered (Gemma) norm, a dtype wider than fp32. The terminal
service (``handoff_norm``) runs the same kernel in its zero-centered form after the terminal
finalize's all-reduce.

On a machine without CUDA the kernels run under the Triton interpreter, which has to be chosen
before ``triton`` is imported, and importing this package imports it (through torch's
compiler): set ``TRITON_INTERPRET=1`` in the environment, as the command line does for
``--fusions triton`` on the CPU and the tests do. ``use_interpreter()`` sets it where
``triton`` is not imported yet and refuses by name where it is.
"""

from __future__ import annotations

import os
import sys

import torch

from ..residual import ReadKind, is_plain, read_kind
from ..runtime.norm import GemmaRMSNorm, RMSNorm
from ..runtime.quant import QuantizedInput
from . import Arrival, FusedInput, InputPlan
from .reference import Counted, ReferenceFusions
from .terminal import TerminalFinalizeNorm

NOT_INTERPRETED = ("the Triton provider runs its kernels on CUDA tensors, or on CPU tensors "
                   "under the Triton interpreter, which must be chosen before triton is "
                   "imported: set TRITON_INTERPRET=1 (fusions.triton_provider.use_interpreter())")


def use_interpreter() -> None:
    """Run the kernels under the Triton interpreter (CPU tensors): sets ``TRITON_INTERPRET=1``
    before ``triton`` is imported; refuses if it was imported without it."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(NOT_INTERPRETED)
    os.environ["TRITON_INTERPRET"] = "1"


def _kernels():
    try:
        from . import kernels
    except ImportError as exc:  # the test extra installs it; a run names what is missing
        raise RuntimeError("--fusions triton needs the triton package (pip install "
                           f"triton==3.9.0): {exc}") from None
    return kernels


def _power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _norm_form(norm) -> tuple[torch.Tensor, bool] | None:
    """(weight, zero_centered) of a norm the kernel computes exactly as the module does."""
    if type(norm) is RMSNorm:
        return norm.weight, False
    if type(norm) is GemmaRMSNorm:
        return norm.gemma_weight, True
    return None


def fused_add_norm(movement, local, kernels, group, arrival: Arrival):
    """``movement`` (the consumer's own completion onto the update rows), then the add+norm
    kernel (with ``group``: the quantized read's, its output FP8 per token and group); None
    (declined, nothing touched) where the kernel does not apply. ``local``: the rows a
    residual with no recorded rows is on (the model's own)."""
    residual = arrival.residual
    form = _norm_form(arrival.norm)
    rows = local if arrival.residual_rows is None else arrival.residual_rows
    if (residual is None or form is None or not is_plain(arrival.update)
            or rows != movement.dst or residual.dtype not in kernels.KERNEL_DTYPES
            or (residual.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1")):
        return None
    value = arrival.value
    if not isinstance(value, torch.Tensor):
        value = value.complete()  # a finalize handoff: the experts' output, then the sum
    if movement.moves:
        value = movement.move(arrival.facts, value)
    weight, zero_centered = form
    if group is None:
        return kernels.add_rms_norm(value, residual, weight, arrival.norm.eps, zero_centered)
    values, scales, residual = kernels.add_rms_norm_fp8(value, residual, weight,
                                                        arrival.norm.eps, group, zero_centered)
    return QuantizedInput(values, scales, group, residual.dtype), residual


class TritonFusions(ReferenceFusions):
    """Offers one candidate per movement onto a stage's update rows (see the module docstring)
    to attention and FFN inputs; ``handoff_norm`` gives the terminal service its kernel.

    The deferral questions (``can_defer_finalize``, ``can_defer_all_reduce``) are the
    reference provider's, declared here: a deferred finalize or all-reduce arrives as a
    handoff or a partial, which these candidates complete like any other arrival.

    Args:
        defer_finalize, terminal_finalize, defer_all_reduce: as ``ReferenceFusions``.
    """

    can_defer_finalize = ReferenceFusions.can_defer_finalize
    can_defer_all_reduce = ReferenceFusions.can_defer_all_reduce

    def __init__(self, defer_finalize: bool = True, terminal_finalize: bool = False,
                 defer_all_reduce: bool = False) -> None:
        super().__init__(defer_finalize=defer_finalize, terminal_finalize=terminal_finalize,
                         defer_all_reduce=defer_all_reduce)
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(NOT_INTERPRETED)  # its kernels could run nowhere
        self.kernels = _kernels()

    def _input(self, plan: InputPlan) -> list[FusedInput]:
        self._parallel = plan.parallel
        kind, group = read_kind(plan.read), getattr(plan.read, "group", None)
        if plan.moves is None or kind is None or (
                kind is ReadKind.FP8_ADD_NORM and not _power_of_two(group)):
            return []  # a read the kernels do not compute: nothing to offer
        if kind is ReadKind.ADD_NORM:
            group = None
        out = []
        for (owed, _, _), movement in plan.moves.items():
            if movement.dst != plan.update_rows:
                continue
            run = Counted(lambda arrival, m=movement, local=plan.layouts.local, g=group:
                          fused_add_norm(m, local, self.kernels, g, arrival))
            out.append(FusedInput(run=run, completes=frozenset({owed}), source=movement.src,
                                  target=movement.dst, finalizes=True, collective=plan.mode,
                                  read=kind))
        self.offered.extend((plan.stage, c) for c in out)
        return out

    def handoff_norm(self, eps: float | None = 1e-6):
        service = super().handoff_norm(eps)
        if service is not None:
            service = self.service = TerminalFinalizeNorm(
                service.group, eps, add_norm=self._terminal_add_norm,
                dtypes=self.kernels.KERNEL_DTYPES)
        return service

    def _terminal_add_norm(self, value, residual, gamma, eps):
        return self.kernels.add_rms_norm(value, residual, gamma, eps, zero_centered=True)

