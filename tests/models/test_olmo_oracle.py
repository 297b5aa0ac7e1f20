"""OLMo-2 and OLMo-3 (``models/olmo2.py``, ``olmo3.py``: post norms as residual updates, q/k
norms over every head, OLMo-3's sliding layers) at world 1 against transformers (fp32, eager
attention): prefill logits and KV-cache decode steps within 1e-5, a window shorter than the
prompts and their decode steps; config errors named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import hf_oracle, with_config
from checkpoints.olmo import OLMO3_WINDOW, hf_olmo2, hf_olmo3
from oracle import assert_prefill_matches, world1

from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models import load_model, open_checkpoint
from layer_boundary.models.config import CheckpointError
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4

# the public OLMo-3 checkpoints' legacy rope_scaling, its context scaled down
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.2079441541679836}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

VARIANTS = {
    "olmo2": (hf_olmo2, "Olmo2ForCausalLM", {}),
    "olmo2-tied-bias": (hf_olmo2, "Olmo2ForCausalLM", dict(seed=1, tie_word_embeddings=True,
                                                           attention_bias=True)),
    "olmo3": (hf_olmo3, "Olmo3ForCausalLM", {}),
    "olmo3-mha-llama3": (hf_olmo3, "Olmo3ForCausalLM", dict(
        seed=2, num_key_value_heads=4, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={t: {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16}
                         for t in ("sliding_attention", "full_attention")})),
    # YaRN on the full layers (the public checkpoints' rope), a factor on the cos/sin tables
    "olmo3-yarn": (hf_olmo3, "Olmo3ForCausalLM", dict(seed=3, rope_scaling=YARN)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_world1_matches_transformers(tmp_path, variant):
    write, cls, kwargs = VARIANTS[variant]
    path = write(tmp_path / variant, **kwargs)
    gen = greedy_generate(load_model(path, BoundaryRuntime(build_parallel(ParallelDims()))),
                          PROMPTS, STEPS)
    ref = hf_oracle(cls, path)
    for j, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt + gen.generated[j][:-1]])).logits[0]
        for step in range(STEPS):
            got = gen.logits[j][step]
            diff = (expected[len(prompt) - 1 + step] - got).abs().max().item()
            assert diff <= 1e-5, f"prompt {j} step {step}: max abs diff {diff}"


def test_olmo3_reads_each_layers_window_and_rope(tmp_path):
    cfg = open_checkpoint(hf_olmo3(tmp_path / "o3")).config
    assert cfg.windows == (OLMO3_WINDOW, OLMO3_WINDOW, OLMO3_WINDOW, None)
    assert [theta for theta, _ in cfg.ropes] == [500000.0] * 4


NESTED_LLAMA3 = {t: {**LLAMA3, "rope_theta": 1e4} for t in ("sliding_attention",
                                                              "full_attention")}
# rope fields transformers reads its own way: a legacy rope_scaling updates the full layers'
# rope only (YaRN on the public OLMo-3 checkpoints); yarn's truncate is rope_parameters'
# top-level one; a layer type without a rope of its own gets theta 500000 (the full layers
# the top-level rope_theta first); a top-level original_max_position_embeddings is ignored
# beside per-type ropes (OLMo-3), yet wins over a flat rope's (OLMo-2); rope_scaling replaces
# OLMo-2's rope_parameters
ROPE_READINGS = {
    "olmo3-legacy-llama3": (hf_olmo3, "Olmo3ForCausalLM", dict(
        rope_parameters=None, rope_theta=1e4, rope_scaling=LLAMA3)),
    "olmo3-legacy-theta": (hf_olmo3, "Olmo3ForCausalLM", dict(rope_parameters=None,
                                                               rope_theta=1e4)),
    "olmo3-rope-scaling-beside": (hf_olmo3, "Olmo3ForCausalLM", dict(rope_scaling=LLAMA3)),
    "olmo3-legacy-yarn": (hf_olmo3, "Olmo3ForCausalLM", dict(
        rope_parameters=None, rope_theta=5e5, rope_scaling=YARN)),
    "olmo3-yarn-beside": (hf_olmo3, "Olmo3ForCausalLM", dict(rope_scaling=YARN)),
    "olmo3-sliding-yarn-untruncated": (hf_olmo3, "Olmo3ForCausalLM", dict(rope_parameters={
        "sliding_attention": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0,
                              "mscale": 2.0, "mscale_all_dim": 1.0},
        "full_attention": {"rope_type": "default"}, "truncate": False})),
    "olmo3-one-type-missing": (hf_olmo3, "Olmo3ForCausalLM", dict(
        rope_theta=77.0, rope_parameters={"full_attention": {"rope_theta": 1e4}})),
    "olmo3-top-original-context": (hf_olmo3, "Olmo3ForCausalLM", dict(
        rope_parameters=NESTED_LLAMA3, original_max_position_embeddings=4)),
    "olmo2-rope-scaling-beside": (hf_olmo2, "Olmo2ForCausalLM", dict(rope_scaling=LLAMA3)),
    "olmo2-top-original-context": (hf_olmo2, "Olmo2ForCausalLM", dict(
        rope_scaling=LLAMA3, original_max_position_embeddings=4)),
}


@pytest.mark.parametrize("variant", ROPE_READINGS)
def test_rope_fields_are_read_as_transformers_reads_them(tmp_path, variant):
    write, cls, change = ROPE_READINGS[variant]
    path = with_config(write(tmp_path / "src"), tmp_path / variant, **change)
    assert_prefill_matches(load_model(path, world1()), hf_oracle(cls, path),
                           [[1, 2, 3, 4, 5, 6]])


@pytest.mark.parametrize("change,error", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types must list num_hidden_layers=4"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types ['chunked_attention'] are not"),
    (dict(sliding_window=None), "has sliding_attention layers but no sliding_window"),
    (dict(sliding_window=0), "field sliding_window must be a positive integer"),
    (dict(layer_types="sliding"), "field layer_types must be a list of strings"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "dynamic", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}),
     "rope_type 'dynamic' is not supported (default, llama3, yarn only)"),
    # a legacy rope_scaling of a type not computed here, alone or beside rope_parameters
    (dict(rope_parameters=None, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_type 'linear' is not supported"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
     "rope_type 'longrope' is not supported"),
    # transformers' yarn reads rope_parameters' top-level truncate, never a layer type's
    (dict(rope_parameters=None, rope_scaling={**YARN, "truncate": False}),
     "rope_parameters truncate=False of a layer type is not supported"),
    (dict(rope_scaling={**YARN, "factor": None}), "rope_parameters has no factor"),
    # a flat rope dict: transformers ignores it and runs its per-type default ropes
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "rope_parameters has no full_attention dict beside its keys ['rope_theta', 'rope_type']"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default"}}, rope_scaling=LLAMA3),
     "rope_scaling beside a rope_parameters without a full_attention dict"),
])
def test_olmo3_config_errors_name_the_field(tmp_path, change, error):
    path = hf_olmo3(tmp_path / "o3")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError, match=re.escape(error)):
        open_checkpoint(path)


def test_olmo2_refuses_a_yarn_rope_scaling_beside_its_rope_parameters(tmp_path):
    # transformers lets rope_scaling replace rope_parameters: its yarn is what would run
    path = with_config(hf_olmo2(tmp_path / "src"), tmp_path / "o2", rope_scaling=YARN)
    with pytest.raises(CheckpointError, match="rope_type 'yarn' is not supported"):
        open_checkpoint(path)
