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
            layers["draft"].append(ToyLayer(rt, 10 + i, DRAFT, ffn_sparse=True, stack=draft, first=10))
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
