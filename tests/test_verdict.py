"""One verdict for a run, in its text report, its ``--json`` object and its exit status alike:
FAIL where any check failed (parity, batch invariance, the exactly-once audit, required
fusions), PASS where a comparison passed and nothing failed, NOT_CHECKED where nothing was
compared; each check says what it compared. Under ``--json`` stdout holds that one object."""

from __future__ import annotations

import json

import pytest
from distributed.checks import cli

pytestmark = pytest.mark.usefixtures("restore_logger")

TWO = ["--prompt-ids", "5,9,2", "--prompt-ids", "3,8", "--max-new-tokens", "2"]


def _invariance_fails(monkeypatch):
    from layer_boundary.engine import verdict

    monkeypatch.setattr(verdict, "invariance_check", lambda run, results: {
        "ok": False, "prompts": 2, "steps": 2, "differences": ["prompt 1 step 1: made up"]})


@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2", "--no-reference"],
                                    ["--tp", "2"]], ids=["world1", "no-reference", "tp2"])
def test_a_failed_invariance_check_is_the_runs_verdict(layout, qwen3_dir, monkeypatch,
                                                      capsys):
    """It read NOT_CHECKED (parity's word) at world 1 and with --no-reference, and at tp 2 a
    FAIL whose reason spoke only of parity, which passed."""
    _invariance_fails(monkeypatch)
    code, out = cli(["run", "--model", str(qwen3_dir), *layout, "--batch-invariant", "--json",
                     *TWO], capsys)
    record = json.loads(out)
    assert code == 1 and record["verdict"] == "FAIL"
    assert record["reason"].startswith("batch invariance FAIL: prompt 1 step 1: made up; "
                                       "parity ")
    checks = {c["name"]: c["verdict"] for c in record["checks"]}
    assert checks["batch invariance"] == "FAIL"
    assert checks["parity"] == ("PASS" if layout == ["--tp", "2"] else "NOT_CHECKED")


def test_the_text_report_ends_with_the_same_verdict(qwen3_dir, monkeypatch, capsys):
    _invariance_fails(monkeypatch)
    code, out = cli(["run", "--model", str(qwen3_dir), "--tp", "1", "--batch-invariant",
                     *TWO], capsys)
    assert code == 1
    assert "parity: not checked (a plain world-1 run is its own reference: nothing " \
           "compared)" in out
    # its last line (the paths and collectives followed it, though the docs said it ends it)
    assert out.rstrip().splitlines()[-1] == ("verdict: FAIL (failed: batch invariance; passed: "
                                             "exactly once; not checked: parity)")


def test_one_prompt_has_no_batch_to_be_invariant_in(qwen3_dir, capsys):
    """A batch of one compared with itself said PASS."""
    code, _ = cli(["run", "--model", str(qwen3_dir), "--tp", "1", "--batch-invariant",
                   "--prompt-ids", "5,9,2"], capsys)
    assert code == 2
    assert capsys.readouterr().err.startswith(
        "layer-boundary: error: --batch-invariant checks each prompt generated alone against "
        "the batch; with one prompt the batch is that prompt alone")


def test_required_fusions_are_part_of_the_json_verdict(qwen3_dir, capsys):
    """``--json`` printed PASS, then the run exited 1 for a declined fusion."""
    code, out = cli(["run", "--model", str(qwen3_dir), "--tp", "2", "--fusions", "decline",
                     "--require-fusions", "--json", *TWO], capsys)
    record = json.loads(out)
    assert code == 1 and record["verdict"] == "FAIL"
    required = next(c for c in record["checks"] if c["name"] == "required fusions")
    assert required["verdict"] == "FAIL"
    assert required["reason"].startswith("a fusion candidate declined: rank 0 layer1.attn "
                                         "declined ")
    assert record["reason"].startswith("required fusions FAIL: a fusion candidate declined")


def test_warnings_go_to_stderr_under_json(qwen3_dir, tmp_path, capsys):
    """A warning (here: a tied config over a checkpoint holding a different head) went to
    stdout before the JSON object."""
    import shutil

    folder = tmp_path / "tied"
    shutil.copytree(qwen3_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    code, out = cli(["run", "--model", str(folder), "--tp", "1", "--json", *TWO], capsys)
    assert code == 0
    record = json.loads(out)  # the whole of stdout is one object
    assert record["verdict"] == "NOT_CHECKED"
    assert "both are loaded, untied, as transformers does" in capsys.readouterr().err
