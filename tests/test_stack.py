"""The layer stack owns construction order, neighbours and branches; nothing process-wide
does. Two stacks built interleaved on one runtime (a target and its draft) each check only
their own neighbours and run against world 1; runtimes with equal fields are one runtime;
``append_stages`` supplies ``previous`` and ``terminal`` and binds a stage once its consumer
is known."""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, DpBatch, ToyLayer, ToyStack, runtime, seeded, toy_norm

from layer_boundary import (LayerStack, append_stages, declare_attn, declare_ffn, layer_stack,
                            make_stages)
from layer_boundary.construction import UnsupportedBoundary
from layer_boundary.residual import batch as residual_batch
from layer_boundary.runtime import BoundaryRuntime

TARGET, DRAFT = 3, 2


def _interleaved(rt):
    """Target (dense) layer 0, draft (sparse FFNs) layer 0, target layer 1, ... on one runtime,
    each into its own stack."""
    target, draft = LayerStack(rt), LayerStack(rt)
    layers = {"target": [], "draft": []}
    for i in range(TARGET):
        layers["target"].append(ToyLayer(rt, i, TARGET, stack=target))
        if i < DRAFT:
            layers["draft"].append(ToyLayer(rt, 10 + i, DRAFT, ffn_sparse=True, stack=draft,
                                            first=10))
    target.close()
    draft.close()
    return layers, (target, draft)


def _forward(layers, rt, counts, seed):
    b = DpBatch(counts, rt)
    residual_batch.start(b.fb)
    h = b.mine(seeded((sum(counts), HIDDEN), seed))
    for layer in layers:
        h = layer.forward_layer(h, b.fb)
    return residual_batch.norm(h, b.fb, toy_norm(300)), (b.rows.start, b.rows.stop), b.fb


def run(tp: int, dp: int, policy: str, counts, interleaved: bool) -> dict:
    rt = runtime(tp, dp, boundary_reduction=policy)
    if interleaved:
        layers, stacks = _interleaved(rt)
        orders = [[s.name for s in stack.stages] for stack in stacks]
    else:  # world 1's reference: each stack on its own
        with layer_stack(rt):
            target = [ToyLayer(rt, i, TARGET) for i in range(TARGET)]
        with layer_stack(rt):
            draft = [ToyLayer(rt, 10 + i, DRAFT, ffn_sparse=True, first=10) for i in range(DRAFT)]
        layers, orders = {"target": target, "draft": draft}, None
    out = {"orders": orders}
    for which, seed in (("target", 1), ("draft", 2)):
        out[which], out["rows"], fb = _forward(layers[which], rt, counts, seed)
        out["mode"] = fb.rows.mode.value
    return out


CASES = [(1, 1, "ar", (5,)), (2, 1, "rs", (5,)), (4, 2, "ar", (5, 3)), (4, 2, "rsv", (5, 0)),
         (4, 2, "rs", (0, 4))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,dp,policy,counts", CASES,
                         ids=[f"tp{t}-dp{d}-{p}-{'_'.join(map(str, c))}" for t, d, p, c in CASES])
def test_a_target_and_a_draft_built_interleaved_run_against_world1(tp, dp, policy, counts):
    ref = run(1, 1, "ar", counts, False)
    results = get_pool(tp).run(run, tp, dp, policy, counts, True) if tp > 1 else [
        run(1, 1, policy, counts, True)]
    for rank, r in enumerate(results):
        assert r["mode"] == policy
        assert r["orders"] == [[f"layer{i}.{k}" for i in range(TARGET) for k in ("attn", "ffn")],
                               [f"layer{10 + i}.{k}" for i in range(DRAFT)
                                for k in ("attn", "ffn")]]
        for which in ("target", "draft"):
            torch.testing.assert_close(r[which], ref[which][slice(*r["rows"])], atol=1e-5,
                                       rtol=0, msg=lambda m: f"rank {rank} {which}: {m}")


def test_stacks_on_runtimes_with_equal_fields_build_interleaved():
    """Two BoundaryRuntime objects with equal fields no longer share anything: a dense stack
    on one and a sparse stack on the other, built layer by layer in turn, each run against
    the same stack built alone. (One forward still runs on one runtime object.)"""
    rt = runtime()
    twin = BoundaryRuntime(rt.parallel)
    assert twin == rt and twin is not rt
    dense, sparse = LayerStack(rt), LayerStack(twin)
    layers = {"dense": [], "sparse": []}
    for i in range(2):
        layers["dense"].append(ToyLayer(rt, i, 2, stack=dense))
        layers["sparse"].append(ToyLayer(twin, i, 2, ffn_sparse=True, stack=sparse))
    dense.close()
    sparse.close()
    with layer_stack(rt):
        alone = [ToyLayer(rt, i, 2, ffn_sparse=True) for i in range(2)]
    torch.testing.assert_close(_forward(layers["sparse"], twin, (4,), 3)[0],
                               _forward(alone, rt, (4,), 3)[0], atol=0, rtol=0)
    with layer_stack(rt):
        alone = [ToyLayer(rt, i, 2) for i in range(2)]
    torch.testing.assert_close(_forward(layers["dense"], rt, (4,), 3)[0],
                               _forward(alone, rt, (4,), 3)[0], atol=0, rtol=0)


def test_append_stages_supplies_the_neighbours():
    """append_stages: each stage's previous is the stage appended before it (detached), the
    last one is terminal when the stack closes, and a stage binds once its consumer is known
    (using it before raises, naming it)."""
    rt = runtime()
    with layer_stack(rt, name="m") as stack:
        a0, f0 = append_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)),
                               name="layer0")
        with pytest.raises(RuntimeError, match="^stage layer0.ffn is not bound yet"):
            f0.describe()
        a1, f1 = append_stages((declare_attn(), toy_norm(2)),
                               (declare_ffn(sparse=True), toy_norm(3)), name="layer1")
        assert f0.describe()["exit"]  # bound once layer1's attention appended
    assert stack.first is a0 and stack.last is f1 and stack.stages == [a0, f0, a1, f1]
    assert a1.declaration.previous == declare_ffn() and a0.declaration.previous is None
    assert f1.declaration.terminal and not f0.declaration.terminal
    assert f0.following == declare_attn()
    # the same stack through append_stages equals the one make_stages builds by hand
    stages = []
    with layer_stack(rt):
        stages += make_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)),
                              name="layer0", runtime=rt)
        stages += make_stages((declare_attn(), toy_norm(2)),
                              (declare_ffn(sparse=True), toy_norm(3)), previous=declare_ffn(),
                              terminal=True, name="layer1", runtime=rt)
    for mine, theirs in zip(stack.stages, stages):
        assert mine.describe() == theirs.describe()


def test_a_stack_stage_outside_a_stack_and_a_closed_stack():
    rt = runtime()
    with pytest.raises(RuntimeError, match="^append_stages needs an open layer stack"):
        append_stages((declare_attn(), toy_norm(0)))
    with layer_stack(rt) as stack:
        append_stages((declare_attn(), toy_norm(0)))
    with pytest.raises(RuntimeError, match="^this layer stack is closed"):
        stack.append((declare_ffn(), toy_norm(1)))
    with layer_stack(rt):
        with pytest.raises(UnsupportedBoundary, match="prepared_from must be the declaration of "
                                                      "a stage already on this layer stack"):
            append_stages((declare_ffn(), toy_norm(1)), prepared_from=declare_ffn())


def test_declare_ffn_accepts_upstreams_next_layer_sparse():
    assert declare_ffn(sparse=True, next_layer_sparse=True) == declare_ffn(sparse=True,
                                                                          next_sparse=True)
    with pytest.raises(ValueError, match="name the same fact"):
        declare_ffn(next_sparse=True, next_layer_sparse=False)


def test_a_model_s_stack_is_its_pipeline_receiver():
    stack = ToyStack(runtime(), 2).stack
    assert stack.first.name == "layer0.attn" and stack.last.name == "layer1.ffn"


# -- neighbours across a pipeline cut, and per-layer transforms


def _pp_runtime(rank: int, pp: int = 2) -> BoundaryRuntime:
    """Pipeline rank ``rank``'s view of a pp-rank topology (plans only, no processes)."""
    from layer_boundary.runtime import ParallelDims
    from layer_boundary.runtime.parallel import virtual_parallel

    return BoundaryRuntime(virtual_parallel(ParallelDims(world_size=pp, pp=pp), rank))


def test_a_stack_on_a_pipeline_rank_must_know_its_neighbours_there():
    """A stack that would start the model's stack on a later pipeline rank, or end it on an
    earlier one, is refused by name before its stage is built; given the neighbours, both
    ranks' stages say the cut as it is."""
    with layer_stack(_pp_runtime(1)):
        with pytest.raises(UnsupportedBoundary, match="^stage layer2.attn would enter the "
                           "model's stack \\(previous=None\\) on pipeline rank 1 of 2: .* open "
                           "this rank's layer_stack with previous="):
            append_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)),
                          name="layer2")
    with pytest.raises(UnsupportedBoundary, match="^stage layer1.ffn would end the model's stack "
                       "\\(terminal\\) on pipeline rank 0 of 2: .* following="):
        with layer_stack(_pp_runtime(0)):
            append_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)),
                          name="layer1")
    with layer_stack(_pp_runtime(0), following=declare_attn()) as sender:
        append_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)), name="l0")
    with layer_stack(_pp_runtime(1), previous=declare_ffn()) as receiver:
        append_stages((declare_attn(), toy_norm(0)), (declare_ffn(), toy_norm(1)), name="l1")
    assert not sender.last.declaration.terminal and receiver.last.declaration.terminal
    assert sender.last.following.facts() == receiver.first.declaration.facts()
    assert receiver.first.declaration.previous.facts() == sender.last.declaration.facts()
    with pytest.raises(TypeError, match="layer_stack previous= takes a StageDeclaration"):
        LayerStack(runtime(), previous=toy_norm(0))


def _post_norm(seed: int, **kwargs):
    """A per-layer post-norm: an after-sum transform holding its own weights."""
    from layer_boundary import OutputTransform

    return OutputTransform(toy_norm(seed), before_reduce_scatter=False, name=f"post{seed}",
                           **kwargs)


def test_neighbours_compare_what_a_stage_does_not_its_per_layer_transform():
    """Each layer's post-norm is its own object (its own weights), and a neighbour rebuilt
    elsewhere holds yet another: the stack accepts a previous whose transform is another
    object doing the same (after the sum, not portable), and refuses one in the other order
    or with another update, naming the fact."""
    from layer_boundary import OutputTransform

    rt = runtime()
    built = declare_ffn(output_transform=_post_norm(1))
    said = declare_ffn(output_transform=_post_norm(2))
    assert built.residual.update == said.residual.update  # TransformedUpdate: what it does
    assert built.output_transform is not said.output_transform
    with layer_stack(rt):
        make_stages((declare_attn(), toy_norm(0)), (built, toy_norm(1)), name="layer0",
                    runtime=rt)
        make_stages((declare_attn(), toy_norm(2)), (declare_ffn(), toy_norm(3)),
                    previous=said, terminal=True, name="layer1", runtime=rt)
    before = declare_ffn(output_transform=OutputTransform(lambda x: 0.5 * x,
                                                          before_reduce_scatter=True))
    update = ("update (declared PlainAdd [plain, portable], built TransformedUpdate(PlainAdd) "
              "[no capability declared])")
    for wrong, fact in ((before, f"output_transform (declared 'before the sum', built 'after "
                                 f"the sum'); {update}"),
                        (declare_ffn(), f"output_transform (declared None, built 'after the "
                                        f"sum'); {update}")):
        with layer_stack(rt):
            make_stages((declare_attn(), toy_norm(0)), (built, toy_norm(1)), name="layer0",
                        runtime=rt)
            with pytest.raises(UnsupportedBoundary) as info:
                make_stages((declare_attn(), toy_norm(2)), (declare_ffn(), toy_norm(3)),
                            previous=wrong, terminal=True, name="layer1", runtime=rt)
        assert str(info.value).endswith(f"they differ in {fact}")


def test_a_per_layer_transform_is_not_portable_across_a_cut():
    """A transform holding parameters cannot claim that a copy on another rank applies it
    identically; a PARTIAL attention with one, cut right after it, is refused by name on the
    receiving rank at construction (its copy would complete the sum without the weights). A
    stateless transform that says it is portable crosses."""
    from layer_boundary import OutputTransform

    with pytest.raises(ValueError, match="^OutputTransform post1: portable=True, but it holds "
                                         "parameters"):
        _post_norm(1, portable=True)
    assert not declare_attn(output_transform=_post_norm(1)).residual.update.portable
    with layer_stack(_pp_runtime(1), previous=declare_attn(output_transform=_post_norm(1))):
        with pytest.raises(UnsupportedBoundary, match="^stage layer0.ffn: its producer on "
                           "pipeline rank 0 \\(attention \\(PARTIAL\\) with update "
                           "OutputTransform\\(post1, after the sum\\) then PlainAdd\\(\\)\\) "
                           "leaves a declared partial sum .* is not portable"):
            append_stages((declare_ffn(), toy_norm(0)), name="layer0")
    stateless = OutputTransform(torch.tanh, before_reduce_scatter=False, portable=True)
    with layer_stack(_pp_runtime(1), previous=declare_attn(output_transform=stateless)) as s:
        append_stages((declare_ffn(), toy_norm(0)), name="layer0")
    assert s.first.declaration.previous.residual.update.portable


def test_append_stages_checks_next_sparse_against_the_next_ffn():
    """The stack supplies the producer, and its ``next_sparse`` must say what the next FFN
    appended is (the two-batch-overlap handoff rows derive from the pair)."""
    with layer_stack(runtime()):
        append_stages((declare_attn(), toy_norm(0)), (declare_ffn(next_sparse=True), toy_norm(1)))
        with pytest.raises(ValueError, match="^append_stages: previous declares next_sparse=True, "
                                             "but the next FFN \\(item 1\\) is declared "
                                             "sparse=False"):
            append_stages((declare_attn(), toy_norm(2)), (declare_ffn(), toy_norm(3)))
        append_stages((declare_attn(), toy_norm(2)), (declare_ffn(sparse=True), toy_norm(3)))
