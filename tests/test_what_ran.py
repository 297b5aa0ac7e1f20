"""What ran: the run report lists each stage's path and each fusion candidate's outcome
(applied, or declined and why), and ``--require-fusions`` makes a decline an error that names
the stage (Megatron#6463: a declining guard and an ineffective change look identical from the
throughput number alone)."""

from __future__ import annotations

import json

import pytest
from distributed.checks import cli

pytestmark = pytest.mark.usefixtures("restore_logger")

RUN = ["run", "--max-new-tokens", "2", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5"]


def test_a_required_decline_is_an_error_that_names_the_stage(capsys):
    code, out = cli([*RUN, "--tp", "2", "--fusions", "decline", "--require-fusions"], capsys)
    err = capsys.readouterr().err
    assert code == 1
    assert "parity vs world 1: PASS" in out  # the numbers are right: the fusion did not run
    assert "layer1.attn      applied 0x; declined 2x: the decline provider declines every " \
           "candidate" in out
    assert err.startswith("layer-boundary: error: --require-fusions: a fusion candidate "
                          "declined: rank 0 layer1.attn declined 2x: the decline provider "
                          "declines every candidate; ")


def test_a_provider_that_fuses_passes_when_required(capsys):
    code, out = cli([*RUN, "--tp", "2", "--fusions", "reference", "--require-fusions"], capsys)
    assert code == 0
    assert "layer1.attn      applied 2x" in out


def test_the_json_report_has_each_stages_path_and_fusion_outcome(capsys):
    code, out = cli([*RUN, "--tp", "2", "--fusions", "reference", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    stages = report["stages"]
    assert [s["stage"] for s in stages] == [f"layer{i}.{k}" for i in range(3)
                                            for k in ("attn", "ffn")]
    for stage in stages:
        assert stage["entry"] and stage["exit"]
        assert set(stage["fusion"]) >= {"offered", "applied", "declined"}
    fused = {s["stage"]: s["fusion"]["applied"] for s in stages}
    assert fused["layer0.attn"] == 0  # the stack's entry: nothing arrives there
    assert fused["layer1.attn"] == fused["layer2.attn"] == 2  # prefill and one decode step
    assert all(not s["fusion"]["declined"] for s in stages)
    assert sorted(report["fused_stages"]) == ["layer1.attn", "layer2.attn"]


def test_require_fusions_needs_a_provider(capsys):
    code, _ = cli([*RUN, "--tp", "1", "--require-fusions"], capsys)
    assert code == 2
    assert capsys.readouterr().err == ("layer-boundary: error: --require-fusions needs a "
                                       "provider to require: --fusions reference|reference-"
                                       "terminal|decline|triton\n")


def test_a_required_fusion_nothing_offers_is_an_error(tmp_path, capsys):
    """OLMo's post norms leave a provider no add + norm to complete: nothing declined, and
    nothing fused either (the run passed as if the requirement held)."""
    from checkpoints.olmo import hf_olmo3

    folder = hf_olmo3(tmp_path / "olmo3")
    capsys.readouterr()  # transformers' save progress
    code, out = cli([*RUN, "--model", str(folder), "--tp", "2", "--fusions", "reference",
                     "--require-fusions"], capsys)
    assert code == 1
    assert "parity vs world 1: PASS" in out
    assert capsys.readouterr().err == (
        "layer-boundary: error: --require-fusions: no stage applied a fusion candidate (none "
        "was offered, or none asked: the model's boundaries leave the provider nothing to "
        "complete), so nothing was fused\n")
