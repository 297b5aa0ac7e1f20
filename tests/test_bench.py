"""The overhead benchmark compares like with like: its hand-written forward must produce the
boundary-integrated decoder's logits (the benchmark asserts it), so this runs it once, tiny,
and checks the report; no timing is asserted."""

import pytest
from distributed.checks import cli_ok
from layer_boundary.engine.bench import overhead


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
    # the smallest hidden size the benchmark takes (8 heads of head_dim 2)
    out = cli_ok(["bench", "--hidden", "16", "--layers", "2", "--requests", "2",
                  "--repeats", "1"], capsys)
    assert "overhead" in out



def _suite():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "suite.py"
    spec = importlib.util.spec_from_file_location("suite", path)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


def test_benchmark_suite_writes_its_rows_as_json(tmp_path, capsys):
    """``benchmarks/suite.py --quick --json FILE`` (tiny sizes, one run: the numbers mean
    nothing) writes the rows it prints as one JSON list, each with its ratio."""
    import json

    out = tmp_path / "suite.json"
    _suite().main(["--quick", "--only", "overhead", "--json", str(out)])
    rows = json.loads(out.read_text())
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == printed and [(r["tp"], r.get("policy")) for r in rows] == [
        (1, None), (2, "auto"), (2, "rs")]
    assert all(r["ratio"] == r["boundary_ms"] / r["hand_written_ms"] for r in rows)
    assert [r["mode"] for r in rows[1:]] == ["ar", "rs"]  # auto: ar for a decode step


def test_path_bytes_under_auto_are_the_least_of_the_modes():
    """The suite's path-bytes row on pool ranks: a skewed prefill, where auto takes rsv, and
    a one-token decode step; auto's bytes are the least explicit mode's both times."""
    from distributed.pool import get_pool

    pool = get_pool(4)
    row = _suite().path_bytes_row(ranks=lambda fn, spec: pool.run(fn, spec, timeout=120))
    least = [min(row["bytes"][m][s] for m in ("ar", "rs", "rsv")) for s in range(2)]
    assert row["auto_vs_least"] == [a / b for a, b in zip(row["bytes"]["auto"], least)]
    assert row["auto_vs_least"] == [1.0, 1.0] and row["auto_modes"][0] == "rsv"


def test_suite_help_does_not_start_the_suite(capsys):
    with pytest.raises(SystemExit) as stop:
        _suite().main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: benchmarks/suite.py")
    assert '"bench"' not in out  # no benchmark row: nothing ran


def test_peers_benchmark_runs_the_same_numbers_as_transformers():
    """``benchmarks/peers.py`` at world 1, tiny: it asserts every peer's last logits are the
    library's before timing; each row names its workload and peer and has a ratio."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import peers

    rows = peers.peers(hidden=64, tp=1, repeats=1)
    assert [(r["workload"], r["peer"]) for r in rows] == [
        (w, "transformers") for w in peers.WORKLOADS]
    assert all(r["ratio"] == r["lib_ms"] / r["ms"] for r in rows)


def _kernel_count():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_count.py"
    spec = importlib.util.spec_from_file_location("kernel_count", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_kernel_count_chooses_the_triton_interpreter_itself_on_the_cpu():
    """Run as a user runs it, without TRITON_INTERPRET=1 (the suite sets it): the Triton row
    ended in a traceback; the script now chooses the interpreter before anything imports
    triton, as the command line does for --fusions triton; its rows with the Triton provider,
    in place and gathering. A device this machine lacks is one line (exit 2)."""
    import json
    import os
    import subprocess
    import sys

    import torch

    module, path = _kernel_count()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(path), "--row", "ours, triton fusions",
                           "--row", "ours, triton fusions, gathering", "--layers", "1", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    rows = {r["row"]: r["dispatcher"] for r in map(json.loads, done.stdout.splitlines())}
    # the provider's caches decode in place: the attention (two launches) and its cache write
    # (one) take fewer ops a layer than the gathering path, the layer's whole step at most 20
    # (issue 65; 1 and 2 layers count what 2 and 4 do)
    assert rows["ours, triton fusions"] < rows["ours, triton fusions, gathering"], rows
    assert 0 < rows["ours, triton fusions"] <= 20, rows
    if not torch.cuda.is_available():
        assert module.main(["--device", "cuda"]) == 2
