"""The Transformers backend (``models/generic``) at world 1 against transformers (fp32, eager
attention): a pre-norm layer with biases (Qwen2), a sandwich layer with softcapped attention,
a scaled embedding and capped logits (Gemma 2, its sliding layers shorter than the prompts),
and a post-norm layer whose q/k norms span the gathered heads (OLMo-2): prefill logits at every
position and cached decode steps within 1e-5. The probe refuses a layer that scales its
residual, naming its class; ``auto`` keeps our own file where one exists."""

from __future__ import annotations

import pytest
import torch
from checkpoints.generic import hf_tiny
from oracle import assert_backend_matches, world1

from layer_boundary.models import load_model
from layer_boundary.models.checkpoint import open_checkpoint
from layer_boundary.models.config import CheckpointError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [50, 3, 17, 33, 2, 61, 33]]
STEPS = 3

MODELS = {
    "qwen2": ("Qwen2ForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=4, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=3.0)),
    "olmo2": ("Olmo2ForCausalLM", {}),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("generic")
    return {name: hf_tiny(name, root / name, **fields) for name, (_, fields) in MODELS.items()}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_world1_matches_transformers(dirs, model_type):
    assert_backend_matches(dirs[model_type], MODELS[model_type][0], PROMPTS, STEPS)


def test_auto_keeps_our_own_file_and_takes_the_backend_elsewhere(dirs, tmp_path):
    llama = hf_tiny("llama", tmp_path / "llama")
    assert open_checkpoint(llama).impl == "native"
    assert open_checkpoint(llama, "transformers").impl == "transformers"
    assert open_checkpoint(dirs["qwen2"]).impl == "transformers"
    with pytest.raises(CheckpointError, match="model_type 'qwen2' is not supported .*; "
                                              "--model-impl auto or transformers serves it"):
        open_checkpoint(dirs["qwen2"], "native")


def test_a_layer_that_scales_its_residual_is_refused_by_name(dirs, monkeypatch):
    """A decoder layer whose forward halves its input's residual (an op the restructured
    layer does not know): the probe's logits differ, and the load is refused naming the
    layer class and the difference, before anything runs."""
    from transformers.models.qwen2 import modeling_qwen2

    forward = modeling_qwen2.Qwen2DecoderLayer.forward

    def scaled(self, hidden_states, *args, **kwargs):
        return forward(self, hidden_states * 0.5, *args, **kwargs) + 0.5 * hidden_states

    monkeypatch.setattr(modeling_qwen2.Qwen2DecoderLayer, "forward", scaled)
    with pytest.raises(CheckpointError, match=r"cannot serve model_type 'qwen2': "
                                              r"Qwen2ForCausalLM, layers Qwen2DecoderLayer, "
                                              r"restructured onto the boundaries, differs"):
        open_checkpoint(dirs["qwen2"], "transformers")


@pytest.mark.parametrize("field", [{"residual_multiplier": 0.5}, {"embedding_multiplier": 3.0}])
def test_multipliers_the_backend_does_not_know_are_refused(tmp_path, field):
    """Granite's multipliers (a layer's residual, the model's embedding): transformers' config
    fields the restructured model does not apply, refused by the probe, never run wrong."""
    folder = hf_tiny("granite", tmp_path / "granite", **field)
    with pytest.raises(CheckpointError, match="GraniteForCausalLM, layers GraniteDecoderLayer, "
                                              "restructured onto the boundaries, differs"):
        open_checkpoint(folder, "transformers")


def test_an_unknown_tp_style_is_refused_by_name(dirs, monkeypatch):
    from transformers import Qwen2Config

    plan = dict(Qwen2Config.base_model_tp_plan, **{"layers.*.mlp.up_proj": "local_packed"})
    monkeypatch.setattr(Qwen2Config, "base_model_tp_plan", plan)
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.up_proj: tp_plan style "
                                              r"'local_packed' is not served"):
        load_model(open_checkpoint(dirs["qwen2"], "transformers"), world1())


def test_the_probe_runs_once_per_open(dirs, monkeypatch):
    """A ``Checkpoint`` handed on (to ranks, to load_model) is not probed again."""
    from layer_boundary.models.generic import probe

    calls = []
    check = probe.check
    monkeypatch.setattr(probe, "check", lambda cfg: calls.append(cfg) or check(cfg))
    checkpoint = open_checkpoint(dirs["qwen2"], "transformers")
    load_model(checkpoint, world1())
    assert len(calls) == 1
    with torch.no_grad():
        assert checkpoint.config.hf.num_hidden_layers == 3  # the probe cut a copy, not it


def test_without_transformers_the_backend_is_refused_by_name(dirs, monkeypatch):
    """transformers is the backend's extra: without it, a type with no file of ours gets the
    error naming the supported types (auto) or the extra to install (transformers)."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(CheckpointError, match="model_type 'qwen2' is not supported"):
        open_checkpoint(dirs["qwen2"])
    with pytest.raises(CheckpointError, match=r"the transformers backend needs transformers: "
                                              r"pip install 'layer_boundary\[transformers\]'"):
        open_checkpoint(dirs["qwen2"], "transformers")
