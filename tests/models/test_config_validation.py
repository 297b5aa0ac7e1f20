"""Config fields of the wrong type or range are refused once, for every architecture, naming
the field: never a traceback, never a silent misread."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoints import hf_qwen3, hf_qwen3_moe

from layer_boundary.models import load_config
from layer_boundary.models.loader import CheckpointError, safetensors_files


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    return {"qwen3": hf_qwen3(root / "qwen3"), "qwen3_moe": hf_qwen3_moe(root / "moe")}


def with_fields(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("model,fields,message", [
    ("qwen3", {"head_dim": "64"}, "head_dim must be a positive integer, got '64'"),
    ("qwen3", {"head_dim": -8}, "head_dim must be a positive integer"),
    ("qwen3", {"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
    ("qwen3", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ("qwen3", {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ("qwen3", {"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of integers"),
    ("qwen3_moe", {"num_experts_per_tok": 99}, "num_experts_per_tok=99 exceeds the 8 experts"),
])
def test_a_bad_field_is_named(dirs, tmp_path, model, fields, message):
    path = with_fields(dirs[model], tmp_path / "ckpt", **fields)
    with pytest.raises(CheckpointError, match=message):
        load_config(path)


def test_an_index_whose_weight_map_is_not_an_object(dirs, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(dirs["qwen3"], path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names to file names"):
        safetensors_files(path)


def test_an_unwritable_logits_out_is_refused_before_the_run(dirs, tmp_path, capsys,
                                                            restore_logger):
    from layer_boundary.engine.cli import main

    code = main(["run", "--model", str(dirs["qwen3"]), "--tp", "1", "--dp", "1",
                 "--logits-out", str(tmp_path / "missing" / "logits.safetensors")])
    assert code == 2
    assert "--logits-out" in capsys.readouterr().err
