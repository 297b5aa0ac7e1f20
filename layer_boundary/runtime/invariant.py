"""Batch-invariant numerics: a request's logits the same bits whether it runs alone or in any
batch, at a given layout (``run --batch-invariant``).

A batch changes a request's bits wherever a result depends on how many rows run together: a
matrix product whose kernel (a matrix-vector product for one row, blocked GEMM for several, a
packed copy) and reduction order follow the row count; an elementwise function whose CPU
kernel runs a contiguous tensor as one flat loop, vectorized but for a scalar tail whose
``exp`` (``silu``'s) rounds otherwise, so an element's last bit follows where its row sits in
the batch; attention that runs a batch's requests as one call; a sum over ranks whose order
follows the tensor's size (gloo's ring all-reduce chunks by bytes).

The mode is scoped and works at the level of the ops, as vLLM's and SGLang's do, so model code
stays plain: inside ``batch_invariant()`` a ``TorchDispatchMode`` runs each op of
``INVARIANT_OPS`` (the matrix products, the transcendental elementwise functions, the
last-dimension reductions, softmax and top-k) one row at a time, whoever calls it: each row's
result is the one-row result whatever rows run beside it. Besides the ops:

- attention runs one request a call (``models.attention``), and a Mamba2 or Gated DeltaNet
  decode step updates each request's state alone: true algorithm switches, which read
  ``BATCH_INVARIANT.on``;
- every synchronous sum over ranks is gathered and added here in group rank order, whatever
  its size (``collectives``), and reduce-scatters exchange their blocks and add them the same
  way: on each element the same additions in the same order, on every layout's row mode;
- the run's policy is fixed (``auto`` is resolved once, never per batch); what does not
  combine with the mode (two-batch overlap, a compiled graph, speculative verification) is
  refused by the combination table (``capabilities``, ``Feature.BATCH_INVARIANT``).

Row-by-row ops cost what one-row ops cost, a call a row: see docs/benchmarks.md. ``run
--batch-invariant`` checks the whole model and says where it fails.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .arguments import flag
from .modes import MODES, scoped

aten = torch.ops.aten


class _Mode:
    """``BATCH_INVARIANT.on``: the run-wide mode (``modes.MODES.batch_invariant``)."""

    __slots__ = ()

    @property
    def on(self) -> bool:
        return MODES.batch_invariant


BATCH_INVARIANT = _Mode()


def batch_invariant(on: bool = True):
    """A context in which the enclosed forwards run batch-invariant (``on``), or as usual.

    Args:
        on: True or False (a string such as ``"no"`` is refused here, where it was truthy).

    Inside it the ops of ``INVARIANT_OPS`` run a row at a time, whoever calls them. A model
    built in the mode is checked against it (its ``register_model`` declaration
    ``batch_invariant``, an adapter, a compiled forward: ``capabilities.check_model``), and
    so is each forward and generation run in it (``capabilities.check_invariant``).
    """
    return _mode(flag("batch_invariant", "on", on))


@contextlib.contextmanager
def _mode(on: bool):
    previous = MODES.batch_invariant
    # the ops are intercepted only where the mode is on; a nested ``batch_invariant(False)``
    # leaves an outer interceptor in place, which then passes every op through
    with scoped(batch_invariant=on), _RowByRow() if on and not previous else (
            contextlib.nullcontext()):
        yield


def _one_row_each(call, rows: torch.Tensor, *rest, **kwargs):
    """``call(row, *rest, **kwargs)`` for each row of ``rows`` (first dimension), joined."""
    outs = [call(row, *rest, **kwargs) for row in rows.split(1)]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _mm(func, a, b, *args, **kwargs):
    # [M, K] @ [K, N]: each of the M rows its own matrix-vector product
    return _one_row_each(func, a, b, *args, **kwargs)


def _addmm(func, bias, a, b, *args, **kwargs):
    if bias.dim() < 2 or bias.shape[0] == 1:
        return torch.cat([func(bias, a[i:i + 1], b, *args, **kwargs)
                          for i in range(a.shape[0])])
    return torch.cat([func(bias[i:i + 1], a[i:i + 1], b, *args, **kwargs)
                      for i in range(a.shape[0])])


def _bmm(func, a, b, *args, **kwargs):
    # [B, M, K] @ [B, K, N]: each (batch, row) pair alone; either dimension may be the tokens
    # (an einsum puts heads or tokens first as it likes)
    return torch.stack([torch.cat([func(a[j:j + 1, i:i + 1], b[j:j + 1], *args, **kwargs)
                                   for i in range(a.shape[1])], dim=1)[0]
                        for j in range(a.shape[0])])


def _dims(x: torch.Tensor, dim) -> set:
    return {d % x.dim() for d in ([dim] if isinstance(dim, int) else list(dim or ()))}


def _last_dim(x: torch.Tensor, dim) -> bool:
    return _dims(x, dim) == {x.dim() - 1}


def _elementwise(func, x, *args, **kwargs):
    rows = x.reshape(-1, x.shape[-1])  # each row of the last dimension alone
    return _one_row_each(func, rows, *args, **kwargs).view(x.shape)


# torch's CPU reductions sum each output on one thread, in an order set by the reduced size
# alone, until one output's sum reaches at::internal::GRAIN_SIZE elements: then a lone row's
# sum is split over threads where a batch's rows are not
_CPU_SERIAL_SUM = 32768


def _reduction(func, x, dim, keepdim=False, *args, **kwargs):
    if x.device.type == "cpu" and math.prod(x.shape[d] for d in _dims(x, dim)) < _CPU_SERIAL_SUM:
        return func(x, dim, keepdim, *args, **kwargs)  # each output's own serial sum
    if _last_dim(x, dim):  # each row of the last dimension alone
        rows = x.reshape(-1, x.shape[-1])
        out = _one_row_each(func, rows, [-1], True, *args, **kwargs)  # [R, 1]
        return out.view(*x.shape[:-1], *((1,) if keepdim else ()))
    if x.dim() >= 2 and 0 not in _dims(x, dim):  # each token (first dimension) alone
        return _one_row_each(func, x, dim, keepdim, *args, **kwargs)
    return func(x, dim, keepdim, *args, **kwargs)  # over the tokens themselves: whole


def _softmax(func, x, dim, *args):
    if not _last_dim(x, dim):
        return func(x, dim, *args)
    return _one_row_each(func, x.reshape(-1, x.shape[-1]), -1, *args).view(x.shape)


def _topk(func, x, k, dim=-1, *args):
    if not _last_dim(x, dim):
        return func(x, k, dim, *args)
    values, ids = _one_row_each(func, x.reshape(-1, x.shape[-1]), k, -1, *args)
    shape = (*x.shape[:-1], values.shape[-1])
    return values.view(shape), ids.view(shape)


# What the mode runs a row at a time: each op whose result for a row depends on the rows beside
# it on some backend (its kernel, blocking or vector path chosen by the whole tensor), each with
# how its rows are taken. Every other op passes through: elementwise arithmetic (rsqrt and
# sqrt too) IEEE rounds the same on any path, and a gather, copy or view moves bits unchanged.
_ELEMENTWISE = ("silu", "sigmoid", "softplus", "gelu", "tanh", "exp", "expm1", "log", "log1p",
                "erf")


def _in_place(out_of_place):
    """An in-place elementwise op (``x.exp_()``, ``F.silu(x, inplace=True)``): its
    out-of-place op a row at a time, written back into ``x``."""
    def split(func, x, *args, **kwargs):
        return x.copy_(_elementwise(out_of_place, x, *args, **kwargs))
    return split


INVARIANT_OPS = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    **{getattr(aten, name).default: _elementwise for name in _ELEMENTWISE},
    **{getattr(aten, f"{name}_").default: _in_place(getattr(aten, name).default)
       for name in _ELEMENTWISE if hasattr(aten, f"{name}_")},
    aten.mean.dim: _reduction,
    aten.sum.dim_IntList: _reduction,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten.topk.default: _topk,
}


def _rows(func, args) -> int:
    """How many rows ``func``'s operand has (one or none: nothing to split)."""
    x = args[1] if func is aten.addmm.default else args[0]
    if func is aten.bmm.default:
        return x.shape[0] * x.shape[1]
    return x.numel() // x.shape[-1] if x.dim() >= 2 and x.shape[-1] else 0


class _RowByRow(TorchDispatchMode):
    """Runs the ops of ``INVARIANT_OPS`` a row at a time while ``BATCH_INVARIANT.on``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        split = INVARIANT_OPS.get(func)
        if split is None or not MODES.batch_invariant or _rows(func, args) <= 1:
            return func(*args, **kwargs)
        return split(func, *args, **kwargs)

