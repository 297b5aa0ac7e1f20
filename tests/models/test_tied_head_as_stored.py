"""A config.json that ties the head to the embedding over a checkpoint holding both, as
transformers reads it (``PreTrainedModel.tie_weights``): different values are both loaded,
untied (a tied model read the embedding as its head: logits off by 6); equal ones stay tied.
World 1 against transformers on the architectures' own names (GPT-NeoX: embed_in/embed_out;
Granite: a scaled head)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from oracle import TOL, hf_cached_decode

from layer_boundary.engine.runner import RunSpec, merge, run_rank
from layer_boundary.models import open_checkpoint

PROMPT = (3, 1, 4, 1, 5)


def _tie_in_config(folder) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))


@pytest.mark.parametrize("make", ["checkpoints:hf_qwen3", "checkpoints.gpt_neox:hf_neox",
                                  "checkpoints.granite:hf_granite"])
def test_a_tied_config_over_two_stored_tensors_reads_both_as_transformers(tmp_path, make,
                                                                          caplog):
    import importlib

    import transformers

    module, fn = make.split(":")
    folder = getattr(importlib.import_module(module), fn)(tmp_path / "ckpt")  # untied
    _tie_in_config(folder)
    with caplog.at_level(logging.WARNING, logger="layer_boundary.models.checkpoint"):
        assert open_checkpoint(str(folder)).config.tie_word_embeddings is False
    assert "with different values: both are loaded, untied, as transformers does" in caplog.text
    ours = merge([run_rank(RunSpec(str(folder), prompts=(PROMPT,), max_new_tokens=1),
                           world_size=1)]).logits[0][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    expected = hf_cached_decode(hf, PROMPT, [])[0]
    assert (ours - expected).abs().max().item() <= TOL * max(1.0, expected.abs().max().item())


def test_equal_stored_tensors_stay_tied(tmp_path):
    from safetensors.torch import load_file, save_file
    from checkpoints import hf_qwen3

    folder = hf_qwen3(tmp_path / "ckpt", tie=True)
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
              str(weights))
    assert open_checkpoint(str(folder)).config.tie_word_embeddings is True
