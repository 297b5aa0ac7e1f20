"""examples/engine_loop.py, the continuous-batching loop of docs/engine-integration.md:
requests arriving and leaving between forwards, mixed prefill and decode batches, freed
KV-cache slots reused. Each request's tokens and logits must be what it gets alone
(``greedy_generate`` of that request at world 1), at world 1 and on two gloo ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed.pool import get_pool

import engine_loop
from layer_boundary.models import load_model
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.runtime import BoundaryRuntime, ParallelDims, build_parallel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine_loop.py"


def _alone(model_dir) -> dict:
    model = load_model(str(model_dir), BoundaryRuntime(build_parallel(ParallelDims())))
    out = {}
    for requests in engine_loop.demo_schedule(model.config.vocab_size).values():
        for r in requests:
            gen = greedy_generate(model, [r.prompt], r.max_new_tokens)
            out[r.rid] = (gen.generated[0], gen.logits[0])
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], f"request {rid}: tokens {got[rid][0]} != {want[rid][0]}"
        for step, (a, b) in enumerate(zip(got[rid][1], want[rid][1])):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0,
                                       msg=lambda m: f"request {rid} step {step}: {m}")


def test_the_schedule_exercises_arrival_departure_and_slot_reuse():
    schedule = engine_loop.demo_schedule(96)
    requests = [r for rs in schedule.values() for r in rs]
    assert len(requests) > 4  # more requests than slots: some wait, slots are reused
    assert len({r.max_new_tokens for r in requests}) > 2  # they leave at different steps


def test_the_engine_loop_gives_each_request_what_it_gets_alone(qwen3_dir):
    _assert_same(engine_loop.run_rank(str(qwen3_dir), 1), _alone(qwen3_dir))


@pytest.mark.timeout(120)
def test_the_engine_loop_on_two_ranks_matches_world1(qwen3_dir):
    results = get_pool(2).run(engine_loop.run_rank, str(qwen3_dir), 2, timeout=100)
    want = _alone(qwen3_dir)
    for rank in results:
        _assert_same(rank, want)


@pytest.mark.timeout(120)
def test_the_example_runs_as_a_script(qwen3_dir):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(qwen3_dir), "--tp", "2"],
                         capture_output=True, text=True, check=True, timeout=100).stdout
    want = _alone(qwen3_dir)
    assert out.splitlines() == [f"request {rid}: {want[rid][0]}" for rid in sorted(want)]
