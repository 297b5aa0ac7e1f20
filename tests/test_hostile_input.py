"""Hostile checkpoints and arguments through ``layer-boundary run``: each ends in a one-line
error naming the problem (exit 2), before any memory the config.json asks for is allocated
and before any file that is not a regular one is replaced; a SIGTERM is named.

The bad inputs are made from a real tiny checkpoint (a config.json field that lies about the
weights, a corrupt or non-file safetensors); the memory bound is proven by running the CLI
under an address-space limit far below what the lying config asks for.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from layer_boundary.engine.cli import main

REPO = Path(__file__).resolve().parent.parent
ERROR = "layer-boundary: error: "


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _one_line_error(capsys, argv, expected: str) -> str:
    assert main(["run", "--tp", "1", "--no-reference", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(ERROR) and err.count("\n") == 1, err
    assert expected in err, err
    return err


# every size field, far past the weights: each would allocate (or build) for minutes
LIES = {"vocab_size": 160_000_000, "hidden_size": 1_000_000, "intermediate_size": 100_000_000,
        "num_attention_heads": 1_000_000, "num_key_value_heads": 1_000_000,
        "head_dim": 100_000_000, "num_hidden_layers": 1_000_000}


@pytest.mark.parametrize("field", LIES)
def test_a_config_that_asks_for_more_than_its_weights_is_refused_before_building(
        qwen3_dir, tmp_path, capsys, restore_logger, field):
    lie = {field: LIES[field]}
    if field == "num_key_value_heads":  # as many query heads: the grouping holds, the sizes lie
        lie["num_attention_heads"] = LIES[field]
    model = _copy(qwen3_dir, tmp_path / "m", **lie)
    expected = ("and the checkpoint's tensors hold 3 layers" if field == "num_hidden_layers"
                else "and the checkpoint's tensors hold")
    _one_line_error(capsys, ["--model", model], expected)


def _limited(limit_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


def test_nothing_the_lying_config_asks_for_is_allocated(qwen3_dir, tmp_path):
    """Under an address-space limit 4 GB above the process's start-up, a config asking for
    20 GB of embedding is refused by name, not by the allocator."""
    model = _copy(qwen3_dir, tmp_path / "m", vocab_size=160_000_000)
    probe = subprocess.run([sys.executable, "-c", "import torch, layer_boundary.engine.cli; "
                            "print(open('/proc/self/statm').read().split()[0])"],
                           env=_env(), capture_output=True, text=True, check=True)
    start = int(probe.stdout.split()[-1]) * resource.getpagesize()
    proc = subprocess.run([sys.executable, "-m", "layer_boundary", "run", "--tp", "1",
                           "--model", str(model)], env=_env(), capture_output=True, text=True,
                          timeout=120, preexec_fn=_limited(start + 4 * 2 ** 30))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(ERROR + "config.json asks for 20,480,"), proc.stderr


def test_a_job_larger_than_the_machine_is_refused_with_both_figures(qwen3_dir, capsys,
                                                                    restore_logger,
                                                                    monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_MEMORY_GB", "0.0001")  # a 100 KB machine
    err = _one_line_error(capsys, ["--model", qwen3_dir], "config.json asks for ")
    assert "per rank (parameters " in err and "this machine has 104.9 KB available" in err


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "-1", "0"])
def test_a_memory_budget_that_is_no_positive_number_is_named(qwen3_dir, capsys, restore_logger,
                                                             monkeypatch, value):
    monkeypatch.setenv("LAYER_BOUNDARY_MEMORY_GB", value)
    err = _one_line_error(capsys, ["--model", qwen3_dir],
                          f"LAYER_BOUNDARY_MEMORY_GB={value!r} must be a positive, finite")
    assert "Traceback" not in err


def test_plan_prints_the_estimate(qwen3_dir, capsys, restore_logger):
    assert main(["plan", "--model", str(qwen3_dir), "--tp", "2", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    from layer_boundary.models import load_model
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    world1 = load_model(qwen3_dir, BoundaryRuntime(build_parallel(ParallelDims(world_size=1))))
    full = sum(p.numel() * p.element_size() for p in world1.parameters())
    # two tp ranks each hold about half of the weights (norms are replicated)
    assert full / 2 <= memory["parameters"] < full * 0.6
    assert memory["ranks"] == 2 and memory["total"] == 2 * memory["per_rank"]


def _truncated(f: Path):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _empty(f: Path):
    f.write_bytes(b"")


def _lying_offsets(f: Path):
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


def _pickle(f: Path):
    torch.save({"w": torch.zeros(2)}, f)


def _huge_header(f: Path):
    f.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")


CORRUPT = {"truncated": _truncated, "empty": _empty, "lying offsets": _lying_offsets,
           "pickle": _pickle, "huge header": _huge_header}


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8-config"])
@pytest.mark.parametrize("case", CORRUPT)
def test_a_corrupt_weights_file_is_a_named_error(qwen3_dir, tmp_path, capsys, restore_logger,
                                                 case, fp8):
    config = ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [16, 16]}} if fp8 else {})
    model = _copy(qwen3_dir, tmp_path / "m", **config)
    CORRUPT[case](model / "model.safetensors")
    _one_line_error(capsys, ["--model", model], "model.safetensors is not a readable "
                    "safetensors file")


def _devzero(f: Path):
    f.unlink()
    f.symlink_to("/dev/zero")


def _fifo(f: Path):
    f.unlink()
    os.mkfifo(f)


def _folder(f: Path):
    f.unlink()
    f.mkdir()


@pytest.mark.parametrize("make", [_devzero, _fifo, _folder], ids=["dev-zero", "fifo", "folder"])
def test_weights_that_are_not_a_regular_file_are_refused(qwen3_dir, tmp_path, capsys,
                                                         restore_logger, make):
    model = _copy(qwen3_dir, tmp_path / "m")
    make(model / "model.safetensors")
    _one_line_error(capsys, ["--model", model], "model.safetensors is not a regular file")


@pytest.mark.parametrize("text, expected", [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than a JSON reader follows"),
    (b"\xff\xfe{}", "is not valid JSON"),
], ids=["deep", "binary"])
def test_a_config_json_no_reader_takes_is_a_named_error(qwen3_dir, tmp_path, capsys,
                                                        restore_logger, text, expected):
    model = _copy(qwen3_dir, tmp_path / "m")
    if isinstance(text, bytes):
        (model / "config.json").write_bytes(text)
    else:
        (model / "config.json").write_text(text)
    _one_line_error(capsys, ["--model", model], expected)


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_empty_token_id_is_refused(command, capsys):
    """``--prompt-ids 1,,2`` (or ``1,2,``) ran the prompt [1, 2]."""
    for text in ("1,,2", "1,2,"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--prompt-ids", text])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().endswith(
            f"argument --prompt-ids: --prompt-ids '{text}' has an empty id between its commas")


@pytest.mark.parametrize("value, expected", [("0.001", "must be at least 1 s"),
                                             ("1e308", "at most 604800")])
def test_a_collective_timeout_out_of_range_is_a_usage_error(capsys, value, expected):
    with pytest.raises(SystemExit) as stop:
        main(["run", "--collective-timeout", value])
    assert stop.value.code == 2
    assert expected in capsys.readouterr().err


def test_logits_are_never_renamed_over_a_fifo(qwen3_dir, tmp_path, capsys, restore_logger):
    fifo = tmp_path / "logits"
    os.mkfifo(fifo)
    _one_line_error(capsys, ["--model", qwen3_dir, "--logits-out", fifo], "not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_device_is_refused_as_the_logits_file(qwen3_dir, capsys, restore_logger):
    _one_line_error(capsys, ["--model", qwen3_dir, "--logits-out", "/dev/full"], "a device")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def _small_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_failed_logits_write_is_named_and_leaves_nothing(qwen3_dir, tmp_path):
    """The logits (about 2 KB a step here) written past a 4 KB file-size limit: the write
    fails as on a full disk, after the run; one line, exit 2, no file, no temporary left."""
    out = tmp_path / "out" / "logits.safetensors"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "layer_boundary", "run", "--tp", "1",
                           "--model", str(qwen3_dir), "--logits-out", str(out),
                           "--max-new-tokens", "4"], env=_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=_small_files)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(ERROR + f"--logits-out {out}: could not write it"), proc.stderr
    assert list(out.parent.iterdir()) == []


def test_a_logits_file_replaces_a_regular_file(qwen3_dir, tmp_path, capsys, restore_logger):
    out = tmp_path / "logits.safetensors"
    out.write_text("old")
    assert main(["run", "--tp", "1", "--model", str(qwen3_dir), "--no-reference",
                 "--logits-out", str(out), "--max-new-tokens", "2"]) == 0
    from safetensors.torch import load_file

    assert len(load_file(out)) == 3 * 2  # the three default prompts, two steps each


def test_speculative_steps_past_the_tokens_emitted_are_bounded(qwen3_dir, capsys,
                                                              restore_logger):
    """100,000 draft steps for 4 tokens ran for ever; a round now proposes at most the tokens
    a request emits, and the job ends with the target's own greedy tokens."""
    argv = ["run", "--tp", "1", "--model", str(qwen3_dir), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "4", "--json", "--no-reference"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--draft-model", str(qwen3_dir), "--speculative-steps", "100000"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["prompts"] == plain["prompts"]
    stats = drafted["speculative"]  # a verification emits at most 4 proposals and its own
    assert stats["target_forwards"] >= 1 and stats["tokens_per_target_forward"] <= 4 + 1


def test_sigterm_is_named(qwen3_dir):
    proc = subprocess.Popen([sys.executable, "-m", "layer_boundary", "run", "--tp", "2",
                             "--model", str(qwen3_dir), "--start-timeout", "600"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:  # the job says it starts its ranks before it waits on them
            if line.startswith("starting 2 rank processes"):
                break
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == ("layer-boundary: stopped by SIGTERM; every rank it "
                                            "started is stopped")


def test_a_library_load_refuses_the_lying_config_before_allocating(qwen3_dir, tmp_path):
    from layer_boundary.models import CheckpointError, load_model
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    model = _copy(qwen3_dir, tmp_path / "m", intermediate_size=100_000_000)
    with pytest.raises(CheckpointError, match="^config.json asks for .* parameters, and the "
                                              "checkpoint's tensors hold "):
        load_model(model, BoundaryRuntime(build_parallel(ParallelDims(world_size=1))))


def test_a_folder_loaded_once_then_rewritten_to_lie_is_refused(qwen3_dir, tmp_path):
    """The size check is remembered for what a folder holds, not for its path: after a load
    of it passed, the same folder with a lying config.json is refused in the same process."""
    from layer_boundary.models import CheckpointError, load_model
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    model = _copy(qwen3_dir, tmp_path / "m")
    runtime = BoundaryRuntime(build_parallel(ParallelDims(world_size=1)))
    load_model(model, runtime)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100_000_000}))
    with pytest.raises(CheckpointError, match="^config.json asks for .* parameters, and the "
                                              "checkpoint's tensors hold "):
        load_model(model, runtime)



def test_a_missing_triton_is_named_before_any_rank(qwen3_dir, capsys, restore_logger,
                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # what an import of it then raises
    _one_line_error(capsys, ["--model", qwen3_dir, "--tp", 2, "--fusions", "triton"],
                    "--fusions triton needs the triton package, which is not installed (pip "
                    "install triton)")


def test_plan_tokens_past_the_positions_are_named(qwen3_dir, capsys, restore_logger):
    """A plan's --tokens was built as a list of ids: 10**11 of them was a MemoryError."""
    assert main(["plan", "--model", str(qwen3_dir), "--tokens", "100000000000,1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    limit = json.loads((qwen3_dir / "config.json").read_text())["max_position_embeddings"]
    assert err == [f"{ERROR}--tokens 100000000000 on one DP rank is more than the {limit} "
                   "positions a request may have here (the checkpoint's "
                   "max_position_embeddings, at most 16,777,216)"]


@pytest.mark.parametrize("argv,message", [
    (["--model", ""], "--model is empty: give a path (leave the flag out for the built-in "
                      "tiny model)"),
    (["--logits-out", " "], "--logits-out is empty: give a path (leave the flag out for no "
                            "file)"),
    (["--speculative-boundary-reduction", "ar"],
     "--speculative-boundary-reduction sets the draft stack's policy; there is no draft here "
     "(--draft-model or --speculative-algorithm)")], ids=["model", "logits-out", "draft-policy"])
def test_a_flag_that_would_do_nothing_is_refused(argv, message, capsys, restore_logger):
    """An empty --model ran the built-in model; an empty --logits-out wrote nothing; a draft
    policy without a draft was ignored: each silently."""
    assert main(["run", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [ERROR + message]


def test_an_agreement_check_value_the_ranks_would_misread_is_refused(monkeypatch, capsys,
                                                                     restore_logger):
    monkeypatch.setenv("LAYER_BOUNDARY_CHECK_AGREEMENT", "maybe")  # read as off
    assert main(["run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        ERROR + "LAYER_BOUNDARY_CHECK_AGREEMENT='maybe' must be 1 (check that ranks agree "
                "before each collective) or 0"]


@pytest.mark.parametrize("env,message", [
    ({"TORCHELASTIC_RUN_ID": "job"}, "RANK is not set: a torchrun worker's environment names "
                                     "its rank, the world and the rendezvous (launch with "
                                     "torchrun)"),
    ({"RANK": "abc", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "RANK='abc' must be an integer of at least 0 (torchrun sets it)"),
], ids=["run-id-without-rank", "rank-abc"])
def test_a_broken_torchrun_environment_is_named(env, message, monkeypatch, capsys,
                                                restore_logger):
    """TORCHELASTIC_RUN_ID without RANK was a KeyError traceback; RANK=abc an int() error
    naming no variable."""
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [ERROR + message]


@pytest.mark.parametrize("argv,message", [
    (["--hidden", "8"], "argument --hidden: 8 is not a multiple of 16 (8 attention heads of an "
                        "even head_dim, which the rotary turns in pairs)"),
    (["--layers", "100000000"], "argument --layers: 100000000 is more than 128, the most the "
                                "benchmark takes"),
    (["--requests", "100000000"], "argument --requests: 100000000 is more than 1024"),
    (["--repeats", "100000000"], "argument --repeats: 100000000 is more than 1000"),
], ids=["hidden-8", "layers", "requests", "repeats"])
def test_bench_sizes_are_bounded_before_anything_is_built(argv, message, capsys):
    """--layers 100000000 built layers for ever, --requests 100000000 was a MemoryError,
    --hidden 8 (a multiple of 8, as --help asked) "not enough values to unpack"."""
    with pytest.raises(SystemExit) as stop:
        main(["bench", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_bench_larger_than_the_machine_is_refused_with_both_figures(monkeypatch, capsys,
                                                                      restore_logger):
    """Each flag within its bound, together more than the memory there is: one line, before
    any layer is built (the figure from a meta-device build)."""
    monkeypatch.setenv("LAYER_BOUNDARY_MEMORY_GB", "0.01")
    assert main(["bench"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        ERROR + r"bench --hidden 256 --layers 8 --requests 16 needs about [\d.]+ MB; this "
                r"machine has 10.24 MB available", lines[0]), lines


def test_a_model_path_that_is_a_file_is_named_as_one(qwen3_dir, capsys, restore_logger):
    """It said the folder "does not exist" of a config.json that does."""
    config = qwen3_dir / "config.json"
    assert main(["run", "--model", str(config)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{ERROR}checkpoint directory {config} is a file, not a folder (give the folder "
        "holding config.json)"]
