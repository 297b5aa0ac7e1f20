"""The overhead benchmark compares like with like: its hand-written forward must produce the
boundary-integrated decoder's logits (the benchmark asserts it), so this runs it once, tiny,
and checks the report; no timing is asserted."""

from distributed.checks import cli_ok
from layer_boundary.bench import overhead
from layer_boundary.cli import main


def test_overhead_benchmark_runs_the_same_math_both_ways():
    result = overhead(hidden=64, layers=2, requests=2, prefix=4, repeats=1)
    assert result["boundary_ms"] > 0 and result["hand_written_ms"] > 0
    assert set(result) == {"hidden", "layers", "requests", "compile", "boundary_ms",
                           "hand_written_ms", "overhead", "per_stage_us"}


def test_compiled_benchmark_compares_compiled_forwards():
    # the eager backend traces both forwards fullgraph (a graph break would raise) and checks
    # they give the same logits before timing
    result = overhead(hidden=64, layers=2, requests=1, prefix=4, repeats=1, compile="eager")
    assert result["compile"] == "eager" and result["boundary_ms"] > 0


def test_bench_command(capsys):
    out = cli_ok(["bench", "--hidden", "64", "--layers", "2", "--requests", "2",
                  "--repeats", "1"], capsys)
    assert "overhead" in out
