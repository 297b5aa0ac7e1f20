"""``--model`` takes a Hugging Face repo id: resolved from the hub's cache, laid out as the
hub lays it out (``models--ORG--NAME/snapshots/<commit>/`` and ``refs/main``), without a
download when ``HF_HUB_OFFLINE`` is set; a repo id in no cache is a one-line error."""

from __future__ import annotations

import json
import shutil

from distributed.checks import cli_ok

from layer_boundary.engine.cli import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, checkpoint, repo="tiny-org/tiny-qwen3"):
    org, name = repo.split("/")
    snapshot = root / f"models--{org}--{name}" / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    (root / f"models--{org}--{name}" / "refs").mkdir()
    (root / f"models--{org}--{name}" / "refs" / "main").write_text(COMMIT)
    return repo


def test_a_repo_id_runs_from_the_hub_cache(qwen3_dir, tmp_path, monkeypatch, capsys,
                                           restore_logger):
    repo = hub_cache(tmp_path / "hub", qwen3_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = json.loads(cli_ok(["run", "--model", repo, "--tp", "1", "--dp", "1", "--json",
                                "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                               capsys).strip().splitlines()[-1])
    direct = json.loads(cli_ok(["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1",
                                "--json", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                               capsys).strip().splitlines()[-1])
    assert report["prompts"] == direct["prompts"]


def test_a_repo_id_in_no_cache_is_a_one_line_error(tmp_path, monkeypatch, capsys,
                                                   restore_logger):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "tiny-org/absent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: --model tiny-org/absent: no such folder, and the repo id is not "
        "in the Hugging Face cache (HF_HUB_OFFLINE is set, so nothing is downloaded)"]
