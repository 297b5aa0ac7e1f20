"""``plan`` and ``run`` derive one topology from the same flags, and ``run`` says how many
processes it starts before it starts them."""

from __future__ import annotations

import json

import pytest
from distributed.checks import cli_ok

from layer_boundary.engine.args import build_parser
from layer_boundary.engine.run_command import spec_from_args


@pytest.mark.parametrize("flags", [[], ["--tp", "2"], ["--tp", "4"], ["--dp", "4"],
                                   ["--tp", "4", "--dp", "2"], ["--tp", "2", "--pp", "2"]])
def test_plan_and_run_report_the_same_topology(flags, capsys, restore_logger):
    spec = spec_from_args(build_parser().parse_args(["run", *flags]))
    plan = json.loads(cli_ok(["plan", *flags, "--json"], capsys))
    assert (plan["tp"], plan["dp"], plan.get("pp", 1)) == (spec.tp, spec.dp, spec.pp), flags


def test_run_says_how_many_processes_it_starts(capsys, restore_logger):
    out = cli_ok(["run", "--pp", "2", "--tp", "1", "--max-new-tokens", "1"], capsys)
    assert out.splitlines()[0] == "starting 2 rank processes (pp 2 x tp 1)"


def test_the_plan_explains_its_notation(capsys, restore_logger):
    from layer_boundary.engine.report import PLAN_LEGEND

    out = cli_ok(["plan", "--tp", "4", "--dp", "2"], capsys)
    lines = out.splitlines()
    start = lines.index("legend:")
    assert lines[start:start + len(PLAN_LEGEND)] == list(PLAN_LEGEND)
    # every term the legend explains appears in the plan above it
    table = "\n".join(lines[:start])
    for term in ("attn_tp_scatter", "attn_dp", "partial: attn_tp sum owed", "all_gather_v"):
        assert term in table, term


# the names vLLM's and SGLang's users type, and ours they mean
SAME = [(["--tensor-parallel-size", "2"], ["--tp", "2"]),
        (["--tp-size", "2"], ["--tp", "2"]),
        (["--pipeline-parallel-size", "2", "--tp", "1"], ["--pp", "2", "--tp", "1"]),
        (["--pp-size", "2", "--tp", "1"], ["--pp", "2", "--tp", "1"]),
        (["--tp", "4", "--enable-dp-attention", "--dp-size", "2"], ["--tp", "4", "--dp", "2"]),
        (["--tp", "4", "--enable-dp-attention", "--dp", "4"], ["--tp", "4", "--dp", "4"])]


@pytest.mark.parametrize("theirs,ours", SAME, ids=[" ".join(t) for t, _ in SAME])
def test_engine_names_mean_ours(theirs, ours):
    a, b = (spec_from_args(build_parser().parse_args(["run", *flags])) for flags in (theirs, ours))
    assert (a.tp, a.dp, a.pp, a.ep) == (b.tp, b.dp, b.pp, b.ep)


@pytest.mark.parametrize("flags", [["--data-parallel-size", "1"], ["--dp-size", "1"]])
def test_one_replica_is_the_no_op_it_says(qwen3_dir, flags):
    """vLLM's --data-parallel-size 1 and SGLang's --dp-size 1 (without dp attention) name the
    one engine this runs: accepted, and the topology is the one without them."""
    base = ["run", "--model", str(qwen3_dir), "--tp", "2", "--dp", "1"]
    plain = spec_from_args(build_parser().parse_args(base))
    spec = spec_from_args(build_parser().parse_args([*base, *flags]))
    assert (spec.tp, spec.dp) == (plain.tp, plain.dp) == (2, 1)


def test_expert_parallel_names(qwen3_moe_dir, qwen3_dir):
    moe = ["run", "--model", str(qwen3_moe_dir), "--tp", "2"]
    assert spec_from_args(build_parser().parse_args([*moe, "--ep-size", "2"])).ep == 2
    assert spec_from_args(build_parser().parse_args([*moe, "--enable-expert-parallel"])).ep == 2
    # vLLM's switch acts on MoE layers only: a dense model is served as it is
    dense = ["run", "--model", str(qwen3_dir), "--tp", "2", "--enable-expert-parallel"]
    assert spec_from_args(build_parser().parse_args(dense)).ep == 1


REFUSED = [
    (["--data-parallel-size", "2"], "--data-parallel-size is vLLM's number of engine replicas; "
     "this runs one engine. Attention data parallelism inside the TP group is --dp N (SGLang: "
     "--enable-dp-attention --dp-size N)"),
    (["--dp-size", "2"], "--dp-size without --enable-dp-attention is SGLang's number of "
     "data-parallel replicas; this runs one engine. For attention data parallelism inside the "
     "TP group add --enable-dp-attention (or pass --dp)"),
    (["--enable-dp-attention"], "--enable-dp-attention needs --dp-size N (or --dp N): the "
     "attention data-parallel size"),
    (["--enable-dp-attention", "--dp", "2", "--dp-size", "4"],
     "--dp 2 and --dp-size 4 disagree; pass one"),
    (["--tp", "4", "--enable-expert-parallel", "--ep", "2"], "--enable-expert-parallel spreads "
     "experts over every TP rank (--ep 4); --ep 2 says otherwise: pass one")]


@pytest.mark.parametrize("flags,message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_engine_names_that_mean_something_else_are_refused_by_name(command, flags, message,
                                                                    capsys, restore_logger):
    from layer_boundary.engine.cli import main

    assert main([command, *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"layer-boundary: error: {message}"]


def test_dtype_auto_is_the_checkpoints(qwen3_dir, tmp_path):
    import shutil

    assert spec_from_args(build_parser().parse_args(["run", "--model", str(qwen3_dir)])).dtype \
        == json.loads((qwen3_dir / "config.json").read_text()).get("dtype", "float32")
    half = tmp_path / "bf16"
    shutil.copytree(qwen3_dir, half)
    config = json.loads((half / "config.json").read_text())
    (half / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert spec_from_args(build_parser().parse_args(["run", "--model", str(half)])).dtype \
        == "bfloat16"
    (half / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    with pytest.raises(ValueError, match="dtype 'float16'; --dtype auto runs float32 or "
                                         "bfloat16 checkpoints: pass --dtype float32"):
        spec_from_args(build_parser().parse_args(["run", "--model", str(half)]))
    assert spec_from_args(build_parser().parse_args(
        ["run", "--model", str(half), "--dtype", "float32"])).dtype == "float32"


def test_log_level_quiets_what_the_run_says_while_it_works_not_its_report(capsys,
                                                                         restore_logger):
    args = ["run", "--pp", "2", "--tp", "1", "--max-new-tokens", "1"]
    loud = cli_ok(args, capsys)
    quiet = cli_ok([*args, "--log-level", "WARNING"], capsys)
    assert loud.splitlines()[0] == "starting 2 rank processes (pp 2 x tp 1)"
    assert "starting" not in quiet and "each loads its shard" not in quiet
    assert "parity vs world 1: PASS" in quiet
