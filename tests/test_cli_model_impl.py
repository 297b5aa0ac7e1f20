"""``--model-impl auto|native|transformers`` (vLLM's and SGLang's flag) on ``run``, ``plan``,
``sweep`` and ``bench``: each command serves the implementation asked, every rank and sweep
row the same one, and the report and ``--json`` say which ran. The Transformers backend's own
numbers (each architecture against transformers, tp 2 against world 1) are proved in
tests/models; here, that the command line reaches it and says so."""

from __future__ import annotations

import json

import pytest
from checkpoints.generic import hf_tiny

from distributed.checks import cli, cli_ok
from layer_boundary.engine.args import MODEL_IMPLS, build_parser


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama (we have a model file for it) and a tiny Qwen2 (we have none)."""
    root = tmp_path_factory.mktemp("model_impl")
    return {name: str(hf_tiny(name, root / name)) for name in ("llama", "qwen2")}


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layer-boundary: error:"), err
    return lines[0]


@pytest.mark.timeout(120)
def test_run_on_the_transformers_backend_passes_parity_and_says_so(models, capsys,
                                                                    restore_logger):
    """A Llama, which has a model file of ours, served by the Transformers backend at tp 2:
    parity with world 1 (the same backend on one rank), and the report names the backend
    each rank's model is (not only what was asked)."""
    out = cli_ok(["run", "--model", models["llama"], "--model-impl", "transformers", "--tp",
                  "2", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "2"], capsys)
    lines = out.splitlines()
    assert "model: llama (transformers backend)" in lines, out
    header = next(line for line in lines if line.startswith("layer-boundary run:"))
    assert "(asked auto, by the transformers backend)" in header, out  # its policy
    assert any(line.startswith("parity vs world 1: PASS (tokens match") for line in lines), out


@pytest.mark.parametrize("model, impl, served", [("llama", "auto", "native"),
                                                 ("qwen2", "auto", "transformers"),
                                                 ("llama", "native", "native")])
def test_run_json_names_the_implementation_that_ran(models, capsys, restore_logger, model,
                                                    impl, served):
    """auto keeps our model file where there is one and takes the Transformers backend
    where there is none; ``--json`` says which ran, beside config.json's model_type."""
    out = cli_ok(["run", "--model", models[model], "--model-impl", impl, "--tp", "1", "--dp",
                  "1", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"], capsys)
    record = json.loads(out.strip().splitlines()[-1])
    assert (record["model_type"], record["model_impl"]) == (model, served)


@pytest.mark.parametrize("command", ["run", "plan", "sweep"])
def test_native_on_a_model_we_have_no_file_for_is_refused(models, capsys, command):
    """``--model-impl native`` on a Qwen2 checkpoint: the checkpoint error naming its
    model_type, one line, exit 2, before any rank starts (each command opens the checkpoint
    with the implementation asked)."""
    code, _ = cli([command, "--model", models["qwen2"], "--model-impl", "native"], capsys)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "config.json model_type 'qwen2' is not supported" in _one_line_error(err)


def test_plan_on_the_transformers_backend(models, capsys, restore_logger):
    """``plan --model-impl transformers`` builds the Transformers backend's stages on the
    meta device and names it, in the table and in ``--json``; without the flag the same
    checkpoint plans our own model."""
    args = ["plan", "--model", models["llama"], "--tp", "2", "--dp", "1"]
    out = cli_ok([*args, "--model-impl", "transformers"], capsys)
    assert out.splitlines()[1] == "model: llama (transformers backend)", out
    record = json.loads(cli_ok([*args, "--model-impl", "transformers", "--json"], capsys))
    assert (record["model_type"], record["model_impl"]) == ("llama", "transformers")
    assert json.loads(cli_ok([*args, "--json"], capsys))["model_impl"] == "native"


def test_sweep_rows_run_the_implementation_asked(models, capsys, restore_logger):
    """Each sweep row is ``run``'s arguments with the sweep's ``--model-impl``: a Llama's
    draft row (the checkpoint drafting for itself) runs on our Llama, and is refused on the
    Transformers backend, which serves no draft, by the capability table's reason."""
    args = ["sweep", "--model", models["llama"], "--max-world", "1", "--features", "draft",
            "--json"]
    code, out = cli([*args, "--model-impl", "transformers"], capsys)
    record = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and record["run"] == 0, out
    assert (record["model_type"], record["model_impl"]) == ("llama", "transformers")
    assert [r["why"] for r in record["refused"]] == [
        "the transformers backend cannot run speculative decoding (--draft-model, "
        "--speculative-algorithm): it serves no draft or NextN stack"]


def test_bench_times_the_transformers_backend(capsys, restore_logger):
    """``bench --model-impl transformers`` times the Transformers backend's Qwen3 (its
    hand-written forward runs the same transformers modules) and says so; with --compile
    it is refused by name (the backend runs transformers' modules eagerly)."""
    out = cli_ok(["bench", "--model-impl", "transformers", "--hidden", "64", "--layers", "1",
                  "--requests", "1", "--repeats", "1"], capsys)
    assert "decode step, world 1, qwen3 (transformers backend), hidden 64" in out, out
    code, _ = cli(["bench", "--model-impl", "transformers", "--compile", "eager"], capsys)
    err = capsys.readouterr().err
    assert code == 2
    assert _one_line_error(err) == (
        "layer-boundary: error: bench --compile: the transformers backend (--model-impl "
        "transformers) does not compile: it runs transformers' modules eagerly")


@pytest.mark.parametrize("command", ["run", "plan", "sweep", "bench"])
def test_an_unknown_implementation_is_refused_by_argparse(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--model-impl", "hf"])
    assert exc.value.code == 2
    assert "--model-impl: invalid choice: 'hf'" in capsys.readouterr().err


def test_the_flag_offers_what_open_checkpoint_takes():
    from layer_boundary.models.checkpoint import IMPLS

    assert MODEL_IMPLS == IMPLS


def test_ranks_reopen_a_checkpoint_read_for_another_implementation(models):
    """``with_checkpoints`` (what every rank and sweep row is handed) keeps a checkpoint
    read for the implementation asked, and reopens one read for another."""
    from layer_boundary.engine.runner import RunSpec, with_checkpoints
    from layer_boundary.models import open_checkpoint

    native = open_checkpoint(models["llama"])
    assert native.impl == "native"
    spec = RunSpec(models["llama"], model_impl="transformers", checkpoint=native)
    assert with_checkpoints(spec).checkpoint.impl == "transformers"
    kept = RunSpec(models["llama"], model_impl="native", checkpoint=native)
    assert with_checkpoints(kept).checkpoint is native
