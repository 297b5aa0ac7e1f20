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

At run time a candidate declines (before moving anything), saying why (``Declined``), where
the kernel does not compute what the consumer's read would: an update that is not a plain
add, no residual yet, a residual on other rows, a dtype wider than fp32, a norm other than
``RMSNorm`` or the zero-centered (Gemma) norm, an ``RMSNorm`` weight of another dtype than the
stream's (the module's output would take the weight's promotion). The terminal
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

from ..residual import ReadKind, read_kind
from ..runtime.norm import GemmaRMSNorm, RMSNorm
from ..runtime.quant import QuantizedInput
from . import Arrival, Declined, FusedInput, InputPlan
from .reference import Counted, ReferenceFusions, plain_add_refusal
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


def _norm_form(norm, dtype: torch.dtype) -> tuple[torch.Tensor, bool] | str:
    """(weight, zero_centered) of a norm the kernel computes exactly as the module does on a
    stream of ``dtype``, or why it does not.

    ``RMSNorm`` rounds the normalised value to the stream's dtype, then multiplies by its
    weight: a weight of another dtype makes torch promote the product (an fp32 weight on a
    bf16 stream gives an fp32 output), which the kernel, writing the stream's dtype, does not
    reproduce. The zero-centered (Gemma) norm scales by ``1 + w`` in fp32 and rounds once, as
    the kernel does from whatever dtype ``w`` is stored in."""
    if type(norm) is RMSNorm:
        weight = norm.weight.dtype
        if weight != dtype:
            promoted = torch.promote_types(dtype, weight)
            return (f"the norm's weight is {_name(weight)} on a {_name(dtype)} stream "
                    f"(RMSNorm's output would be {_name(promoted)}, the kernel's "
                    f"{_name(dtype)})")
        return norm.weight, False
    if type(norm) is GemmaRMSNorm:
        return norm.gemma_weight, True
    return f"a {type(norm).__name__} norm (the kernel computes RMSNorm and GemmaRMSNorm)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _refusal(movement, local, kernels, arrival: Arrival) -> str | None:
    """Why the kernel cannot take ``arrival`` whatever its norm (None: it can)."""
    refusal = plain_add_refusal(arrival)
    if refusal is not None:
        return refusal
    residual = arrival.residual
    rows = local if arrival.residual_rows is None else arrival.residual_rows
    if rows != movement.dst:
        return f"the residual is on {rows} rows, the kernel writes {movement.dst}"
    if residual.dtype not in kernels.KERNEL_DTYPES:
        return f"a {_name(residual.dtype)} residual (the kernel takes fp32, bf16, fp16)"
    if residual.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "a CPU tensor without the Triton interpreter"
    return None


def fused_add_norm(movement, local, kernels, group, arrival: Arrival):
    """``movement`` (the consumer's own completion onto the update rows), then the add+norm
    kernel (with ``group``: the quantized read's, its output FP8 per token and group); a
    ``Declined`` (nothing touched) where the kernel does not compute what the consumer's read
    would. ``local``: the rows a residual with no recorded rows is on (the model's own)."""
    refusal = _refusal(movement, local, kernels, arrival)
    if refusal is not None:
        return Declined(refusal)
    residual = arrival.residual
    form = _norm_form(arrival.norm, residual.dtype)
    if isinstance(form, str):
        return Declined(form)
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
    # a model with this provider decodes attention in place (``CausalLM.install_fusion``:
    # its caches' ``KVCache.decode_in_place``): the padded and ring decode steps of
    # ``cached_attention`` read each request's keys and values where they lie
    # (``models.decode_kernel``, one Triton launch for the write, two for the attention)
    decode_attention_in_place = True

    def __init__(self, defer_finalize: bool = True, terminal_finalize: bool = False,
                 defer_all_reduce: bool = False) -> None:
        super().__init__(defer_finalize=defer_finalize, terminal_finalize=terminal_finalize,
                         defer_all_reduce=defer_all_reduce)
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(NOT_INTERPRETED)  # its kernels could run nowhere
        self.kernels = _kernels()
        self.kernel_dtypes = self.kernels.KERNEL_DTYPES  # what its model kernels take

    def head_norm_rope(self, x, weight, eps: float, cos, sin):
        """Model compute a module may take (``take_fusions``): a head's RMSNorm and
        rotate-half RoPE in one launch (``kernels.head_norm_rope``)."""
        return self.kernels.head_norm_rope(x, weight, eps, cos, sin)

    def silu_mul(self, gate, up):
        """Model compute a module may take (``take_fusions``): a gated MLP's ``silu(gate) *
        up`` in one launch (``kernels.silu_mul``)."""
        return self.kernels.silu_mul(gate, up)

    def _input(self, plan: InputPlan) -> list[FusedInput]:
        self._parallel = plan.parallel
        kind, group = read_kind(plan.read), getattr(plan.read, "group", None)
        if plan.moves is None or kind is None or (
                kind is ReadKind.FP8_ADD_NORM and not _power_of_two(group)):
            # a read the kernels do not compute: nothing to offer
            self.not_offered[plan.stage] = (
                "no movement table given" if plan.moves is None else
                f"its read ({type(plan.read).__name__}) is not one the kernels compute"
                if kind is None else f"a quantized read's group of {group} is not a power of "
                "two")
            return []
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

