"""Public entry points check their arguments as config.json's fields are checked: a flag is a
real bool (a string ``"no"`` is truthy: ``declare_ffn(parallel="yes")`` was stored as given,
``RowParallelLinear(reduce_results="no")`` reduced), a reduction an enum, an update or a read
of the residual protocols; each a one-line TypeError naming the call and the argument, before
anything is built."""

from __future__ import annotations

import re

import pytest
import torch

from layer_boundary import OutputTransform, declare_attn, declare_ffn, make_stages
from layer_boundary.adapters.tbo import split_batch
from layer_boundary.runtime import (BoundaryRuntime, ColumnParallelLinear, ParallelDims,
                                    QKVParallelLinear, RowParallelLinear, build_parallel)


def _entry_points() -> list:
    """(the call as errors name it, a builder taking the option, its flags, flags that may
    also be None)."""
    par = build_parallel(ParallelDims())
    group = par.tp_group
    return [
        ("declare_attn", declare_attn, ("gathers_tp_input", "terminal", "sequence_parallel"), ()),
        ("declare_ffn", declare_ffn, ("sparse", "terminal", "sequence_parallel", "dispatches",
                                      "parallel"), ("next_sparse", "next_layer_sparse")),
        ("make_stages", lambda **kw: make_stages((declare_attn(), None), **kw), ("terminal",),
         ()),
        ("BoundaryRuntime", lambda **kw: BoundaryRuntime(par, **kw),
         ("allreduce_fusion", "rs_padding", "choose_by_bytes"), ()),
        ("ColumnParallelLinear", lambda **kw: ColumnParallelLinear(4, 4, group, **kw),
         ("bias", "gather_output"), ()),
        ("QKVParallelLinear", lambda **kw: QKVParallelLinear(4, 2, 2, 1, group, **kw),
         ("bias",), ()),
        ("RowParallelLinear", lambda **kw: RowParallelLinear(4, 4, group, **kw),
         ("bias", "reduce_results"), ()),
        ("OutputTransform", lambda **kw: OutputTransform(
            torch.tanh, **{"before_reduce_scatter": False, **kw}),
         ("before_reduce_scatter", "portable"), ()),
        ("split_batch", lambda **kw: split_batch(None, **kw), ("overlap",), ()),
    ]


def test_every_flag_of_a_public_entry_point_is_a_bool():
    checked = 0
    for who, build, flags, optional in _entry_points():
        for name in flags + optional:
            for value in ("no", 1) + (() if name in optional else (None,)):
                with pytest.raises(TypeError, match=rf"^{who}\({name}={re.escape(repr(value))}"
                                                    rf"\): {name} must be True"):
                    build(**{name: value})
                checked += 1
    assert checked == 64  # 20 flags (3 values each), 2 that may be None (2 each)


@pytest.mark.parametrize("call,message", [
    (lambda: declare_attn(reduction="partial"),
     r"declare_attn\(reduction='partial'\): reduction must be a ProducerReduction"),
    (lambda: declare_ffn(update="plain"),
     r"declare_ffn\(update='plain'\): update must be a StageUpdate"),
    (lambda: declare_ffn(read=3), r"declare_ffn\(read=3\): read must be a StageRead"),
    (lambda: declare_attn(previous="attn"),
     r"declare_attn\(previous='attn'\): previous must be a StageDeclaration"),
    (lambda: declare_attn(mixer=2), r"declare_attn\(mixer=2\): mixer must be a string"),
])
def test_a_declarations_other_arguments_are_refused_by_name(call, message):
    """Each was stored as given (a string reduction compared unequal to every enum member
    and reached no check; a string update failed at the first forward)."""
    with pytest.raises(TypeError, match="^" + message):
        call()
