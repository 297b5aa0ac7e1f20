"""Compiled forwards over padded batches: an engine pads each forward to its token bucket
(``ForwardBatch.padded``, ``runtime.token_bucket``), so one graph serves every batch of a
bucket, whatever its requests, prefixes or forward mode.

The loop below drives the compiled model as a server does (prefills of several shapes, some
continuing a cached prefix; decode steps over 1 to 8 live requests with ragged prefixes) and
checks each forward's real rows against the same forward run eagerly and unpadded on a cache
of its own, then counts the graphs dynamo built: one for each bucket no earlier test of
this module ran (they share one compiled forward), none for the others. A loop over 16
distinct batch sizes runs past the default recompile limit of 8 distinct shapes.
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import hf_qwen3
from torch._dynamo.utils import counters

from layer_boundary.construction import StagePlan
from layer_boundary.models import load_model
from layer_boundary.engine.generate import takes_padded_batches
from layer_boundary.engine.compiled import compile_forward
from layer_boundary.runtime import ForwardBatch, ForwardMode, token_bucket
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

SLOTS, ROWS = 8, 96  # requests the server holds, cache rows per request
# the ladder engines capture decode graphs on, written out: powers of two to 8, every 8 rows
# to 64, then powers of two
LADDER = [1, 2, 4, 8, *range(16, 65, 8), *(1 << k for k in range(7, 16))]


def ladder_bucket(rows: int) -> int:
    return next(b for b in LADDER if b >= rows)
SCRATCH = SLOTS  # the padding's slot


class Server:
    """The same model compiled and eager, each with its own KV cache; ``step`` runs one
    forward on both and returns the largest difference of the real rows' logits."""

    def __init__(self, model, compiled) -> None:
        self.model, self.compiled = model, compiled.forward
        self.caches = compiled.caches  # rows are rewritten: each request's prefix is its own
        self.lens = {}  # slot -> cached tokens
        self.forwards = []

    def step(self, mode, requests: dict[int, list[int]]) -> float:
        slots = list(requests)
        prefix = [self.lens.get(s, 0) for s in slots]
        tokens = [requests[s] for s in slots]
        eager, compiled = (ForwardBatch.build(mode, tokens, prefix, req_slots=slots, kv_cache=c)
                           for c in self.caches)
        rows = eager.num_tokens
        padded = compiled.padded(token_bucket(rows), scratch_slot=SCRATCH)
        with torch.no_grad():
            want = self.model(eager)
            got = self.compiled(padded)
        assert got.shape[0] == token_bucket(rows)
        for s, t in zip(slots, tokens):
            self.lens[s] = self.lens.get(s, 0) + len(t)
        self.forwards.append((mode.value, len(slots), rows))
        return (got[:rows] - want).abs().max().item() / max(1.0, want.abs().max().item())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = hf_qwen3(tmp_path_factory.mktemp("buckets"))
    return load_model(path, BoundaryRuntime(build_parallel(ParallelDims())))


class Compiled:
    """The model's compiled forward, shared by this module's tests (a bucket one test traced
    is not traced again), with the two KV caches its servers use and the buckets traced."""

    def __init__(self, model) -> None:
        torch._dynamo.reset()
        self.forward = compile_forward(model, "eager", padded=True)
        self.caches = [model.make_kv_cache(SLOTS + 1, ROWS) for _ in range(2)]
        self.buckets: set[int] = set()

    def first_seen(self, buckets) -> set[int]:
        """Those of ``buckets`` no earlier test ran (each must cost one graph, the others
        none); from now on all of them count as traced."""
        new = set(buckets) - self.buckets
        self.buckets |= new
        return new


@pytest.fixture(scope="module")
def compiled(model):
    return Compiled(model)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_the_qwen3_cache_serves_padded_batches(model):
    assert takes_padded_batches(model)


@pytest.mark.timeout(300)
def test_a_serving_loop_compiles_one_graph_per_bucket(model, compiled):
    before = _graphs()
    server, rng = Server(model, compiled), random.Random(0)
    token = lambda: rng.randrange(1, 96)  # noqa: E731 - the tiny vocabulary
    worst = 0.0
    # prefills of three shapes into slots 0-7 (5 + 2 + 9 = 16 rows, 20, then 3 + 30 = 33)
    worst = max(worst, server.step(ForwardMode.EXTEND, {0: [token() for _ in range(5)],
                                                        1: [token(), token()],
                                                        2: [token() for _ in range(9)]}))
    worst = max(worst, server.step(ForwardMode.EXTEND, {3: [token() for _ in range(20)]}))
    worst = max(worst, server.step(ForwardMode.EXTEND, {4: [token() for _ in range(3)],
                                                        5: [token() for _ in range(30)]}))
    # decode at 1..8 live requests, each a different subset, prefixes ragged
    for live in (1, 2, 3, 4, 5, 6, 8, 7, 3, 1):
        if live > 6:  # the last two requests join with short prefills first
            for s in (6, 7):
                if s not in server.lens:
                    worst = max(worst, server.step(ForwardMode.EXTEND, {s: [token()] * (s - 3)}))
        slots = rng.sample(sorted(server.lens), min(live, len(server.lens)))
        worst = max(worst, server.step(ForwardMode.DECODE, {s: [token()] for s in slots}))
    # a prefill that continues a cached prefix (chunked prefill) in a decode-sized bucket
    worst = max(worst, server.step(ForwardMode.EXTEND, {0: [token() for _ in range(6)]}))
    graphs = _graphs() - before
    buckets = sorted({token_bucket(rows) for _, _, rows in server.forwards})
    assert worst <= 1e-5, f"padded compiled logits differ by {worst:.3g} of the logit scale"
    assert len({live for mode, live, _ in server.forwards if mode == "decode"}) >= 7
    assert buckets == sorted({ladder_bucket(rows) for _, _, rows in server.forwards})
    assert len(buckets) < len({rows for _, _, rows in server.forwards})
    # one per bucket: prefill and decode share it
    new = compiled.first_seen(buckets)
    assert graphs == len(new), f"{graphs} graphs for new buckets {new} over {server.forwards}"


@pytest.mark.timeout(300)
def test_sixteen_distinct_batch_sizes_run_compiled(model, compiled):
    """16 distinct row counts (decode at 1-12 requests, prefills of 17, 29, 40 and 63 rows):
    without padding the ninth shape would hit dynamo's recompile limit."""
    before = _graphs()
    server, worst = Server(model, compiled), 0.0
    sizes = [17, 29, 40, 63]
    for s, n in zip(range(4), sizes):
        worst = max(worst, server.step(ForwardMode.EXTEND, {s: [3 + s] * n}))
    server.lens.update({s: 0 for s in range(4, SLOTS)})  # four more requests, empty so far
    seen = set(sizes)
    for live in range(1, 9):
        worst = max(worst, server.step(ForwardMode.DECODE,
                                       {s: [5 + live] for s in range(live)}))
        seen.add(live)
    for extra in (9, 10, 11, 12):  # rows beyond the live requests: a ragged chunked step
        worst = max(worst, server.step(ForwardMode.EXTEND,
                                       {s: [7] * (1 + (s < extra - 8)) for s in range(8)}))
        seen.add(extra)
    assert len(seen) == 16 and len(server.forwards) == 16
    assert worst <= 1e-5, f"padded compiled logits differ by {worst:.3g} of the logit scale"
    buckets = {ladder_bucket(n) for n in seen}
    assert len(buckets) < len(seen)
    assert _graphs() - before == len(compiled.first_seen(buckets))


def test_padding_refuses_what_it_cannot_pad(model):
    batch = ForwardBatch.build(ForwardMode.DECODE, [[1], [2]], [3, 4], req_slots=[0, 1],
                               dp_token_counts=(2, 5))
    with pytest.raises(ValueError, match="cannot pad to 4 rows: a DP rank holds 5"):
        batch.padded(4, scratch_slot=SCRATCH)
    with pytest.raises(ValueError, match="scratch slot 1 is a request's slot"):
        batch.padded(8, scratch_slot=1)
    batch.tbo = True
    with pytest.raises(ValueError, match="two-batch-overlap batch"):
        batch.padded(8, scratch_slot=SCRATCH)


def test_padding_rows_are_the_scratch_slot_at_position_zero(model):
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[4, 5], [6]], [3, 0], req_slots=[2, 0],
                               dp_token_counts=(3, 1))
    padded = batch.padded(16, scratch_slot=SCRATCH)
    assert padded.dp_token_counts == (16, 16) and padded.real_tokens == 3
    assert padded.token_slots.tolist() == [2, 2, 0] + [SCRATCH] * 13
    assert padded.positions.tolist() == [3, 4, 0] + [0] * 13
    assert padded.input_ids.tolist() == [4, 5, 6] + [0] * 13
    rows = [0, 1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65, 129, 5000]
    assert [token_bucket(n) for n in rows] == [1] + [ladder_bucket(n) for n in rows[1:]]


@pytest.mark.timeout(300)
def test_compiled_forwards_read_their_own_models_kept_placement(tmp_path_factory):
    """A static-shape trace keeps a new shape's row placement on the model's first plan and
    the graph reads it there (the facts of every call are that kept object, not rebuilt), so
    a second instance of the same class cannot run the first one's graph: it traces its own
    and gives its own eager numbers. Eager forwards of many other shapes do not push the
    kept entry out (no new graph after them)."""
    path = hf_qwen3(tmp_path_factory.mktemp("two_instances"), seed=3)
    runtime = BoundaryRuntime(build_parallel(ParallelDims()))
    for _instance in range(2):
        model = load_model(path, runtime)
        compiled = compile_forward(model, "eager", padded=True)
        caches = [model.make_kv_cache(3, 8) for _ in range(2)]
        plan, facts = model.model.layers[0].attn_boundary.plan, []
        for mode, tokens, prefix in (
                ((ForwardMode.EXTEND, [[5, 6], [7, 8]], [0, 0]),
                 (ForwardMode.DECODE, [[9], [4]], [2, 2]),
                 (ForwardMode.DECODE, [[3], [2]], [3, 3]))):
            eager, padded = (ForwardBatch.build(mode, tokens, prefix, req_slots=[0, 1],
                                                kv_cache=c) for c in caches)
            padded = padded.padded(token_bucket(eager.num_tokens), scratch_slot=2)
            with torch.no_grad():  # compiled first: nothing eager placed these counts
                got = compiled(padded)
                want = model(eager)
            torch.testing.assert_close(got[:eager.num_tokens], want, atol=1e-5, rtol=0)
            assert padded.row_facts is plan._traced[tuple(padded.dp_token_counts)][2]
            facts.append(padded.row_facts)
        assert facts[2] is facts[1]  # both decode steps run in the 2-row bucket
    # eager forwards of more shapes than the eager placements keep: the graph's entry stays
    long = model.make_kv_cache(1, StagePlan.PLACED_KEPT + 3)
    with torch.no_grad():
        for n in range(3, StagePlan.PLACED_KEPT + 4):  # never the decode's 2 rows
            model(ForwardBatch.build(ForwardMode.EXTEND, [[1] * n], [0], kv_cache=long))
        assert (2,) not in plan._placed  # the eager placement of the decode shape is gone
        before = _graphs()
        again = ForwardBatch.build(ForwardMode.DECODE, [[9], [4]], [2, 2], req_slots=[0, 1],
                                   kv_cache=caches[1]).padded(2, scratch_slot=2)
        compiled(again)
    assert _graphs() == before and again.row_facts is facts[1]
