"""CUDA graphs in a run: where they run is decided at construction from what every rank has
(never around a gloo collective), and the captured decode forward replays each bucket's graph
on the step's own inputs.

No GPU here: the decision is driven with a CUDA device string and real gloo groups, and the
captured forward's bookkeeping (the bucket a step replays, the inputs copied into the captured
batch, the ledger a replay repeats, the row facts it hands back) runs with ``Rerun``, a CPU
stand-in whose replay runs the forward again on the captured batch's tensors: a step whose
inputs were not copied there would give the previous step's numbers.
``scripts/gpu_check.py`` captures real graphs on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from distributed.pool import get_pool

from layer_boundary.engine import runner
from layer_boundary.engine.generate import greedy_generate
from layer_boundary.engine.compiled import compile_forward
from layer_boundary.engine.graphs import (CapturedDecode, GraphDecision, Graphs, decide_graphs,
                                          decode_step)
from layer_boundary.engine.report import graphs_line
from layer_boundary.engine.runner import RunSpec, make_runtime
from layer_boundary.models import load_model
from layer_boundary.runtime import token_bucket
from layer_boundary.runtime.ledger import LEDGER
from layer_boundary.runtime.parallel import ParallelDims, build_parallel


class _Replay:
    def __init__(self, forward, out) -> None:
        self.forward, self.out = forward, out

    def replay(self) -> None:
        with LEDGER.paused():  # a real replay runs no Python: nothing is recorded
            self.out.copy_(self.forward())


class Rerun:
    """``CudaCapture``'s stand-in on the CPU: capturing runs the forward once (its Python
    records what a capture's would; a real capture computes nothing), and the graph it
    returns reruns the forward on the captured batch into the captured output tensor."""

    def __init__(self) -> None:
        self.warmups = 0

    def warm_up(self, forward) -> None:
        self.warmups += 1
        forward()

    def record(self, forward):
        out = forward()
        return _Replay(forward, out), out

    def recover(self) -> None:
        pass


# ------------------------------------------------------------------ the decision


def test_graphs_are_decided_from_the_device_the_flag_the_backend_and_the_batches():
    world1 = build_parallel(ParallelDims())
    spec = RunSpec("m", device="cuda")
    assert decide_graphs(spec, world1, pads=True).graphs is Graphs.CAPTURED
    assert decide_graphs(replace(spec, compile="inductor"), world1, True).graphs is Graphs.INDUCTOR
    off = {
        "CUDA graphs run on --device cuda only": (replace(spec, device="cpu"), True),
        "--disable-cuda-graph (or --enforce-eager) asked": (replace(spec, cuda_graph=False),
                                                            True),
        "the model's cache cannot serve padded batches (a graph is one batch shape)":
            (spec, False),
        "the aot_eager compile backend captures no graphs (inductor does)":
            (replace(spec, compile="aot_eager"), True),
        "two-batch overlap splits each forward by its requests":
            (replace(spec, tbo=runner.TboPolicy.ALWAYS), True),
        "the all-to-all MoE sizes its dispatch on the host":
            (replace(spec, moe_a2a_backend="all_to_all"), True),
        "batch-invariant attention runs a request a call, which a padded step does not":
            (replace(spec, batch_invariant=True), True),
        "tracing the residual stream runs Python each forward": (replace(spec, trace=True), True),
    }
    for why, (case, pads) in off.items():
        assert decide_graphs(case, world1, pads) == GraphDecision(Graphs.OFF, why)


def _compiled_by_the_run(spec, model, parallel):
    """``run_forward``'s choice for ``spec`` (the one ``run_rank`` makes), and the options it
    handed torch.compile (nothing is compiled)."""
    given = {}
    real = torch.compile
    torch.compile = lambda fn, **kwargs: given.update(kwargs) or fn
    try:
        run = runner.run_forward(spec, model, parallel)
    finally:
        torch.compile = real
    return run, given["options"]


def decision_over_ranks(path: str, spec_fields: dict):
    """On a pool rank: a CUDA run's choice over this world's gloo groups (the ranks' own
    device is the CPU: only the spec names CUDA), the options torch.compile was handed, and
    the rank's CUDA-graph summary as the run reports it."""
    world = torch.distributed.get_world_size()
    spec = RunSpec(path, tp=world, **spec_fields)
    runtime = make_runtime(spec, world)
    run, options = _compiled_by_the_run(spec, load_model(path, runtime), runtime.parallel)
    return run.decision, "triton.cudagraphs" in options, runner.graphs_summary(
        run.decision, run.captured, run.skips)


@pytest.mark.parametrize("fields", [{}, {"dp": 2, "boundary_reduction": "rsv"}],
                         ids=["tp2", "tp2-dp2-rsv"])
def test_compile_on_cuda_over_gloo_runs_without_graphs_and_the_report_says_why(qwen3_dir,
                                                                             fields):
    """The regression of a rank killed by SIGSEGV on an H200: inductor's CUDA graphs around
    gloo collectives. Decided at construction from the groups' backend, on every rank."""
    fields = dict(fields, device="cuda", compile="inductor")
    results = get_pool(2).run(decision_over_ranks, str(qwen3_dir), fields)
    why = ("the tp group's collectives run on gloo, which a CUDA graph cannot hold (ranks "
           "sharing a GPU); NCCL's can")
    for decision, cudagraphs, reported in results:
        assert decision == GraphDecision(Graphs.OFF, why)
        assert not cudagraphs
        assert reported == {"mode": "off", "why": why}
        assert graphs_line(reported) == f"CUDA graphs: off: {why}"


def test_compile_on_cuda_at_world1_keeps_inductors_graphs(qwen3_dir):
    spec = RunSpec(str(qwen3_dir), device="cuda", compile="inductor")
    runtime = make_runtime(spec)
    run, options = _compiled_by_the_run(spec, load_model(str(qwen3_dir), runtime),
                                        runtime.parallel)
    assert run.decision.graphs is Graphs.INDUCTOR and run.pads
    assert options["triton.cudagraphs"] is True
    with run.skips as skips:  # inductor's reasons for skipping a graph, as it logs them
        from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 "
                                            "instances)")
    assert runner.graphs_summary(run.decision, None, skips)["skipped"] == [
        "skipping cudagraphs due to mutated inputs (2 instances)"]


# ------------------------------------------------------------------ the captured forward


PROMPTS = [[5, 1, 4], [2, 7], [9, 3, 6, 8], [4]]


def _generate(path: str, policy: str, captured: bool, prompts, steps: int = 4,
              compiled: bool = False):
    """Greedy tokens, logits and per-step ledger of this rank's requests: decode steps padded
    to their bucket, eagerly or through ``CapturedDecode`` with ``Rerun`` (``compiled``: the
    graphs hold the step compiled, by dynamo's eager backend here)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dp = 2 if world > 1 else 1
    spec = RunSpec(path, tp=world, dp=dp, boundary_reduction=policy)
    runtime = make_runtime(spec, world)
    par = runtime.parallel
    model = load_model(path, runtime)
    step = compile_forward(model, "eager", padded=True) if compiled else None
    forward = CapturedDecode(model, step, capture=Rerun()) if captured else model
    with torch.no_grad(), LEDGER.recording() as entries:
        gen = greedy_generate(forward, prompts, steps, dp=par.dims.attn_dp,
                              dp_rank=par.attn_dp_rank, bucket=token_bucket, pad_prefill=False,
                              on_step=lambda step: setattr(LEDGER, "step", step))
    graphs = (forward.buckets, forward.replays, forward.capture.warmups) if captured else None
    return gen, [(e.step, e.kind, e.group, e.numel) for e in entries], graphs


def captured_against_eager(path: str, policy: str, prompts):
    return (_generate(path, policy, False, prompts), _generate(path, policy, True, prompts))


def _same(eager, captured) -> None:
    (gen, ledger, _), (cgen, cledger, _) = eager, captured
    assert cgen.generated == gen.generated
    for a, b in zip(gen.logits, cgen.logits):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert cledger == ledger  # each replay repeats what its capture recorded


def test_the_captured_decode_replays_each_bucket_on_the_steps_own_inputs(qwen3_dir):
    eager, captured = captured_against_eager(str(qwen3_dir), "ar", PROMPTS)
    _same(eager, captured)
    buckets, replays, warmups = captured[2]
    assert buckets == [4] and replays == 2 and warmups == 1  # steps 2 and 3 replay step 1's


@pytest.mark.parametrize("policy", ["ar", "rs", "rsv"])
@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["both-dp-ranks", "empty-dp-rank"])
def test_the_captured_decode_across_ranks(qwen3_dir, policy, prompts):
    """tp 2 with attention DP 2: each DP rank's steps padded to the same bucket (a rank with
    no requests pads its every row), replayed, equal to the eager padded steps."""
    for eager, captured in get_pool(2).run(captured_against_eager, str(qwen3_dir), policy,
                                           prompts):
        _same(eager, captured)
        assert captured[2][1] == 2


def test_the_captured_decode_of_a_compiled_step(qwen3_dir):
    """What ``run --device cuda`` captures by default: the decode step compiled (inductor on
    a GPU; dynamo's eager backend here, the same traced graph), the prefill eager."""
    torch._dynamo.reset()
    eager = _generate(str(qwen3_dir), "ar", False, PROMPTS)
    captured = _generate(str(qwen3_dir), "ar", True, PROMPTS, compiled=True)
    _same(eager, captured)
    assert captured[2][:2] == ([4], 2)


def test_the_decode_step_a_graph_holds(qwen3_dir):
    model = load_model(str(qwen3_dir), make_runtime(RunSpec(str(qwen3_dir))))
    assert decode_step(RunSpec("m", captured_decode="eager"), model) == (model, "eager")
    step, name = decode_step(RunSpec("m"), model)
    assert name == "inductor" and step is not model


def test_a_prefill_and_an_unpadded_step_run_eagerly(qwen3_dir):
    model = load_model(str(qwen3_dir), make_runtime(RunSpec(str(qwen3_dir))))
    forward = CapturedDecode(model, capture=Rerun())
    with torch.no_grad():
        gen = greedy_generate(forward, PROMPTS, 3)  # nothing padded
    assert forward.buckets == [] and forward.replays == 0
    assert gen.generated == greedy_generate(model, PROMPTS, 3).generated


class _Refusing(Rerun):
    def record(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


def test_a_capture_that_fails_turns_the_graphs_off_and_says_why(qwen3_dir):
    model = load_model(str(qwen3_dir), make_runtime(RunSpec(str(qwen3_dir))))
    forward = CapturedDecode(model, capture=_Refusing())
    with torch.no_grad():
        gen = greedy_generate(forward, PROMPTS, 3, bucket=token_bucket, pad_prefill=False)
        want = greedy_generate(model, PROMPTS, 3)
    assert gen.generated == want.generated
    assert forward.failed == ("capturing the 4-row decode bucket failed (operation not "
                              "permitted when stream is capturing); decode ran eagerly")
    summary = runner.graphs_summary(GraphDecision(Graphs.CAPTURED, "x"), forward, None)
    assert summary == {"mode": "off", "why": forward.failed, "step": "eager", "buckets": [],
                       "replays": 0}


# ------------------------------------------------------------------ the command line


def test_run_help_shows_the_flags_that_turn_graphs_off():
    from layer_boundary.engine.args import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    text = run.format_help()
    assert "--disable-cuda-graph, --enforce-eager" in text
    assert "--captured-decode {inductor,eager}" in text
    for flag in ("--disable-cuda-graph", "--enforce-eager"):
        assert run.parse_args([flag]).disable_cuda_graph is True
    assert run.parse_args([]).captured_decode is None  # inductor, where graphs run


@pytest.mark.parametrize("flag", [["--disable-cuda-graph"], ["--captured-decode", "eager"]])
def test_on_the_cpu_the_flag_is_ignored_by_name(flag, capsys, restore_logger):
    """``--captured-decode eager`` on the CPU was ignored silently."""
    from distributed.checks import cli

    code, out = cli(["run", "--tp", "1", "--max-new-tokens", "1", *flag], capsys)
    assert code == 0
    assert out.splitlines()[0] == (f"note: {' '.join(flag)} ignored: the CPU runs no CUDA "
                                   "graphs")
    assert "CUDA graphs" not in out.split("\n", 1)[1]  # nothing else about graphs on the CPU
