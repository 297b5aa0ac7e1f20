"""``layer-boundary run`` end to end: real processes, real ranks, no mocks.

Each job runs once per module (fixtures) and several tests read its output, because a
multi-rank run costs seconds on a small CPU machine. The default job, torchrun and a missing
checkpoint run as subprocesses, so the console behaviour (exit status, bare stderr, the
processes left behind) is pinned as a user sees it; the other jobs call ``main()`` in this
process (``_in_process``: the same command, its ranks forked from this process's fork
server, without an interpreter and a torch import per job). Bad-input cases that fail
before any rank starts call ``main()`` too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layer_boundary.adapters.tbo import SHARED_CORES
from safetensors.torch import load_file

from distributed.checks import cli_ok, package_logger_kept
from layer_boundary.engine.cli import main
from layer_boundary.runtime.launch import free_port

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240
JSON_KEYS = {"verdict", "reason", "checks", "model_type", "model_impl", "tp", "dp", "ep", "pp",
             "boundary_reduction", "dtype", "stages", "audit", "prompts", "parity",
             "collectives"}
RESOLVED_REDUCTIONS = {"ar", "rs", "rsv", "rs+rsv"}
PROMPTS = [[1, 2, 3], [9, 8]]
PROMPT_ARGS = ["--prompt-ids", "1,2,3", "--prompt-ids", "9,8"]
NEW_TOKENS = 3  # not the default (4), so the length check sees the option


def _env(cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["LAYER_BOUNDARY_CACHE"] = str(cache)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _cli(*args, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layer_boundary", "run", *map(str, args)],
                          cwd=REPO, env=_env(cache), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _in_process(*args, cache: Path) -> subprocess.CompletedProcess:
    """``layer-boundary run ARGS`` through ``main()`` here, its output captured as a
    subprocess's would be (the cache folder set for the call, the package logger restored)."""
    before = os.environ.get("LAYER_BOUNDARY_CACHE")
    os.environ["LAYER_BOUNDARY_CACHE"] = str(cache)
    out, err = io.StringIO(), io.StringIO()
    try:
        with (package_logger_kept(), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            code = main(["run", *map(str, args)])
    finally:
        if before is None:
            del os.environ["LAYER_BOUNDARY_CACHE"]
        else:
            os.environ["LAYER_BOUNDARY_CACHE"] = before
    return subprocess.CompletedProcess(["layer-boundary", "run", *map(str, args)], code,
                                       out.getvalue(), err.getvalue())


def _one_json_object(proc: subprocess.CompletedProcess) -> dict:
    """The whole of stdout must parse as a single JSON object (a second one is 'Extra data')."""
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    return report


def _generated(report: dict) -> list[list[int]]:
    return [p["generated_ids"] for p in report["prompts"]]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------ jobs, run once each


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lb_cache")


@pytest.fixture(scope="module")
def default_run(cache_dir):
    """``layer-boundary run`` with no arguments, into an empty cache."""
    assert not any(cache_dir.iterdir())  # the run, not an earlier test, must write the checkpoint
    return _cli(cache=cache_dir)


@pytest.fixture(scope="module")
def builtin_dir(default_run, cache_dir) -> Path:
    configs = list(cache_dir.rglob("config.json"))
    assert len(configs) == 1, f"expected one checkpoint in the cache, found {configs}"
    return configs[0].parent


@pytest.fixture(scope="module")
def default_json(builtin_dir, cache_dir):
    """The default job again, with ``--json``; the cached checkpoint must be reused as is."""
    weights = builtin_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    proc = _in_process("--json", "--max-new-tokens", NEW_TOKENS, cache=cache_dir)
    return proc, before, weights.stat().st_mtime_ns


@pytest.fixture(scope="module")
def tp_runs(qwen3_dir, tmp_path_factory, cache_dir):
    """The same prompts on the HF-saved checkpoint at tp 2 (with parity), 4 and 1."""
    out = tmp_path_factory.mktemp("logits")
    runs = {}
    for tp, extra in ((2, []), (4, ["--no-reference"]), (1, [])):
        logits = out / f"tp{tp}.safetensors"
        proc = _in_process("--model", qwen3_dir, "--tp", tp, *PROMPT_ARGS, "--max-new-tokens",
                           NEW_TOKENS, "--json", "--logits-out", logits, *extra,
                           cache=cache_dir)
        runs[tp] = (_one_json_object(proc), logits)
    return runs


# ------------------------------------------------------------------ the default job


@pytest.mark.timeout(300)
def test_default_run_writes_the_builtin_checkpoint_in_hf_layout(default_run, builtin_dir):
    assert default_run.returncode == 0, default_run.stderr
    cfg = json.loads((builtin_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    weights = load_file(str(builtin_dir / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (cfg["vocab_size"], cfg["hidden_size"])
    for i in range(cfg["num_hidden_layers"]):
        assert f"model.layers.{i}.self_attn.q_proj.weight" in weights


@pytest.mark.timeout(300)
def test_default_run_prints_tokens_parity_plan_and_collectives(default_run, builtin_dir):
    out = default_run.stdout
    assert default_run.returncode == 0, default_run.stderr
    assert "Traceback" not in default_run.stderr
    assert re.search(r"\btp=4 dp=2\b", out), out  # the default topology

    generated = re.findall(r"prompt \d+ \[[\d, ]+\] -> generated \[([\d, ]+)\]", out)
    assert generated, out
    assert all(len(g.split(",")) == 4 for g in generated)  # default --max-new-tokens

    assert re.search(r"parity.*\bPASS\b", out), out

    # one table row per stage: an attention and an FFN boundary in every layer
    n_layers = json.loads((builtin_dir / "config.json").read_text())["num_hidden_layers"]
    for i in range(n_layers):
        for part in ("attn", "ffn"):
            assert re.search(rf"^\s+layer{i}\.{part}\s+\S", out, re.M), f"no row layer{i}.{part}"

    # the table's notation, explained after it (plan prints the same legend)
    from layer_boundary.engine.report import PATHS_LEGEND

    assert "\n".join(PATHS_LEGEND) in out
    per_forward = out[out.index("collectives per forward"):]
    assert re.search(r"step 0:", per_forward)
    assert re.search(r"\d+x all_reduce \d+ B", per_forward), per_forward


@pytest.mark.timeout(300)
def test_json_report_has_the_documented_shape_and_passes_parity(default_json, builtin_dir):
    proc, _, _ = default_json
    report = _one_json_object(proc)
    vocab = json.loads((builtin_dir / "config.json").read_text())["vocab_size"]

    assert set(report) == JSON_KEYS
    assert list(report)[0] == "verdict" and report["verdict"] == "PASS"
    assert report["reason"].startswith("parity PASS: tokens match, max |logit diff| ")
    assert report["tp"] == 4 and _is_int(report["tp"])
    assert report["dp"] == 2 and _is_int(report["dp"])
    assert report["boundary_reduction"] in RESOLVED_REDUCTIONS
    assert report["dtype"] == "float32"
    assert (report["model_type"], report["model_impl"]) == ("qwen3", "native")

    assert isinstance(report["prompts"], list) and report["prompts"]
    for p in report["prompts"]:
        assert set(p) == {"prompt_ids", "generated_ids"}
        assert p["prompt_ids"] and all(_is_int(t) for t in p["prompt_ids"])
        assert len(p["generated_ids"]) == NEW_TOKENS
        assert all(_is_int(t) and 0 <= t < vocab for t in p["generated_ids"])

    parity = report["parity"]
    assert set(parity) == {"tokens_match", "max_abs_diff", "non_finite", "logit_scale",
                           "tolerance", "tolerance_kind"}
    assert parity["non_finite"] == [] and parity["tolerance"] >= 1e-5
    assert parity["tolerance_kind"] == "absolute"  # fp32, no quantized reads
    assert parity["tokens_match"] is True
    assert isinstance(parity["max_abs_diff"], float)
    assert 0.0 <= parity["max_abs_diff"] <= 1e-5

    assert "all_reduce" in report["collectives"]
    for kind, c in report["collectives"].items():
        assert set(c) == {"count", "bytes"}, kind
        assert _is_int(c["count"]) and c["count"] > 0, kind
        assert _is_int(c["bytes"]) and c["bytes"] > 0, kind


@pytest.mark.timeout(300)
def test_json_run_reuses_the_cached_checkpoint(default_json):
    _, before, after = default_json
    assert before == after


@pytest.mark.timeout(300)
def test_json_and_text_reports_agree_on_tokens(default_run, default_json):
    # greedy decoding is deterministic, so 3 new tokens are a prefix of the 4 the text run made
    text_ids = [[int(t) for t in g.split(",")] for g in re.findall(
        r"-> generated \[([\d, ]+)\]", default_run.stdout)]
    json_ids = _generated(_one_json_object(default_json[0]))
    assert [g[:NEW_TOKENS] for g in text_ids] == json_ids


# ------------------------------------------------------------------ tp sizes, logits


@pytest.mark.timeout(300)
def test_tp_2_4_and_1_generate_the_same_tokens(tp_runs):
    generated = {tp: _generated(report) for tp, (report, _) in tp_runs.items()}
    assert generated[2] == generated[1]
    assert generated[4] == generated[1]
    for report, _ in tp_runs.values():
        assert [p["prompt_ids"] for p in report["prompts"]] == PROMPTS
        assert all(len(g) == NEW_TOKENS for g in _generated(report))


@pytest.mark.timeout(300)
def test_tp_sizes_are_reported(tp_runs):
    assert {tp: r["tp"] for tp, (r, _) in tp_runs.items()} == {2: 2, 4: 4, 1: 1}


@pytest.mark.timeout(300)
def test_parity_on_the_hf_checkpoint_and_none_without_reference(tp_runs):
    parity = tp_runs[2][0]["parity"]
    assert parity["tokens_match"] is True and parity["max_abs_diff"] <= 1e-5
    assert tp_runs[4][0]["parity"] is None  # --no-reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 1])
def test_logits_out_holds_one_fp32_vocab_vector_per_prompt_and_step(tp_runs, qwen3_dir, tp):
    report, path = tp_runs[tp]
    vocab = json.loads((Path(qwen3_dir) / "config.json").read_text())["vocab_size"]
    logits = load_file(str(path))
    assert set(logits) == {f"prompt{i}.step{j}"
                           for i in range(len(PROMPTS)) for j in range(NEW_TOKENS)}
    for i, generated in enumerate(_generated(report)):
        for j, token in enumerate(generated):
            step = logits[f"prompt{i}.step{j}"]
            assert step.dtype.is_floating_point and step.element_size() == 4  # float32
            assert step.shape == (vocab,)
            assert int(step.argmax()) == token, (i, j)


@pytest.mark.timeout(300)
def test_logits_out_agrees_across_tp(tp_runs):
    tp2, tp1 = (load_file(str(tp_runs[tp][1])) for tp in (2, 1))
    for key in tp1:
        assert (tp2[key] - tp1[key]).abs().max() <= 1e-5, key


# ------------------------------------------------------------------ dtype, torchrun


@pytest.mark.timeout(300)
def test_bfloat16_runs_and_reports_its_dtype(qwen3_dir, cache_dir):
    proc = _in_process("--model", qwen3_dir, "--dtype", "bfloat16", "--prompt-ids", "1,2,3",
                       "--max-new-tokens", 2, "--json", cache=cache_dir)
    # exit 1 is a legitimate parity FAIL for bf16; anything else is a crash or a usage error
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dtype"] == "bfloat16"
    assert [len(g) for g in _generated(report)] == [2]


@pytest.mark.timeout(300)
def test_torchrun_processes_with_attention_dp_report_once_with_parity(builtin_dir, cache_dir,
                                                                      default_json):
    # builtin_dir first: two torchrun ranks must not both be writing the cache checkpoint.
    # Two processes (each a torch import): tp is the world, and dp 2 splits its attention
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "layer_boundary", "run", "--json",
         "--dp", "2", "--max-new-tokens", str(NEW_TOKENS)],
        cwd=REPO, env=_env(cache_dir), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    report = _one_json_object(proc)
    assert (report["tp"], report["dp"]) == (2, 2)
    assert report["parity"]["tokens_match"] is True
    assert report["parity"]["max_abs_diff"] <= 1e-5
    assert _generated(report) == _generated(_one_json_object(default_json[0]))


@pytest.mark.timeout(300)
def test_attention_dp_with_an_empty_rank_generates_the_world1_tokens(qwen3_dir, cache_dir, tp_runs):
    # PROMPTS has 2 requests: on 4 DP ranks two ranks run no tokens, yet join every collective
    proc = _in_process("--model", qwen3_dir, "--tp", 4, "--dp", 4, "--boundary-reduction",
                       "rs+rsv", *PROMPT_ARGS, "--max-new-tokens", NEW_TOKENS, "--json",
                       cache=cache_dir)
    report = _one_json_object(proc)
    assert (report["tp"], report["dp"]) == (4, 4)
    assert report["parity"]["tokens_match"] is True and report["parity"]["max_abs_diff"] <= 1e-5
    assert _generated(report) == _generated(tp_runs[1][0])
    assert "reduce_scatter" in report["collectives"]


@pytest.mark.timeout(300)
def test_moe_checkpoint_runs_with_expert_parallelism(qwen3_moe_dir, cache_dir):
    # the model type comes from config.json; ep splits the experts over the TP ranks
    proc = _in_process("--model", qwen3_moe_dir, "--tp", 4, "--dp", 2, "--ep", 2, *PROMPT_ARGS,
                       "--max-new-tokens", NEW_TOKENS, "--json", cache=cache_dir)
    report = _one_json_object(proc)
    assert (report["tp"], report["dp"], report["ep"]) == (4, 2, 2)
    assert report["parity"]["tokens_match"] is True and report["parity"]["max_abs_diff"] <= 1e-5


@pytest.mark.timeout(300)
def test_deepseek_v3_checkpoint_runs_with_expert_parallelism(tmp_path_factory, cache_dir):
    from checkpoints.ds import hf_deepseek_v3

    path = hf_deepseek_v3(tmp_path_factory.mktemp("ds_cli"))
    proc = _in_process("--model", path, "--tp", 2, "--ep", 2, *PROMPT_ARGS, "--max-new-tokens",
                       NEW_TOKENS, "--json", cache=cache_dir)
    report = _one_json_object(proc)
    assert (report["tp"], report["dp"], report["ep"]) == (2, 1, 2)
    assert report["parity"]["tokens_match"] is True and report["parity"]["max_abs_diff"] <= 1e-5


def test_ep_that_does_not_divide_tp_is_a_one_line_error(qwen3_moe_dir, capsys, restore_logger):
    assert main(["run", "--model", str(qwen3_moe_dir), "--tp", "2", "--ep", "4"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "tp 2" in line and "moe_ep 4" in line


def test_text_prompts_use_the_checkpoint_tokenizer(qwen3_dir, tmp_path, capsys, restore_logger):
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "with_tokenizer"
    folder.mkdir()
    for f in Path(qwen3_dir).iterdir():
        (folder / f.name).symlink_to(f)
    vocab = {"[UNK]": 0, "hello": 5, "boundary": 17, "world": 42}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    out = cli_ok(["run", "--model", str(folder), "--tp", "1", "--max-new-tokens", "1", "--json",
                  "--prompt", "hello boundary world", "--prompt", "world"], capsys)
    report = json.loads(out)
    assert [p["prompt_ids"] for p in report["prompts"]] == [[5, 17, 42], [42]]


# ------------------------------------------------------------------ plan


def test_plan_reports_mode_rows_and_one_row_per_stage(qwen3_dir, capsys, restore_logger):
    out = cli_ok(["plan", "--model", str(qwen3_dir), "--tp", "4", "--dp", "4",
                  "--boundary-reduction", "auto", "--tokens", "5,0,3,1", "--json"], capsys)
    plan = json.loads(out)
    layers = json.loads((Path(qwen3_dir) / "config.json").read_text())["num_hidden_layers"]
    assert plan["mode"] == "rsv" and plan["tokens"] == [5, 0, 3, 1]
    assert [r["local"] for r in plan["ranks"]] == [5, 0, 3, 1]
    assert all(r["global"] == 9 for r in plan["ranks"])
    assert [s["stage"] for s in plan["stages"]] == [
        f"layer{i}.{k}" for i in range(layers) for k in ("attn", "ffn")]

    out = cli_ok(["plan", "--model", str(qwen3_dir), "--tp", "2", "--dp", "1",
                  "--boundary-reduction", "ar"], capsys)
    assert "row mode ar" in out
    assert re.search(r"layer1\.attn\s+all_reduce\(tp\)", out), out  # the deferred FFN sum


def test_plan_token_counts_must_match_dp(qwen3_dir, capsys, restore_logger):
    assert main(["plan", "--model", str(qwen3_dir), "--dp", "2", "--tokens", "1,2,3"]) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert "--tokens gives 3 DP token counts but --dp is 2" in err


def test_dp_that_does_not_divide_tp_is_a_one_line_error(qwen3_dir, capsys, restore_logger):
    assert main(["run", "--model", str(qwen3_dir), "--tp", "4", "--dp", "3"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "tp 4" in line and "attn_dp 3" in line


# ------------------------------------------------------------------ bad input


def _write(folder: Path, config_text: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        (folder / "config.json").write_text(config_text)
    return folder


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("layer-boundary: error:"), err
    return lines[0]


def test_missing_checkpoint_dir_as_a_user_sees_it(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    proc = _cli("--model", missing, cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert str(missing) in _one_line_error(proc.stderr)
    assert proc.stdout == ""


@pytest.mark.parametrize("case, needle", [
    ("missing_dir", "{path}"),
    ("malformed_json", "config.json"),
    ("unsupported_model_type", "gpt_neo"),
    ("no_safetensors_tp1", "safetensors"),
])
def test_bad_checkpoint_is_a_one_line_error(tmp_path, qwen3_dir, capsys, restore_logger,
                                            case, needle):
    folder = tmp_path / "ckpt"
    extra = []
    if case == "malformed_json":
        _write(folder, '{"model_type": "qwen3",\n')
    elif case == "unsupported_model_type":
        _write(folder, json.dumps({"model_type": "gpt_neo", "vocab_size": 96}))
    elif case == "no_safetensors_tp1":
        _write(folder, (Path(qwen3_dir) / "config.json").read_text())
        extra = ["--tp", "1"]  # the world-1 path loads in this process

    # small prompt ids: the default prompts do not fit this checkpoint's 96-token vocabulary.
    # An exception escaping main() would be a traceback for the user; here it fails the test.
    code = main(["run", "--model", str(folder), "--prompt-ids", "1,2,3", *extra])

    out, err = capsys.readouterr()
    assert code == 2
    assert needle.format(path=folder) in _one_line_error(err)
    if case == "unsupported_model_type":
        assert "model_type" in err
    assert out == ""


@pytest.mark.timeout(300)
def test_checkpoint_without_safetensors_at_default_tp_is_a_one_line_error(tmp_path, qwen3_dir):
    folder = _write(tmp_path / "ckpt", (Path(qwen3_dir) / "config.json").read_text())
    proc = _cli("--model", folder, "--prompt-ids", "1,2,3", cache=tmp_path / "cache")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2
    assert "safetensors" in _one_line_error(proc.stderr)


@pytest.mark.parametrize("args, needle", [
    (["--tp", "3", "--prompt-ids", "1,2,3"], "num_attention_heads"),
    (["--prompt-ids", "1,{vocab}"], "vocab_size"),
])
def test_input_the_model_cannot_take_is_a_one_line_error(qwen3_dir, capsys, restore_logger,
                                                         args, needle):
    cfg = json.loads((Path(qwen3_dir) / "config.json").read_text())
    assert cfg["num_attention_heads"] % 3 != 0  # the premise of the --tp 3 case
    args = [a.format(vocab=cfg["vocab_size"]) for a in args]

    code = main(["run", "--model", str(qwen3_dir), *args])  # must return, not raise

    out, err = capsys.readouterr()
    assert code == 2
    assert needle in _one_line_error(err)
    assert out == ""


@pytest.mark.parametrize("args, option", [
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bad_option_value_is_an_argparse_error(capsys, args, option):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args])

    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "Traceback" not in err
    assert err.startswith("usage:")
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert option in error_lines[0]
    assert out == ""


# ------------------------------------------------------------------ pipeline parallelism


def test_plan_shows_each_pipeline_stage_and_its_handoff(capsys, restore_logger):
    out = cli_ok(["plan", "--pp", "2", "--tp", "2", "--dp", "1", "--boundary-reduction", "rs",
                  "--json"], capsys)
    plan = json.loads(out)
    assert plan["pp"] == 2
    assert [(p["stage"], p["ranks"], p["layers"]) for p in plan["pipeline"]] == [
        (0, [0, 1], [0, 1]), (1, [2, 3], [2, 2])]
    assert plan["pipeline"][0]["handoff"] == (
        "to_pp() completes per-batch work and applies the update; layer2.attn.from_pp() takes "
        "the residual on attn_tp_scatter")
    assert [(r["pp_stage"], r["stage"]) for r in plan["stages"]] == [
        (0, "layer0.attn"), (0, "layer0.ffn"), (0, "layer1.attn"), (0, "layer1.ffn"),
        (1, "layer2.attn"), (1, "layer2.ffn")]
    out = cli_ok(["plan", "--pp", "3", "--pp-layers", "1,1,1", "--tp", "1", "--dp", "1"], capsys)
    assert "pipeline stage 2 (ranks 2-2): layers 2-2" in out


@pytest.mark.parametrize("args,message", [
    (["--pp", "4"], "pp=4 exceeds the model's 3 layers"),
    (["--pp", "2", "--pp-layers", "2,2"], "--pp-layers 2,2 holds 4 layers; the model has 3"),
    (["--pp", "2", "--pp-layers", "3,0"], "--pp-layers 3,0: every stage needs at least one layer"),
    (["--pp", "3", "--pp-layers", "2,1"], "--pp-layers 2,1 gives 2 stages; pp=3"),
    (["--pp-layers", "2,1"], "--pp-layers 2,1 needs --pp 2"),
])  # --pp against the other features: tests/test_combinations.py
def test_bad_pipeline_options_are_one_line_errors(args, message, capsys, restore_logger):
    assert main(["run", "--tp", "1", "--dp", "1", *args]) == 2
    assert _one_line_error(capsys.readouterr().err).endswith(message)


@pytest.mark.timeout(120)
def test_a_failed_stage_ends_the_whole_job(qwen3_dir, tmp_path, capsys, restore_logger):
    """Stage 1 cannot load its layer (a tensor of the wrong shape); stage 0 loads, runs and
    sends to it. The job ends with the failing stage's error instead of waiting on the dead
    peer: the collective timeout is beyond this test's own, so only the job's handling of the
    failure can end it in time (a wait on the peer is a hang)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"  # the last of 3 layers: stage 1's only
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, broken / "model.safetensors")
    code = main(["run", "--model", str(broken), "--pp", "2", "--tp", "1", "--dp", "1",
                 "--max-new-tokens", "2", "--collective-timeout", "3600"])
    assert code == 2
    assert name in _one_line_error(capsys.readouterr().err)


# ------------------------------------------------------------------ two-batch overlap


@pytest.mark.timeout(240)
def test_tbo_run_passes_parity(qwen3_dir, capsys, restore_logger):
    args = ["run", "--model", str(qwen3_dir), "--tp", "4", "--dp", "2", *PROMPT_ARGS,
            "--prompt-ids", "4,5,6,7", "--max-new-tokens", "2"]
    out = cli_ok([*args, "--tbo", "always"], capsys)
    assert "two-batch overlap (always): 2 of 2 forwards split: always" in out
    assert "parity vs world 1: PASS" in out
    # auto splits where the overlap pays, which gloo's CPU ranks never are; the report says so
    report = json.loads(cli_ok([*args, "--tbo", "--json"], capsys).strip().splitlines()[-1])
    assert report["tbo"]["policy"] == "auto" and report["tbo"]["split"] == [False, False]
    assert report["tbo"]["reasons"] == [SHARED_CORES]
    assert report["parity"]["tokens_match"]


def test_plan_shows_both_microbatches(capsys, restore_logger):
    out = cli_ok(["plan", "--tbo", "--tokens", "5,1", "--json"], capsys)
    plan = json.loads(out)
    a, b = plan["microbatches"]
    assert (a["tokens"], b["tokens"]) == ([3, 1], [2, 0])
    assert [r["local"] for r in b["ranks"]] == [2, 2, 0, 0] and b["mode"] == plan["mode"]


# --tbo against the other features: tests/test_combinations.py walks every pair


# ------------------------------------------------------------------ input refused up front


def test_positions_past_max_position_embeddings_are_refused(qwen3_dir, capsys, restore_logger):
    limit = json.loads((Path(qwen3_dir) / "config.json").read_text())["max_position_embeddings"]
    assert main(["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1", "--prompt-ids",
                 "1,2,3", "--max-new-tokens", str(limit)]) == 2
    assert _one_line_error(capsys.readouterr().err).endswith(
        f"--max-new-tokens {limit} after a 3-token prompt needs {limit + 3} positions; the "
        f"checkpoint's max_position_embeddings is {limit}")
    long_prompt = ",".join(["1"] * (limit + 1))
    assert main(["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1", "--prompt-ids",
                 long_prompt]) == 2
    assert f"prompt 0 has {limit + 1} tokens" in _one_line_error(capsys.readouterr().err)


def test_ep_on_a_dense_model_is_an_error(qwen3_dir, capsys, restore_logger):
    assert main(["run", "--model", str(qwen3_dir), "--tp", "2", "--ep", "2"]) == 2
    assert "--ep 2 splits MoE experts over ranks; the qwen3 checkpoint" in _one_line_error(
        capsys.readouterr().err)


def test_bench_with_a_hidden_size_the_heads_cannot_split(capsys, restore_logger):
    with pytest.raises(SystemExit) as refused:  # argparse's refusal
        main(["bench", "--hidden", "60"])
    assert refused.value.code == 2
    assert "argument --hidden: 60 is not a multiple of 16" in capsys.readouterr().err


def test_an_unwritable_cache_is_a_one_line_error(tmp_path, capsys, restore_logger, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("LAYER_BOUNDARY_CACHE", str(blocked / "sub"))
    assert main(["run", "--tp", "1", "--dp", "1"]) == 2
    assert "cannot write the built-in checkpoint" in _one_line_error(capsys.readouterr().err)


@pytest.mark.timeout(180)
def test_run_leaves_no_process_behind_in_its_process_group(qwen3_dir):
    """``layer-boundary run`` as a shell starts it, in a session of its own: once it exits,
    its process group holds only the shell (before the launcher stopped multiprocessing's
    resource tracker, the tracker outlived the run as an unreaped process)."""
    script = (f"{sys.executable} -m layer_boundary run --model {qwen3_dir} --tp 2 "
              "--max-new-tokens 1 --no-reference > /dev/null 2>&1; echo rc=$?; "
              "ps -o pid=,stat=,args= -g $(ps -o pgid= -p $$)")
    out = subprocess.run(["setsid", "bash", "-c", script], capture_output=True, text=True,
                         timeout=150).stdout.splitlines()
    assert out[0] == "rc=0", out
    left = [line for line in out[1:] if "bash -c" not in line and "ps -o" not in line]
    assert left == [], f"left behind in the run's process group: {left}"


@pytest.mark.parametrize("argv,code,message", [
    (["run", "--tp", "3", "--dp", "2", "--json"], 2, "dp"),  # a topology refused by name
    (["run", "--tp", "two", "--json"], 2, "the arguments were refused"),  # argparse's refusal
])
def test_json_prints_one_object_for_a_refused_job(argv, code, message, capsys, restore_logger):
    """Under --json every outcome is one JSON object on stdout: a named error too (it printed
    nothing there), with its exit code; the one-line error stays on stderr."""
    try:
        got = main(argv)
    except SystemExit as exc:
        got = exc.code
    assert got == code
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["verdict"] == "ERROR" and record["exit_code"] == code
    assert message in record["error"], record
    assert captured.err.strip()
