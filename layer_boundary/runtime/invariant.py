"""Batch-invariant numerics: a request's logits the same bits whether it runs alone or in any
batch, at a given layout (``run --batch-invariant``).

A batch changes a request's bits wherever a result depends on how many rows run together: a
matrix product whose kernel (a matrix-vector product for one row, blocked GEMM for several, a
packed copy) and reduction order follow the row count; attention that runs a batch's
requests as one call, their shapes its blocking; a sum over ranks whose order follows the
tensor's size (gloo's ring all-reduce chunks by bytes). In this mode:

- every linear layer of the runtime, and the MoE's experts, compute row by row on the plain
  weight (``linear``): each row's product is the one-row product whatever the batch;
- attention runs one request a call (``models.attention``);
- an elementwise activation passed through ``rowwise`` runs one row a call: torch's CPU
  kernels run an elementwise op over a contiguous tensor as one flat loop, vectorized
  but for a scalar tail whose ``exp`` (``silu``'s) rounds otherwise, so which path an element
  takes, and its last bit, follows where its row sits in the batch whenever the row width is
  not a multiple of the loop's step (an intermediate shard of 48 on AVX-512, say);
- a model's own row-independent blocks whose kernels still see the whole batch (a router's
  small product, sigmoid and top-k; a Mamba2 decode step's batched conv and state update) run
  one row, or one request, a call (``per_row``; ``models.mamba2``);
- every synchronous sum over ranks is gathered and added here in group rank order, whatever
  its size (``collectives``), and reduce-scatters exchange their blocks and add them the same
  way: on each element the same additions in the same order, on every layout's row mode;
- the run's policy is fixed (``auto`` is resolved once, never per batch) and two-batch
  overlap, whose split and asynchronous sums follow the batch, is refused.

Row-by-row products cost what one-row products cost, a call a row: see docs/benchmarks.md.
A model's own compute beyond these is its own to keep per request or per row (Mamba2 scans
and convolves each request alone in the mode); ``run --batch-invariant`` checks the whole
model and says where it fails.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .arguments import flag


class _Mode:
    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


BATCH_INVARIANT = _Mode()


def batch_invariant(on: bool = True):
    """A context in which the enclosed forwards run batch-invariant (``on``), or as usual.

    Args:
        on: True or False (a string such as ``"no"`` is refused here, where it was truthy).

    A model built in the mode is checked against it (its ``register_model`` declaration
    ``batch_invariant``, an adapter, a compiled forward: ``capabilities.check_model``), and
    so is each forward and generation run in it (``capabilities.check_invariant``).
    """
    return _mode(flag("batch_invariant", "on", on))


@contextlib.contextmanager
def _mode(on: bool):
    previous = BATCH_INVARIANT.on
    BATCH_INVARIANT.on = on
    try:
        yield
    finally:
        BATCH_INVARIANT.on = previous


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)`` computed one row at a time: the same bits for a row
    whatever rows run beside it."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= 1:
        return F.linear(x, weight, bias)
    out = torch.cat([F.linear(rows[i:i + 1], weight, bias) for i in range(rows.shape[0])])
    return out.view(*x.shape[:-1], out.shape[-1])


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, or ``linear`` (a row at a time) while the mode is on: for a model's own
    plain products (a replicated projection) that no parallel linear computes."""
    return (linear if BATCH_INVARIANT.on else F.linear)(x, weight, bias)


def rowwise(fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn(x, *args, **kwargs)`` for an elementwise ``fn`` (an activation such as ``F.silu``),
    computed one row (last dimension) at a time while the mode is on: each row's elements take
    the kernel's vectorized and scalar paths as that row alone does, whatever rows run beside
    it. Off the mode, one call."""
    if not BATCH_INVARIANT.on or x.dim() < 2:
        return fn(x, *args, **kwargs)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= 1:  # one row, or none (an attention-DP rank without requests)
        return fn(x, *args, **kwargs)
    out = torch.cat([fn(rows[i:i + 1], *args, **kwargs) for i in range(rows.shape[0])])
    return out.view(x.shape)


def per_row(fn, x: torch.Tensor, *args, **kwargs):
    """``fn(x, *args, **kwargs)`` for a ``fn`` whose rows (first dimension) are independent
    (a router: [T, H] -> tensors of T rows), computed one row a call while the mode is on and
    concatenated per output: each row takes the one-row kernels whatever the batch. Off the
    mode, one call."""
    if not BATCH_INVARIANT.on or x.shape[0] <= 1:
        return fn(x, *args, **kwargs)
    outs = [fn(x[i:i + 1], *args, **kwargs) for i in range(x.shape[0])]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    return tuple(torch.cat(parts) for parts in zip(*outs))
