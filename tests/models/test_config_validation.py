"""Config fields of the wrong type or range are refused once, for every architecture, naming
the field: never a traceback, never a silent misread."""

from __future__ import annotations

import json
import re
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


# the shared fields' hostile values: each architecture goes through the same check
SHARED_HOSTILE = [
    ({"rope_theta": -1.0}, "field rope_theta must be a positive number, got -1.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     "rope_parameters.rope_theta must be a positive number, got -1.0"),
    ({"partial_rotary_factor": 2.0}, "field partial_rotary_factor must be a number in (0, 1]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0}},
     "rope_parameters.partial_rotary_factor must be a number in (0, 1], got 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
     "rope_scaling.factor must be a positive number, got -2.0"),
    ({"vocab_size": 2 ** 63}, "field vocab_size=9223372036854775808 is beyond any model"),
]


@pytest.mark.parametrize("fields,message", SHARED_HOSTILE,
                         ids=["theta", "dict-theta", "fraction", "dict-fraction", "factor",
                              "vocab"])
def test_every_architecture_refuses_the_shared_fields_hostile_values(fields, message):
    """Every architecture of tests/model_configs.py, from its tiny transformers config with
    the hostile value put in: the one shared check names it (glm4_moe, deepseek_v2 and
    minimax_m2 ran a negative top-level theta; every model a negative one in its rope dict)."""
    import transformers
    from model_configs import CONFIGS

    from layer_boundary.models.registry import model_class

    for model_type, (cls_name, tiny) in CONFIGS.items():
        raw = {**getattr(transformers, cls_name)(**tiny).to_dict(), **fields}
        with pytest.raises(CheckpointError, match=re.escape(message)):
            model_class(model_type).config_class.validate(raw)
