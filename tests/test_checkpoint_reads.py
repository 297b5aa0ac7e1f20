"""A checkpoint's config.json is read once per run: the command line opens each checkpoint
once (``models.open_checkpoint``: folder, raw dict, parsed config, model class) and hands that
``Checkpoint`` to the runner, the loader and the reports, which never read the file again.

World-1 runs keep every rank in this process, so every read is seen; ranks that are spawned
are handed the same ``RunSpec`` (its checkpoints travel with it).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from layer_boundary.engine.args import build_parser
from layer_boundary.engine.cli import main
from layer_boundary.engine.run_command import spec_from_args
from layer_boundary.models import config as config_json


@pytest.fixture
def reads(monkeypatch):
    """Every read of a config.json: through the one reader (``models.config.read_config``)
    and, to catch a reader that bypasses it, every ``Path.read_text`` of such a file."""
    seen = {"reader": [], "files": []}
    reader, read_text = config_json.read_config, Path.read_text

    def counted_reader(path):
        seen["reader"].append(Path(path).resolve())
        return reader(path)

    def counted_read_text(self, *args, **kwargs):
        if self.name == "config.json":
            seen["files"].append(self.resolve().parent)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(config_json, "read_config", counted_reader)
    monkeypatch.setattr(Path, "read_text", counted_read_text)
    return seen


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    from checkpoints import hf_qwen3

    return hf_qwen3(tmp_path_factory.mktemp("draft"), seed=3)


@pytest.mark.timeout(120)
def test_a_run_reads_config_json_once(qwen3_dir, reads, capsys, restore_logger):
    # split prefill: the world-1 rank and its world-1 reference both run in this process
    assert main(["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1",
                 "--split-prefill", "2", "--max-new-tokens", "2"]) == 0
    assert "parity vs world 1: PASS" in capsys.readouterr().out
    assert reads["reader"] == reads["files"] == [Path(qwen3_dir).resolve()]


@pytest.mark.timeout(120)
def test_a_speculative_run_reads_each_checkpoint_once(qwen3_dir, draft_dir, reads, capsys,
                                                      restore_logger):
    assert main(["run", "--model", str(qwen3_dir), "--draft-model", str(draft_dir), "--tp",
                 "1", "--dp", "1", "--max-new-tokens", "3"]) == 0
    assert "parity vs world 1: PASS" in capsys.readouterr().out
    expected = sorted([Path(qwen3_dir).resolve(), Path(draft_dir).resolve()])
    assert sorted(reads["reader"]) == sorted(reads["files"]) == expected


def test_a_plan_reads_config_json_once(qwen3_dir, reads, capsys, restore_logger):
    assert main(["plan", "--model", str(qwen3_dir), "--tp", "2", "--dp", "1"]) == 0
    assert reads["reader"] == reads["files"] == [Path(qwen3_dir).resolve()]


def test_spawned_ranks_are_handed_the_checkpoint(qwen3_dir, reads):
    """What a spawned rank unpickles carries the config: it has nothing left to read."""
    spec = spec_from_args(build_parser().parse_args(["run", "--model", str(qwen3_dir),
                                                     "--tp", "2", "--dp", "1"]))
    assert len(reads["reader"]) == 1
    sent = pickle.loads(pickle.dumps(spec))
    assert sent.checkpoint.raw == spec.checkpoint.raw
    assert sent.checkpoint.config == spec.checkpoint.config
    assert sent.checkpoint.model_class is spec.checkpoint.model_class
    assert len(reads["reader"]) == 1 and len(reads["files"]) == 1
