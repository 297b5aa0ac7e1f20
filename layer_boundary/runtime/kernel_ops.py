"""Triton launches that a compiled forward calls as opaque custom ops.

Eagerly a kernel's Python wrapper launches it directly (a custom op's dispatch would add
about 7 us a call, on a decode step that launches a dozen a layer). While dynamo traces, the
same wrapper calls a ``layer_boundary::`` custom op instead, whose fake says the output's
shape and whose schema says which tensors the launch writes. Dynamo would otherwise trace
into the launch: on a GPU it reads the Triton source to find what the kernel mutates, and
under the Triton interpreter (the CPU) it cannot trace it at all, so the compiled step with
the Triton provider or the in-place decode attention could never be checked on the CPU.
Inductor calls the op as it is; a captured CUDA graph records its launch like any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def compiled_as_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Decorate a kernel wrapper: called directly eagerly, as the custom op
    ``layer_boundary::{name}`` while compiling.

    Args:
        name: the op's name in the ``layer_boundary`` namespace (unique).
        fake: the op's fake implementation (same signature): new outputs of the right
            shapes and dtypes, nothing launched (the wrapper allocates the outputs its
            launch fills with it too, so the two cannot disagree).
        mutates_args: the parameters whose storage the launch writes (a cache the kernel
            stores into); every output must be new storage (a custom op returns no alias).
    """

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"layer_boundary::{name}", fn,
                                     mutates_args=mutates_args)
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        return call

    return wrap
