"""Tiny checkpoints for tests: written by transformers' save_pretrained (the oracle's own
format) or by the package's built-in writer, always random, norms included."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)


def hf_qwen3(path: Path, *, seed: int = 0, tie: bool = False, rope_theta: float = 10000.0,
             **overrides) -> Path:
    """save_pretrained of a random transformers Qwen3ForCausalLM (norm weights randomised)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**dict(TINY, **overrides), tie_word_embeddings=tie,
                                   rope_parameters={"rope_type": "default",
                                                    "rope_theta": rope_theta})
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:  # unit-scale activations keep greedy choices away from near-ties
                p.normal_(0.0, 0.3 if "embed" in name else p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return Path(path)


def hf_reference(path: Path):
    import transformers

    return transformers.Qwen3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
