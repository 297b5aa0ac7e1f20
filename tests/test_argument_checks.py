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


def _numeric_calls():
    from layer_boundary import PostNormAdd, tbo_decision
    from layer_boundary.residual.quant import QuantizedRead
    from layer_boundary.runtime import (ForwardBatch, ForwardMode, GemmaRMSNorm,
                                        ParallelLMHead, RMSNorm, VocabParallelEmbedding,
                                        token_bucket)

    par = build_parallel(ParallelDims())
    extend = ForwardMode.EXTEND
    return [
        (lambda: RMSNorm(4, float("nan")), ValueError,
         r"RMSNorm\(eps=nan\): eps must be a positive, finite number"),
        (lambda: GemmaRMSNorm(4, -1e-6), ValueError, r"GemmaRMSNorm\(eps=-1e-06\)"),
        (lambda: RMSNorm(4, True), TypeError, r"RMSNorm\(eps=True\): eps must be a number"),
        (lambda: RMSNorm(0), ValueError, r"RMSNorm\(hidden_size=0\): hidden_size must be at "
                                         "least 1"),
        (lambda: VocabParallelEmbedding(0, 4, par.tp_group), ValueError,
         r"VocabParallelEmbedding\(vocab_size=0\): vocab_size must be at least 1"),
        (lambda: ParallelLMHead(8, -4, par.tp_group), ValueError,
         r"ParallelLMHead\(hidden_size=-4\)"),
        (lambda: QuantizedRead(0), ValueError, r"QuantizedRead\(group=0\)"),
        (lambda: QuantizedRead(2.5), TypeError, r"QuantizedRead\(group=2.5\)"),
        (lambda: token_bucket(-1), ValueError, r"token_bucket\(tokens=-1\)"),
        (lambda: ForwardBatch.build(extend, [[1, 2], [3]], [0]), ValueError,
         r"ForwardBatch.build: prefix_lens \[0\] must give each of the 2 requests"),
        (lambda: ForwardBatch.build(extend, [[1]], [-1]), ValueError,
         r"ForwardBatch.build: prefix_lens \[-1\]"),
        (lambda: ForwardBatch.build(extend, [[1], [2]], [0, 0], req_slots=[0, 0]), ValueError,
         r"ForwardBatch.build: req_slots \[0, 0\] must give each of the 2 requests its own"),
        (lambda: ForwardBatch.build("extend", [[1]], [0]), TypeError,
         r"ForwardBatch.build\(forward_mode='extend'\)"),
        (lambda: PostNormAdd("norm", name="x"), TypeError, r"PostNormAdd\(norm='norm'\)"),
        (lambda: BoundaryRuntime(par, batch_variants=("ordinary",)), TypeError,
         r"BoundaryRuntime\(batch_variants=\('ordinary',\)\): batch_variants must be a "
         "non-empty tuple of BatchVariant"),
        (lambda: BoundaryRuntime(par, pp_layers=(0,)), TypeError,
         r"BoundaryRuntime\(pp_layers=\(0,\)\)"),
        (lambda: tbo_decision("always", ((4,),), None), TypeError,
         r"tbo_decision\(policy='always'\): policy must be a TboPolicy"),
    ]


def test_numbers_sizes_and_batches_are_refused_by_name():
    """What each took silently (or ended in a raw torch error): a NaN eps made every output
    NaN (a negative one, a bool, an infinite one ran too); an embedding had 0 rows;
    QuantizedRead took any group; token_bucket a negative count; build dropped the requests
    without a prefix length (zip), took a negative prefix, a slot twice, a mode by its
    string; PostNormAdd a string for its norm (failing at the first forward);
    BoundaryRuntime a variant by its string (no stage built its path); tbo_decision a
    policy by its string (read as "one rank": never split)."""
    for call, error, message in _numeric_calls():
        with pytest.raises(error, match="^" + message):
            call()


def test_a_provider_that_is_not_one_is_refused_before_any_stage_takes_it():
    """install_fusion(model, "reference") set the string on the first stage, then failed
    rebuilding its plan with an AttributeError: the model was left half-changed."""
    from layer_boundary import install_fusion, stage_boundaries
    from layer_boundary.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = Qwen3ForCausalLM(cfg, BoundaryRuntime(build_parallel(ParallelDims())))
    before = [s.fusions for s in stage_boundaries(model)]
    with pytest.raises(TypeError, match=r"^install_fusion\(provider='reference'\): not a "
                                        "fusion provider"):
        install_fusion(model, "reference")
    assert [s.fusions for s in stage_boundaries(model)] == before
