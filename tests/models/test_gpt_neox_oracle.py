"""GPT-NeoX (``models/gpt_neox.py``: parallel blocks with two LayerNorms, partial rotary,
biases, fused per-head q/k/v, an untied head) at world 1 against transformers (fp32, eager
attention): prefill logits at every position and KV-cache decode steps within 1e-5, the
parallel and the sequential residual; an older checkpoint's names (``embed_out``, mask
buffers) load; refusals named."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_oracle, with_config
from checkpoints.gpt_neox import hf_neox
from oracle import assert_decode_matches, assert_prefill_matches, world1
from safetensors.torch import load_file, save_file

from layer_boundary.models import load_config, load_model
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4

VARIANTS = {
    "parallel": {},
    # the sequential residual, the tanh gelu, half of each head roped, a tied head
    "sequential": dict(seed=2, use_parallel_residual=False, hidden_act="gelu_new",
                       tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                        "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, variant):
    path = hf_neox(tmp_path / variant, **VARIANTS[variant])
    ours, ref = load_model(path, world1()), hf_oracle("GPTNeoXForCausalLM", path)
    assert_prefill_matches(ours, ref, PROMPTS)
    assert_decode_matches(ours, ref, PROMPTS, STEPS)


def test_the_head_under_either_name_and_old_buffers_load(tmp_path):
    """transformers writes the head as ``embed_out`` (Pythia's name), as the hub holds it;
    ``lm_head`` loads the same. Older checkpoints keep each attention's mask buffers and
    rotary table beside its weights: skipped."""
    path = hf_neox(tmp_path / "new")
    ref = load_model(path, world1())
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    for i in range(4):
        tensors[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
        tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(1)
    save_file(tensors, shard, metadata={"format": "pt"})
    ours = load_model(path, world1())
    for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fields,message", [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "turns 0 of 8 head dims"),
    ({"use_parallel_residual": "yes"}, "use_parallel_residual must be true or false"),
])
def test_a_config_it_cannot_run_is_refused_by_name(tmp_path, fields, message):
    path = hf_neox(tmp_path / "n")
    with pytest.raises(CheckpointError, match=message):
        load_config(with_config(path, tmp_path / "bad", **fields))
