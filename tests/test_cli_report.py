"""What a person reads: ``--help`` answers before torch loads and states every default, the
built-in checkpoint takes a text prompt and prints it decoded, plans name Mamba2 mixers, the
header names every mode that is on, and the ledger says which decode steps repeat."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from distributed.checks import cli_ok

from layer_boundary.engine.args import build_parser


def test_help_and_version_import_no_torch():
    """``layer-boundary --help`` and ``run --help`` parse before anything heavy loads (the
    package root and the runtime export lazily)."""
    for argv in (["--help"], ["run", "--help"], ["plan", "--help"], ["--version"]):
        code = ("import sys\nfrom layer_boundary.engine.cli import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
                "print([m for m in sys.modules if m == 'torch' or m.startswith('torch.')])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=60).stdout.splitlines()
        assert out[-1] == "[]", f"{argv} imported {out[-1]}"


def _subcommands(parser):
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


@pytest.mark.parametrize("command", ["run", "plan", "bench"])
def test_every_option_has_help_that_states_its_default(command):
    sub = _subcommands(build_parser())[command]
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or argparse.SUPPRESS in (action.help, action.default):
            continue  # positionals, and --help itself
        text = formatter._get_help_string(action) if action.help else ""
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        if action.default not in (None, False):  # a switch says it by its name
            assert "default" in text, f"{command} {action.option_strings[0]}: {text!r}"


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "layer_boundary", "--help"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    for command in ("run", "plan", "bench"):
        assert command in out.split("positional arguments:")[1]


@pytest.mark.timeout(120)
def test_a_text_prompt_on_the_builtin_checkpoint_prints_decoded_text(capsys):
    """The built-in checkpoint ships a byte-level tokenizer: ``--prompt`` encodes with it
    and the report decodes prompt and completion (the ids are the text's UTF-8 bytes)."""
    out = cli_ok(["run", "--tp", "2", "--prompt", "hello", "--max-new-tokens", "2"], capsys)
    assert "prompt 0 [104, 101, 108, 108, 111] -> generated" in out
    assert "  text: 'hello' -> " in out and "parity vs world 1: PASS" in out
    report = json.loads(cli_ok(["run", "--tp", "2", "--prompt", "hé", "--max-new-tokens", "2",
                                "--json"], capsys).strip().splitlines()[-1])
    (prompt,) = report["prompts"]
    assert prompt["prompt_ids"] == list("hé".encode()) and prompt["prompt_text"] == "hé"
    assert prompt["generated_text"] == bytes(prompt["generated_ids"]).decode(errors="replace")


def test_a_nemotron_h_plan_labels_its_mamba2_mixers(tmp_path, capsys):
    from checkpoints.nh import hf_nemotron_h

    path = hf_nemotron_h(tmp_path / "nh")
    kinds = json.loads((path / "config.json").read_text())["layers_block_type"]
    out = cli_ok(["plan", "--model", str(path), "--tp", "2"], capsys)
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith("  layer")]
    assert [r[0] for r in rows] == [f"layer{i}.{'ffn' if k in ('mlp', 'moe') else 'attn'}"
                                    for i, k in enumerate(kinds)]
    assert [r[1] == "(mamba2)" for r in rows] == [k == "linear_attention" for k in kinds]
    assert "linear_attention" in kinds and "full_attention" in kinds
    stages = json.loads(cli_ok(["plan", "--model", str(path), "--tp", "2", "--json"],
                               capsys))["stages"]
    assert [s.get("mixer") for s in stages] == [
        "mamba2" if k == "linear_attention" else None for k in kinds]


@pytest.mark.timeout(120)
def test_the_header_names_the_modes_on_and_later_steps_say_they_repeat(capsys):
    out = cli_ok(["run", "--tp", "2", "--tbo", "always", "--max-new-tokens", "4",
                  "--fusion-provider",
                  "reference"], capsys)
    header = next(line for line in out.splitlines() if line.startswith("layer-boundary run:"))
    assert header.endswith("two-batch overlap (always)  fusion provider reference")
    assert "  steps 2-3 repeat step 1" in out
    # under ar each rank's owed FFN all-reduce is completed by the provider's fused candidate
    fused = re.search(r"fusion provider reference on rank 0: (\d+) inputs", out)
    assert fused and int(fused.group(1)) > 0 and "parity vs world 1: PASS" in out
    out = cli_ok(["run", "--tp", "2", "--max-new-tokens", "3"], capsys)
    assert "  step 2 repeats step 1" in out
    # all-reduces only (auto runs ar without attention DP): gloo moves the logical bytes
    wire, logical = re.search(r"on gloo's wire .*: (\d+) B, against (\d+) B logical",
                              out).groups()
    assert wire == logical
    out = cli_ok(["run", "--tp", "2", "--boundary-reduction", "rs", "--max-new-tokens", "2"],
                 capsys)
    wire, logical = re.search(r"on gloo's wire .*: (\d+) B, against (\d+) B logical",
                              out).groups()
    # its reduce-scatters run as exchanges of blocks, its gathers are even: the ring figure
    assert wire == logical


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_start_in_time_names_the_option_that_widens_the_window(capsys):
    from layer_boundary.engine.cli import main

    # a microsecond: no rank starts that fast, even forked from a warm fork server
    assert main(["run", "--tp", "2", "--start-timeout", "0.000001", "--no-reference"]) == 1
    err = capsys.readouterr().err
    assert "did not start within 0 s" in err
    assert err.rstrip().endswith("--start-timeout SECONDS widens the start-up window)")


def test_bench_prints_the_spread_and_warns_within_noise(capsys, monkeypatch):
    """The spread of the timed forwards, and the warning when the overhead is inside the
    hand-written forward's own noise (forced here: a noise figure larger than any overhead)."""
    import layer_boundary.engine.bench as bench

    real = bench.overhead_with_noise
    monkeypatch.setattr(bench, "overhead_with_noise",
                        lambda *a, **k: dict(real(*a, **k), noise=10.0))
    out = cli_ok(["bench", "--hidden", "64", "--layers", "1", "--requests", "1",
                  "--repeats", "3"], capsys)
    assert out.splitlines()[0].startswith("timing 3 paired decode steps (hidden 64")
    assert "  boundary     min " in out and "  hand_written min " in out
    assert "warning: the overhead is within the noise" in out


@pytest.mark.timeout(120)
def test_the_json_verdict_is_the_exit_status(qwen3_dir, capsys, monkeypatch, restore_logger):
    """``run --json`` leads with its verdict and the reason: NOT_CHECKED without a reference,
    FAIL (exit 1) where parity fails, as the text report and the exit status say."""
    import importlib

    from layer_boundary.engine.cli import main

    # the module (the package's lazy ``parity`` name is the function)
    parity = importlib.import_module("layer_boundary.engine.parity")

    args = ["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1", "--json",
            "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
    report = json.loads(cli_ok([*args, "--no-reference"], capsys).strip().splitlines()[-1])
    assert report["verdict"] == "NOT_CHECKED"
    assert report["reason"].startswith("parity NOT_CHECKED: --no-reference: nothing compared; "
                                       "exactly once PASS: ")
    assert [(c["name"], c["verdict"]) for c in report["checks"]] == [
        ("parity", "NOT_CHECKED"), ("exactly once", "PASS")]
    monkeypatch.setattr(parity, "verdict_ok", lambda *a, **k: (False, "forced by the test"))
    assert main([*args, "--tbo", "always"]) == 1  # a split run has a world-1 reference
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["verdict"] == "FAIL"
    assert report["reason"].startswith("parity FAIL: tokens match, max |logit diff| ")
    assert report["reason"].endswith(", forced by the test; exactly once NOT_CHECKED: not "
                                     "audited: two-batch overlap's microbatches sum their own "
                                     "rows")
