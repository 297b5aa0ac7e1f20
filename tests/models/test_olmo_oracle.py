"""OLMo-2 and OLMo-3 (``models/olmo2.py``, ``olmo3.py``: post norms as residual updates, q/k
norms over every head, OLMo-3's sliding layers) at world 1 against transformers (fp32, eager
attention): prefill logits and KV-cache decode steps within 1e-5, a window shorter than the
prompts and their decode steps; config errors named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from checkpoints import hf_oracle
from checkpoints.olmo import OLMO3_WINDOW, hf_olmo2, hf_olmo3

from layer_boundary.engine.generate import greedy_generate
from layer_boundary.models import load_model, open_checkpoint
from layer_boundary.models.config import CheckpointError
from layer_boundary.runtime.args import BoundaryRuntime
from layer_boundary.runtime.parallel import ParallelDims, build_parallel

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 4

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


@pytest.mark.parametrize("change,error", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types must list num_hidden_layers=4"),
    (dict(layer_types=["chunked_attention"] * 4), "layer_types ['chunked_attention'] are not"),
    (dict(sliding_window=None), "has sliding_attention layers but no sliding_window"),
    (dict(sliding_window=0), "field sliding_window must be a positive integer"),
    (dict(layer_types="sliding"), "field layer_types must be a list of strings"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}),
     "rope_type 'yarn' is not supported"),
])
def test_olmo3_config_errors_name_the_field(tmp_path, change, error):
    path = hf_olmo3(tmp_path / "o3")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError, match=re.escape(error)):
        open_checkpoint(path)
