"""Tiny random GPT-OSS checkpoints written by transformers' save_pretrained (the oracle's own
format: each layer's experts fused, ``experts.gate_up_proj`` [E, hidden, 2 * inter] with gate
and up interleaved, ``experts.down_proj`` [E, inter, hidden], both with biases), every weight
randomised so the checks mean something: the sinks, the expert tensors and the router bias
included."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hf_oracle, randomize

# 4 layers (sliding, full, sliding, full: transformers' default layer_types), a window of 3
# (the prompts outgrow it), 8 experts top-2; sizes divide tp 4, moe_ep 4 and moe_tp 4. The
# rope is transformers' default for GPT-OSS (YaRN, factor 32 over 4096 positions).
TINY_GPT_OSS = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=3,
                    rms_norm_eps=1e-6)


def hf_gpt_oss(path: Path, *, seed: int = 0, tie: bool = False, rope_parameters=None,
               **overrides) -> Path:
    """save_pretrained of a random transformers GptOssForCausalLM (rope_parameters None:
    transformers' default, YaRN)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**dict(TINY_GPT_OSS, **overrides), tie_word_embeddings=tie,
                                    rope_parameters=rope_parameters)
    model = transformers.GptOssForCausalLM(cfg)
    randomize(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            experts = layer.mlp.experts
            experts.gate_up_proj.normal_(0.0, cfg.hidden_size ** -0.5)
            experts.down_proj.normal_(0.0, cfg.intermediate_size ** -0.5)
    model.save_pretrained(path)
    return Path(path)


def hf_gpt_oss_reference(path: Path):
    return hf_oracle("GptOssForCausalLM", path)
