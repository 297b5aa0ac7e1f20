"""``--moe-a2a-backend`` on ``plan`` and ``run``: the MoE stage's rows and its dispatch as
``plan`` shows them, and the refusals (a dense model, uneven experts, the ar policy where the
attention rows are replicated), each a one-line error before any rank starts (what it does not
combine with: ``tests/test_combinations.py``)."""

from __future__ import annotations

import json

import pytest
from checkpoints import hf_qwen3_moe

from distributed.checks import cli_ok
from layer_boundary.engine.cli import main


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layer-boundary: error:"), err
    return lines[0]


@pytest.mark.parametrize("tp,dp,tokens,residual", [("4", "2", "5,3", "attn_dp+attn_tp_scatter"),
                                                   ("4", "4", "2,0,3,1", "attn_dp")])
def test_plan_shows_the_moe_on_the_attention_rows(qwen3_moe_dir, tp, dp, tokens, residual,
                                                  capsys, restore_logger):
    args = ["plan", "--model", str(qwen3_moe_dir), "--tp", tp, "--dp", dp, "--ep", tp,
            "--tokens", tokens]
    gathered = json.loads(cli_ok([*args, "--json"], capsys))
    plan = json.loads(cli_ok([*args, "--moe-a2a-backend", "all_to_all", "--json"], capsys))
    assert plan["moe_a2a_backend"] == "all_to_all" and gathered["moe_a2a_backend"] == "none"
    for before, stage in zip(gathered["stages"], plan["stages"]):
        if "sparse" not in stage["kind"]:
            assert stage["compute"] == before["compute"], stage  # only the MoE stages move
            continue
        assert before["compute"] == "replicated" and "all_gather" in before["entry"]
        assert stage["compute"] == stage["residual"] == residual, stage
        assert "all_gather" not in stage["entry"], stage
        assert stage["exit"] == "complete: all_to_all(tp) dispatch and combine in compute"
        assert "all-to-all dispatch" in stage["kind"]
    assert "MoE all_to_all dispatch" in cli_ok([*args, "--moe-a2a-backend", "all_to_all"],
                                               capsys)


@pytest.fixture(scope="module")
def six_experts(tmp_path_factory) -> str:
    return str(hf_qwen3_moe(tmp_path_factory.mktemp("six_experts") / "qwen3_moe",
                            num_experts=6))


@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("case,args,message", [
    ("dense", ["--tp", "2"], "qwen3 cannot run moe_a2a_backend=all_to_all: it has no MoE "
                             "layers to dispatch"),
    ("uneven", ["--tp", "4", "--dp", "4", "--ep", "4"], "num_experts=6 is not divisible by ep=4"),
    ("ar", ["--tp", "4", "--dp", "2", "--ep", "4", "--boundary-reduction", "ar"],
     "--moe-a2a-backend all_to_all dispatches from rows no other rank holds: with attention TP "
     "2 those are the scattered rows, and --boundary-reduction ar "
     "(BoundaryRuntime.boundary_reduction) has none")])
def test_what_the_backend_cannot_run_is_a_one_line_error(qwen3_moe_dir, six_experts, command,
                                                         case, args, message, capsys,
                                                         restore_logger):
    model = {"dense": None, "uneven": six_experts}.get(case, str(qwen3_moe_dir))
    argv = [command, *(["--model", model] if model else []), *args,
            "--moe-a2a-backend", "all_to_all"]
    assert main(argv) == 2
    assert message in _one_line_error(capsys.readouterr().err)


# the backend against every other feature: tests/test_combinations.py walks every pair
