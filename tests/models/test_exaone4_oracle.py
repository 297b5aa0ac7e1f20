"""EXAONE-4 (``models/exaone4.py``: post norms as residual updates, per-head q/k norms,
sliding layers and unroped full ones) at world 1 against transformers (fp32, eager
attention): prefill logits at every position and KV-cache decode steps against transformers'
cached decode within 1e-5, a window shorter than the prompts and their decode steps; without
a window every layer full and roped; refusals named."""

from __future__ import annotations


import pytest
from checkpoints import hf_oracle, with_config
from checkpoints.exaone4 import WINDOW, hf_exaone4
from oracle import assert_decode_matches, assert_prefill_matches, world1

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

VARIANTS = {
    "window": {},
    # no window: every layer full, every layer roped (llama3); a tied head, MHA
    "no-window-llama3-tied": dict(seed=1, sliding_window=None, layer_types=["full_attention"] * 4,
                                  rope_parameters=LLAMA3, tie_word_embeddings=True,
                                  num_key_value_heads=4),
}


@pytest.fixture(scope="module")
def exaone4_dir(tmp_path_factory):
    return hf_exaone4(tmp_path_factory.mktemp("exaone4") / "window")


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, exaone4_dir, variant):
    path = exaone4_dir if variant == "window" else hf_exaone4(tmp_path / variant,
                                                              **VARIANTS[variant])
    ours, ref = load_model(path, world1()), hf_oracle("Exaone4ForCausalLM", path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_the_full_layers_skip_rope_beside_a_window(exaone4_dir):
    cfg = load_config(exaone4_dir)
    assert cfg.windows == (WINDOW, WINDOW, WINDOW, None)
    assert cfg.ropes == (True, True, True, False)
    assert cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings


def test_without_layer_types_the_pattern_schedules_them(tmp_path, exaone4_dir):
    cfg = load_config(with_config(exaone4_dir, tmp_path / "p", drop=("layer_types",),
                            sliding_window_pattern=2))
    assert cfg.windows == (WINDOW, None, WINDOW, None)


@pytest.mark.parametrize("fields,drop,message", [
    ({"hidden_act": "gelu"}, (), "hidden_act 'gelu' is not supported"),
    ({"sliding_window_pattern": "LLLG"}, ("layer_types",),
     "sliding_window_pattern='LLLG' without layer_types is not supported"),
    ({"sliding_window_pattern": 1.5}, (), "sliding_window_pattern must be an integer or"),
    ({"sliding_window": None}, (), "has sliding_attention layers but no sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, (),
     "rope_type 'yarn' is not supported"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, exaone4_dir, fields, drop,
                                                    message):
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(exaone4_dir, tmp_path / "bad", drop=drop, **fields))
