"""MoE blocks on the Transformers backend (``models/generic/moe.py``) at world 1 against
transformers (fp32, eager attention and experts): Qwen2-MoE (routed experts beside a gated
shared expert, a dense first layer), OLMoE (gathered heads under q/k norms), Mixtral (its
checkpoint's ``block_sparse_moe.experts.N.w1/w3/w2`` renamed and stacked as transformers does)
and Qwen3-MoE (a model with our own file, through the backend): prefill logits at every
position and cached decode steps within 1e-5, loaded from the per-expert matrices
``save_pretrained`` writes. A checkpoint holding transformers' stacked tensors loads the same
bits; what the backend cannot split over TP is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from checkpoints import hf_oracle
from checkpoints.generic import hf_tiny
from oracle import assert_backend_matches, prefill, world1

from layer_boundary.models import load_model
from layer_boundary.models.checkpoint import open_checkpoint
from layer_boundary.models.config import CheckpointError
from layer_boundary.runtime.parallel import ParallelDims

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 3
EXPERTS = dict(num_experts=8, num_experts_per_tok=2)

MODELS = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(EXPERTS, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48,
                                              mlp_only_layers=[0])),
    # OLMoE's q/k norms span hidden_size: heads x head_dim must be it
    "olmoe": ("OlmoeForCausalLM", dict(EXPERTS, intermediate_size=32, num_attention_heads=4)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(EXPERTS, moe_intermediate_size=32,
                                              mlp_only_layers=[0])),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("generic_moe")
    return {name: hf_tiny(name, root / name, **fields) for name, (_, fields) in MODELS.items()}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_world1_matches_transformers(dirs, model_type):
    assert_backend_matches(dirs[model_type], MODELS[model_type][0], PROMPTS, STEPS)


def test_a_checkpoint_of_stacked_experts_loads_the_same(dirs, tmp_path):
    """Mixtral's tensors as transformers' state dict names them (``mlp.experts.gate_up_proj``
    [experts, 2 x inter, hidden], read from the file an expert at a time) load the bits its
    per-expert checkpoint loads."""
    import shutil

    from safetensors.torch import save_file

    source = dirs["mixtral"]
    ref = hf_oracle("MixtralForCausalLM", source)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(source / "config.json", stacked / "config.json")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(stacked / "model.safetensors"))
    logits = [prefill(load_model(open_checkpoint(folder, "transformers"), world1()), PROMPTS)
              for folder in (source, stacked)]
    assert torch.equal(*logits)


def _tp(size: int):
    """A rank's runtime at TP ``size`` as ``make_experts_ours`` reads it (no weights, no
    collective: it refuses before either)."""
    group = SimpleNamespace(size=size, rank=0)
    return SimpleNamespace(parallel=SimpleNamespace(
        dims=ParallelDims(world_size=size, tp=size), tp_group=group, moe_ep_rank=0,
        moe_tp_rank=0))


def test_what_cannot_split_over_tp_is_refused_by_name(dirs, monkeypatch):
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    from layer_boundary.models.generic.meta import skeleton
    from layer_boundary.models.generic.moe import make_experts_ours

    cfg = open_checkpoint(dirs["qwen2_moe"], "transformers").config

    def experts():
        return skeleton(cfg.hf).model.layers[1].mlp.experts

    name = "layers.1.mlp.experts"
    with pytest.raises(CheckpointError, match=r"layers.1.mlp.experts \(Qwen2MoeExperts\)'s "
                                              r"intermediate size 32 is not divisible by the "
                                              r"MoE tensor-parallel size 3"):
        make_experts_ours(experts(), name, cfg, _tp(3), torch.float32)
    # a gate of its own may mix the intermediate's columns: not split, whatever it computes
    monkeypatch.setattr(modeling_qwen2_moe.Qwen2MoeExperts, "_apply_gate",
                        lambda self, x: x.chunk(2, dim=-1)[0], raising=False)
    with pytest.raises(CheckpointError, match=r"gates through its own "
                                              r"Qwen2MoeExperts._apply_gate, which the generic "
                                              r"path cannot split over the MoE tensor-parallel "
                                              r"size 2"):
        make_experts_ours(experts(), name, cfg, _tp(2), torch.float32)
