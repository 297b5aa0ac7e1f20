"""The forward-flag scope and the current topology, as compute modules see them.

Flags are published only by a boundary's exit scope (spec: "Do not set a skip flag
independently of a completion action"); compute reads them through ``get_forward()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .parallel import Parallel


@dataclass(frozen=True)
class ForwardFlags:
    fuse_mlp_allreduce: bool = False  # skip the output all-reduce; the boundary owns the sum
    mlp_reduce_scatter: bool = False  # leave the sum to the boundary's reduce-scatter
    defer_moe_finalize: bool = False  # a MoE may return a HandoffOutput

    @property
    def skips_reduction(self) -> bool:
        return self.fuse_mlp_allreduce or self.mlp_reduce_scatter


NO_FLAGS = ForwardFlags()


class _ForwardState:
    __slots__ = ("flags", "open_scopes")

    def __init__(self) -> None:
        self.flags = NO_FLAGS
        self.open_scopes = 0  # exit scopes entered and not yet left


_STATE = _ForwardState()


def get_forward() -> ForwardFlags:
    """Flags of the innermost open exit scope (all False outside one)."""
    return _STATE.flags


def swap_flags(flags: ForwardFlags, opening: bool) -> ForwardFlags:
    """Install ``flags`` and return the previous ones; for exit scopes only (``opening``: a
    scope is entered, else left)."""
    previous = _STATE.flags
    _STATE.flags = flags
    _STATE.open_scopes += 1 if opening else -1
    return previous


def open_exit_scopes() -> int:
    """How many exit scopes are open now (a two-batch-overlap yield point requires none)."""
    return _STATE.open_scopes


def get_parallel() -> Parallel:
    """The topology of the boundary runtime this process was set up with."""
    from .args import get_runtime

    return get_runtime().parallel
