"""``layer-boundary sweep``: every layout the capability check accepts, run against one
world-1 run, in one table (one JSON row a layout); refused layouts counted, not run."""

from __future__ import annotations

import json
import re

import pytest
from distributed.checks import cli

from layer_boundary.engine.run_command import DEFAULT_PROMPTS
from layer_boundary.engine.sweep import Layout, layouts, sweep

pytestmark = pytest.mark.usefixtures("restore_logger")


def test_the_layouts_cover_every_parallelism_up_to_the_world():
    dense = layouts(4, moe=False, layers=3)
    assert len(set(dense)) == len(dense)
    names = {layout.name() for layout in dense}
    for expected in ("tp1 auto", "tp2 rsv", "tp4 dp2 empty-dp rsv", "tp2 cp2 rs",
                     "tp2 sp rsv", "tp2 pp2 ar", "tp1 pp2 auto", "tp4 dp4 auto"):
        assert expected in names, expected
    assert not any(layout.ep > 1 or layout.a2a for layout in dense)
    assert max(layout.world for layout in dense) == 4
    moe = layouts(4, moe=True, layers=3)
    assert {"tp4 ep4 a2a rsv", "tp4 dp2 ep4 a2a empty-dp rsv", "tp2 ep2 ar"} <= {
        layout.name() for layout in moe}
    assert all(layout.pp <= 3 for layout in layouts(8, moe=False, layers=3))


def test_a_sweep_runs_what_is_accepted_and_counts_what_is_refused(qwen3_moe_dir):
    candidates = [Layout(1), Layout(2, policy="rsv"), Layout(2, dp=2, policy="rsv", empty=True),
                  Layout(2, ep=2, a2a=True, policy="rs"), Layout(2, pp=2, dp=2),
                  Layout(4, cp=2, ep=2, a2a=True)]  # CP with the all-to-all MoE: refused
    result = sweep(str(qwen3_moe_dir), 4, None, 2, DEFAULT_PROMPTS, candidates=candidates)
    rows = {r["layout"]: r for r in result["rows"]}
    assert list(rows) == ["tp1 auto", "tp2 rsv", "tp2 dp2 empty-dp rsv", "tp2 ep2 a2a rs",
                          "tp2 dp2 pp2 auto"]
    for row in rows.values():
        assert row["verdict"] == "PASS", row
        assert row["exactly_once"] == "PASS"
    assert rows["tp1 auto"]["max_abs_diff"] == 0.0 and rows["tp1 auto"]["bytes"] == 0
    assert rows["tp2 rsv"]["bytes"] > 0 and rows["tp2 rsv"]["bytes_over_min"] == 1.0
    refused = {r["layout"]: r["why"] for r in result["refused"]}
    assert "tp4 cp2 ep2 a2a auto" in refused
    assert result["passed"] == result["run"] == len(rows)


def test_the_command_prints_one_json_row_a_layout(capsys):
    code, out = cli(["sweep", "--max-world", "1", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert [r["layout"] for r in result["rows"]] == ["tp1 auto"]
    assert result["rows"][0]["verdict"] == "PASS"


def test_token_ids_outside_the_vocabulary_are_refused_as_run_refuses_them(qwen3_dir, capsys,
                                                                           restore_logger):
    """The sweep took a user's ids modulo the vocabulary and passed every layout on prompts
    run refuses; its defaults still are (they are the package's, not the user's)."""
    from layer_boundary.engine.cli import main

    assert main(["sweep", "--model", str(qwen3_dir), "--prompt-ids", "1,999"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: prompt 0 has token ids [999] outside vocab_size=96"]


def _run_error(argv, capsys) -> str:
    """What ``run`` says of the same checkpoint and options (its one-line error)."""
    from layer_boundary.engine.cli import main

    assert main(["run", "--tp", "1", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("case", ["max-new-tokens", "agreement", "memory", "no-weights"])
def test_what_run_refuses_the_sweep_refuses_as_run_names_it(case, qwen3_dir, tmp_path, capsys,
                                                            monkeypatch):
    """Each of these swept 0 layouts (34 "refused by the capability check") and exited 0."""
    import shutil

    from layer_boundary.engine.cli import main

    argv = ["--model", str(qwen3_dir)]
    if case == "max-new-tokens":
        argv += ["--max-new-tokens", "100000"]
    elif case == "agreement":
        monkeypatch.setenv("LAYER_BOUNDARY_CHECK_AGREEMENT", "maybe")
    elif case == "memory":
        monkeypatch.setenv("LAYER_BOUNDARY_MEMORY_GB", "abc")
    else:
        folder = tmp_path / "no-weights"
        shutil.copytree(qwen3_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        argv = ["--model", str(folder)]
    assert main(["sweep", *argv]) == 2
    err = capsys.readouterr().err
    assert err == _run_error(argv, capsys) and err.startswith("layer-boundary: error: ")


def test_a_sweep_that_runs_nothing_fails(qwen3_dir, capsys):
    """``--budget 0.001`` left every layout out, and the sweep exited 0 having compared
    nothing."""
    code, out = cli(["sweep", "--model", str(qwen3_dir), "--max-world", "2", "--budget",
                     "0.001"], capsys)
    assert code == 1
    assert "verdict: NOT_CHECKED (no layout ran: nothing was compared)" in out
    assert "left out by --budget: tp1 auto, tp2 auto, " in out
    err = capsys.readouterr().err
    assert re.fullmatch(r"layer-boundary: error: sweep ran no layout \(\d+ refused by the "
                        r"capability check, \d+ left out by --budget\): nothing was compared\n",
                        err), err


def test_a_stopped_sweeps_verdict_is_stopped(qwen3_dir, capsys):
    """A sweep stopped by a signal exits 128 + its number, and its JSON and table said PASS
    (every row so far passed) and listed the row it interrupted as not started."""
    import signal

    from layer_boundary.engine.logs import setup_logging
    from layer_boundary.engine.run_command import Stopped
    from layer_boundary.engine.sweep import print_table

    def progress(line: str) -> None:  # SIGTERM as the second row starts
        if line.strip().startswith("tp2"):
            raise Stopped(signal.SIGTERM)

    result = sweep(str(qwen3_dir), 2, None, 2, DEFAULT_PROMPTS, progress=progress,
                   candidates=[Layout(1), Layout(2, policy="ar"), Layout(2, policy="rs")])
    assert [(r["layout"], r["verdict"]) for r in result["rows"]] == [("tp1 auto", "PASS")]
    assert result["verdict"] == "STOPPED"
    assert result["stopped"] == {"signal": "SIGTERM", "exit_code": 128 + signal.SIGTERM,
                                 "interrupted": "tp2 ar", "not_started": ["tp2 rs"]}
    setup_logging(0)
    print_table(result)
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "stopped by SIGTERM: interrupted: tp2 ar; not started: tp2 rs",
        "verdict: STOPPED (by SIGTERM after 1 layouts: 1 passed)"]


def test_a_failed_rows_detail_says_what_failed():
    """A row whose ranks failed read "RankError: a rank failed:" (the rank's error is the next
    line); an error with no message ended the sweep in an IndexError."""
    from layer_boundary.engine.sweep import error_words
    from layer_boundary.runtime.launch import RankError

    failed = RankError("a rank failed:\nrank 1: Unsupported: invalid call to builtin op\n"
                       "  Explanation: ...")
    assert error_words(failed) == "a rank failed: rank 1: Unsupported: invalid call to builtin op"
    assert error_words(AssertionError()) == "AssertionError"
    assert error_words(failed, lines=1, limit=None) == "a rank failed:"


def test_the_largest_world_is_bounded(capsys):
    """``--max-world 2**62`` listed layouts for ever before the budget was read."""
    from layer_boundary.engine.cli import main

    with pytest.raises(SystemExit) as refused:  # argparse's refusal
        main(["sweep", "--max-world", str(2 ** 62)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        f"argument --max-world: {2 ** 62} is more than 64 (rank processes at once on this "
        "machine)")


def test_features_cross_layouts_each_against_world_1(qwen3_dir):
    """``sweep --features``: each feature beside a layout, held against the plain world-1
    run (the adapter's rows against world 1 with the adapter); what the table refuses is
    counted by its reason."""
    from layer_boundary.engine.sweep_features import SweepFeature as F

    features = [F.TBO, F.SPLIT_PREFILL, F.FUSIONS_REFERENCE, F.FUSIONS_TRITON, F.LORA, F.DRAFT,
                F.BATCH_INVARIANT]
    # CP with sequence parallelism: refused whatever runs beside it
    result = sweep(str(qwen3_dir), 2, None, 2, DEFAULT_PROMPTS, features=features,
                   candidates=[Layout(2, policy="rsv"), Layout(2, cp=2, sp=True)])
    assert [r["layout"] for r in result["rows"]] == [f"tp2 rsv +{f.value}" for f in features]
    for row in result["rows"]:
        assert row["verdict"] == "PASS" and row["feature"], row
    assert result["verdict"] == "PASS" and result["passed"] == result["run"] == len(features)
    assert [r["layout"] for r in result["refused"]] == [f"tp2 cp2 sp auto +{f.value}"
                                                        for f in features]
    (why, count), = result["refused_by_reason"].items()
    assert count == len(features) and why.startswith("--cp does not combine with "
                                                     "--sequence-parallel")


def test_the_feature_sample_has_a_layout_of_each_kind():
    from layer_boundary.engine.sweep_features import SweepFeature, combinations, sample_layouts

    names = [x.name() for x in sample_layouts(4, moe=True, layers=3)]
    assert names == ["tp1 auto", "tp2 ar", "tp2 rsv", "tp4 dp2 empty-dp rsv", "tp2 pp2 auto",
                     "tp2 cp2 auto", "tp2 sp rsv", "tp2 ep2 a2a rs", "tp4 dp2 ep4 rsv"]
    assert [x.name() for x in sample_layouts(1, moe=False, layers=3)] == ["tp1 auto"]
    compiled = [c.name() for c in combinations([SweepFeature.COMPILE], False, 4, False, 3)]
    assert compiled == ["tp1 auto +compile", "tp2 ar +compile", "tp2 rsv +compile",
                        "tp4 dp2 empty-dp rsv +compile"]


def test_the_generated_adapter_is_one_run_takes_on_a_moe_model(qwen3_moe_dir, tmp_path):
    """It targeted down_proj too, which peft turns on a MoE model into a LoRA on the stacked
    experts (refused by name): every LoRA combination of a MoE sweep was refused."""
    from layer_boundary.engine.args import build_parser
    from layer_boundary.engine.sweep import _spec
    from layer_boundary.engine.sweep_features import SweepFeature, feature_args, write_adapter
    from layer_boundary.models import open_checkpoint

    checkpoint = open_checkpoint(str(qwen3_moe_dir))
    folder = write_adapter(checkpoint, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    extra = feature_args(SweepFeature.LORA, checkpoint, str(qwen3_moe_dir), str(folder), 2)
    spec, refusal = _spec(build_parser(), ["--model", str(qwen3_moe_dir)],
                          Layout(2, policy="rsv"), DEFAULT_PROMPTS[:2], extra)
    assert refusal is None and spec.prompt_lora == ("sweep", "none")


def test_the_generated_adapter_leaves_a_nextn_layer_alone(tmp_path):
    """A DeepSeek-V3 storing its NextN layer after the stack (as it ships): the adapter
    targeted that layer's projections too, which transformers has no module for, and every
    LoRA row of its sweep was refused."""
    from safetensors import safe_open
    from checkpoints.ds import hf_deepseek_v3_nextn

    from layer_boundary.engine.args import build_parser
    from layer_boundary.engine.sweep import _spec
    from layer_boundary.engine.sweep_features import SweepFeature, feature_args, write_adapter
    from layer_boundary.models import open_checkpoint

    path = hf_deepseek_v3_nextn(tmp_path / "ds3")
    checkpoint = open_checkpoint(str(path))
    folder = write_adapter(checkpoint, tmp_path / "adapter")
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        layers = {k.split(".")[4] for k in f.keys()}
    assert layers == {"0", "1", "2"}  # the stack's, not NextN layer 3
    extra = feature_args(SweepFeature.LORA, checkpoint, str(path), str(folder), 2)
    spec, refusal = _spec(build_parser(), ["--model", str(path)], Layout(1),
                          DEFAULT_PROMPTS[:2], extra)
    assert refusal is None and spec.prompt_lora == ("sweep", "none")


def test_a_model_the_sweep_writes_no_adapter_for_has_its_lora_rows_refused(qwen3_dir,
                                                                          monkeypatch):
    from layer_boundary.engine import sweep_features

    monkeypatch.setattr(sweep_features, "write_adapter", lambda checkpoint, folder: None)
    result = sweep(str(qwen3_dir), 1, None, 2, DEFAULT_PROMPTS,
                   features=[sweep_features.SweepFeature.LORA], candidates=[Layout(1)])
    assert result["run"] == 0 and result["verdict"] == "NOT_CHECKED"
    assert result["refused"] == [{"layout": "tp1 auto +lora", "why": (
        "the sweep's LoRA adapter targets the attention projections peft names q_proj, v_proj, "
        "o_proj, qkv_proj, query_key_value; the qwen3 model has none of them")}]


@pytest.mark.parametrize("value,message", [
    ("foo", "--features 'foo': foo is not a feature (give sample, all, or some of tbo, "),
    (",", "--features ',': names no feature (give sample, all, or some of tbo, "),
    ("sample,tbo", "--features 'sample,tbo': sample stands alone, not among feature names "
                   "(give sample, all, or some of tbo, ")])
def test_features_that_name_nothing_known_are_refused(value, message, capsys):
    code, _ = cli(["sweep", "--features", value], capsys)
    assert code == 2
    assert capsys.readouterr().err.startswith(f"layer-boundary: error: {message}")
