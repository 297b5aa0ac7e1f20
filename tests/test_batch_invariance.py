"""Batch invariance: with ``--batch-invariant`` a request's logits are the same bits alone as
in the batch, prefill and decode, on each layout's row mode (world 1, tp 2, tp 4 with
attention DP 2 under ``rsv`` and a DP rank left empty when a prompt runs alone); without the
mode they are not, so the check means something."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import hf_qwen3
from distributed.checks import cli

from layer_boundary.engine import runner
from layer_boundary.engine.report import invariance_check
from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.runtime import invariant

pytestmark = pytest.mark.usefixtures("restore_logger")

PROMPTS = ["--prompt-ids", "5,9,2,7,1", "--prompt-ids", "3,8", "--prompt-ids", "6,4,4"]


@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2"],
                                    ["--tp", "4", "--dp", "2", "--boundary-reduction", "rsv"]],
                         ids=["world1", "tp2", "tp4-dp2-rsv"])
def test_run_batch_invariant_passes_its_own_check(layout, capsys):
    code, out = cli(["run", *layout, "--batch-invariant", "--max-new-tokens", "3", "--json",
                     *PROMPTS], capsys)
    report = json.loads(out)
    assert code == 0, report
    assert report["batch_invariance"] == {"ok": True, "prompts": 3, "steps": 3,
                                          "differences": []}


def test_without_the_mode_a_batch_changes_the_bits(qwen3_dir, monkeypatch):
    """The same comparison with the mode left off: the batch's products (several rows in one
    GEMM, grouped attention) give other last bits than a request alone."""
    spec = RunSpec(str(qwen3_dir), prompts=((5, 9, 2, 7, 1), (3, 8), (6, 4, 4)),
                   max_new_tokens=3, batch_invariant=True)
    monkeypatch.setattr(runner, "batch_invariant", lambda on: invariant.batch_invariant(False))
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert not check["ok"] and check["differences"]


def test_the_invariant_linear_is_each_rows_own_product():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(9, 64, generator=gen), torch.randn(48, 64, generator=gen),
               torch.randn(48, generator=gen))
    out = invariant.linear(x, w, b)
    for i in range(9):
        assert torch.equal(out[i:i + 1], torch.nn.functional.linear(x[i:i + 1], w, b))
    assert torch.equal(invariant.linear(x[2:5], w, b), out[2:5])


def test_the_invariant_activation_is_each_rows_own():
    """An elementwise activation over a contiguous batch runs as one flat loop, vectorized
    but for a scalar tail: a row of width 40 sits in the tail alone and in the vectorized
    body in a batch. ``rowwise`` gives each row the bits it gets alone, in the mode."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(15, 40, generator=gen)
    with invariant.batch_invariant():
        out = invariant.rowwise(torch.nn.functional.silu, x)
        alone = invariant.rowwise(torch.nn.functional.silu, x[:5].clone())
        assert torch.equal(out[:5], alone)
        for i in range(15):
            assert torch.equal(out[i:i + 1], torch.nn.functional.silu(x[i:i + 1]))
        assert torch.equal(invariant.rowwise(torch.nn.functional.silu, x.view(3, 5, 40)),
                           out.view(3, 5, 40))
    # off the mode: the one call
    assert torch.equal(invariant.rowwise(torch.nn.functional.silu, x),
                       torch.nn.functional.silu(x))


# the gated MLP's activation followed the batch wherever the intermediate width a rank holds
# is not a multiple of the CPU loop's step (32 floats on AVX-512): tp 2 of the tests' Qwen3
# (96 / 2 = 48), or 40 at world 1; models/layers.py GatedMLP takes it through rowwise
def test_an_intermediate_width_off_the_vector_step_stays_invariant(tmp_path):
    model = hf_qwen3(tmp_path / "qwen3", intermediate_size=40)
    spec = RunSpec(str(model), prompts=((5, 9, 2, 7, 1), (3, 8), (6, 4, 4)),
                   max_new_tokens=2, batch_invariant=True)
    result = run_rank(spec)
    check = invariance_check(merge([result]), [result])
    assert check["ok"], check["differences"]


def test_per_row_gives_each_row_its_own_call():
    """A router's product, sigmoid and top-k a row a call in the mode (tuple outputs
    concatenated per output); no rows pass through; off the mode, the one call."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(8, 64, generator=gen)

    def router(rows):
        return torch.topk(torch.nn.functional.linear(rows, w).sigmoid(), 2, dim=-1)

    with invariant.batch_invariant():
        weights, ids = invariant.per_row(router, x)
        for i in range(7):
            alone = router(x[i:i + 1])
            assert torch.equal(weights[i:i + 1], alone[0]) and torch.equal(ids[i:i + 1], alone[1])
        assert invariant.per_row(router, x[:0])[0].shape == (0, 2)
        assert invariant.rowwise(torch.sigmoid, x[:0]).shape == (0, 64)  # an empty DP rank
    assert torch.equal(invariant.per_row(router, x)[0], router(x)[0])


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    from checkpoints.ds import hf_deepseek_v3
    from checkpoints.glm4_moe import hf_glm4_moe
    from checkpoints.gpt_oss import hf_gpt_oss
    from checkpoints.lc import hf_longcat_flash
    from checkpoints.nh import hf_nemotron_h
    from checkpoints.qwen3_next import hf_qwen3_next

    root = tmp_path_factory.mktemp("invariant_models")
    return {"nemotron_h": hf_nemotron_h(root / "nh"), "gpt_oss": hf_gpt_oss(root / "gpt_oss"),
            "glm4_moe": hf_glm4_moe(root / "glm4_moe"),
            "deepseek_v3": hf_deepseek_v3(root / "ds3"),
            "qwen3_next": hf_qwen3_next(root / "qnext"),
            "longcat_flash": hf_longcat_flash(root / "lc")}


# what followed the batch (1e-6 logits apart): Nemotron-H's Mamba2 in_proj (a plain GEMM),
# its softplus over [T, heads] (8 wide, off the vector step), its router (product, sigmoid
# over [T, 8], top-k); GPT-OSS's router (a decode batch's GEMM against a lone request's
# matrix-vector product) and its experts' sigmoid (16 wide at tp 2); GLM-4-MoE's DeepSeek
# router at decode; DeepSeek-V3's absorbed MLA projections (einsums over [T, heads], a bmm
# whose blocking follows T); Qwen3-Next's shared-expert gate (a plain [T, 1] product and
# sigmoid) and its DeltaNet's beta sigmoid ([T, Hv], off the vector step); LongCat's router
@pytest.mark.parametrize("layout", [["--tp", "1"], ["--tp", "2"]], ids=["world1", "tp2"])
@pytest.mark.parametrize("model", ["nemotron_h", "gpt_oss", "glm4_moe", "deepseek_v3",
                                   "qwen3_next", "longcat_flash"])
def test_hybrid_and_sink_moe_models_pass_their_own_check(model, layout, hybrid_dirs, capsys):
    code, out = cli(["run", "--model", str(hybrid_dirs[model]), *layout, "--batch-invariant",
                     "--max-new-tokens", "2", "--json", *PROMPTS], capsys)
    report = json.loads(out)
    assert report["batch_invariance"]["ok"], report["batch_invariance"]
    assert code == 0, report


def test_the_tests_qwen3_at_tp2_passes_its_own_check(qwen3_dir, capsys):
    """The hostile probe: ``run --model <the tests' Qwen3> --tp 2 --batch-invariant``."""
    code, out = cli(["run", "--model", str(qwen3_dir), "--tp", "2", "--batch-invariant",
                     "--max-new-tokens", "2", "--json"], capsys)
    report = json.loads(out)
    assert report["batch_invariance"]["ok"], report["batch_invariance"]
    assert code == 0 and report["verdict"] == "PASS", report


def test_a_failed_invariance_check_leaves_the_parity_line_its_own_verdict(monkeypatch, capsys):
    """The run fails (exit 1) on the invariance check alone; the parity line says what the
    parity comparison found (PASS, within its tolerance), not the run's overall outcome."""
    from layer_boundary.engine import report

    monkeypatch.setattr(report, "invariance_check", lambda run, results: {
        "ok": False, "prompts": 1, "steps": 1, "differences": ["prompt 0 step 0: made up"]})
    code, out = cli(["run", "--tp", "2", "--batch-invariant", "--max-new-tokens", "1",
                     "--prompt-ids", "5,9,2"], capsys)
    assert code == 1
    assert "batch invariance: FAIL (prompt 0 step 0: made up)" in out
    assert "parity vs world 1: PASS (tokens match" in out


@pytest.mark.parametrize("extra,why", [
    (["--tbo"], "--tbo: its split follows the batch and its sums run asynchronously"),
    (["--compile", "--compile-backend", "eager"],
     "--compile: a compiled graph's kernels follow its token bucket")])
def test_what_does_not_combine_is_refused_by_name(extra, why, capsys):
    code, _ = cli(["run", "--tp", "1", "--batch-invariant", *extra], capsys)
    assert code == 2
    assert capsys.readouterr().err == f"layer-boundary: error: --batch-invariant does not " \
                                      f"combine with {why}\n"
