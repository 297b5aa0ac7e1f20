"""residual.batch accessors on a real owed attention sum, at world 1 and on 2 gloo ranks.

Each accessor's result is checked against the formula built from every rank's partial output,
and the ledger shows the owed sum completed exactly where the accessor says.
"""

from __future__ import annotations

import pytest
import torch
from distributed.pool import get_pool
from toy import HIDDEN, ToyLayer, batch, runtime

from layer_boundary.residual import batch as residual_batch
from layer_boundary.residual.stream import StreamState
from layer_boundary.runtime.ledger import LEDGER

ACCESSORS = ["complete_output", "fold", "snapshot", "add_to_output", "written", "take_output"]


def inputs():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(3, HIDDEN, generator=gen), torch.randn(3, HIDDEN, generator=gen)


def scenario(name: str, tp: int) -> dict:
    rt = runtime(tp)
    layer = ToyLayer(rt, 0, 2)
    fb = batch(3)
    x, extra = inputs()
    residual_batch.start(fb)
    h = layer.attn.prepare(x, fb)
    partial = layer.attn_compute(h)
    h = layer.attn.finish(partial, fb)
    out = {"partial": partial.clone()}
    with LEDGER.recording() as ledger:
        if name == "complete_output":
            completed = residual_batch.complete_output(h, fb)
            out["value"], out["state"] = completed.clone(), fb.residual_stream.state
            out["input"] = layer.ffn.prepare(completed, fb)
        elif name == "fold":
            folded = residual_batch.fold(h, fb)
            out["value"], out["state"] = folded.clone(), fb.residual_stream.state
            out["input"] = layer.ffn.prepare(folded, fb)
        elif name == "snapshot":
            out["value"] = residual_batch.snapshot(h, fb)
            out["state"] = fb.residual_stream.state
            out["input"] = layer.ffn.prepare(h, fb)
        elif name == "add_to_output":
            added = residual_batch.add_to_output(h, fb, extra)
            out["value"], out["state"] = added.clone(), fb.residual_stream.state
            out["input"] = layer.ffn.prepare(added, fb)
        elif name == "written":
            w = residual_batch.written(extra.clone(), fb)
            out["value"], out["state"] = w.clone(), fb.residual_stream.state
            out["input"] = layer.ffn.prepare(w, fb)
        elif name == "take_output":
            folded = residual_batch.fold(h, fb)
            out["value"] = residual_batch.take_output(folded, fb)
            out["state"] = None if fb.residual_stream is None else fb.residual_stream.state
    out["all_reduces"] = [e.site for e in ledger if e.kind == "all_reduce"]
    return out


def expected(name: str, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, object, int]:
    """(accessor value, next prepare's input, stream state after the accessor, owed sums run)."""
    x, extra = inputs()
    norm = ToyLayer(runtime(1), 0, 2).ffn_norm
    read = lambda r: norm.normalize_fp32(r.float(), torch.float32)  # noqa: E731
    return {
        "complete_output": (total, read(x + total), StreamState.PENDING, 1),
        "fold": (x + total, read(x + total), StreamState.WRITTEN, 1),
        "snapshot": (x + total, read(x + total), StreamState.PENDING, 2),  # copy + main
        "add_to_output": (total + extra, read(x + total + extra), StreamState.PENDING, 1),
        "written": (extra, read(extra), StreamState.WRITTEN, 0),
        "take_output": (x + total, None, None, 1),
    }[name]


def check(name: str, results: list[dict]) -> None:
    total = sum(r["partial"] for r in results)
    value, prepared, state, sums = expected(name, total)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["value"], value, atol=1e-6, rtol=0, msg=f"rank {rank}")
        if prepared is not None:
            torch.testing.assert_close(r["input"], prepared, atol=1e-5, rtol=0)
        assert r["state"] == state
        if len(results) > 1:
            assert len(r["all_reduces"]) == sums, r["all_reduces"]


@pytest.mark.parametrize("name", ACCESSORS)
def test_accessor_world1(name):
    check(name, [scenario(name, 1)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ACCESSORS)
def test_accessor_on_two_ranks(name):
    check(name, get_pool(2).run(scenario, name, 2))
