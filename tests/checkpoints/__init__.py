"""Tiny checkpoints for tests: written by transformers' save_pretrained (the oracle's own
format) or by the package's built-in writer, always random, norms included.

Qwen3 and Qwen3-MoE are written here; every other architecture has its own writer, a module
beside this file (``checkpoints.ds``, ``checkpoints.gemma3``, ...) built on ``save_random``
or ``hf_oracle``."""

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
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def randomize(model) -> None:
    """Every weight random, norms and router biases included, so every check means something."""
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name and p.is_floating_point():
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(("weight", "bias")):  # unit-scale activations: no near-ties
                p.normal_(0.0, 0.3 if "embed" in name else p.shape[-1] ** -0.5)


TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def save_random(cls: str, config_cls: str, path: Path, seed: int, fields: dict, *,
                zero_centered: bool = False, prepare=None) -> Path:
    """save_pretrained of a random transformers ``cls`` built from ``config_cls(**fields)``
    (``randomize``), for any architecture. Special-token ids a config defaults beyond a tiny
    vocabulary (Phi-3's pad 32000) are set to None unless ``fields`` names them;
    ``zero_centered``: norm weights around 0 (Gemma's scale by ``1 + w``); ``prepare(model)``:
    what the architecture needs after ``randomize`` (a LayerNorm bias around 0, say).

    Args:
        cls, config_cls: transformers' model and config class names.
        path: where to write it.
        seed: the torch seed of its weights.
        fields: the config's fields.
    """
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**fields)
    vocab = getattr(config, "vocab_size", None)
    for name in TOKEN_FIELDS:
        value = getattr(config, name, None)
        if name not in fields and isinstance(value, int) and vocab is not None and value >= vocab:
            setattr(config, name, None)
    model = getattr(transformers, cls)(config)
    randomize(model)
    if zero_centered:  # randomize's norms are around 1, as a plain RMSNorm's weight is
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    if prepare is not None:
        prepare(model)
    model.save_pretrained(path)
    return Path(path)


def hf_oracle(model_class: str, path: Path):
    """The transformers model of ``model_class`` from ``path`` as the oracle runs it: fp32,
    eager attention, eager experts."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.eval()


def hf_reference(path: Path):
    return hf_oracle("Qwen3ForCausalLM", path)


TINY_MOE = dict(TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=[0])




def hf_qwen3_moe(path: Path, *, seed: int = 0, norm_topk_prob: bool = True, **overrides) -> Path:
    """save_pretrained of a random Qwen3-MoE: a dense first layer, then sparse layers."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**dict(TINY_MOE, **overrides), norm_topk_prob=norm_topk_prob)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    randomize(model)
    model.save_pretrained(path)
    return Path(path)


def hf_reference_moe(path: Path):
    return hf_oracle("Qwen3MoeForCausalLM", path)


def with_config(src: Path, dst: Path, drop=(), **fields) -> Path:
    """A copy of the checkpoint at ``src`` in ``dst`` whose config.json has ``fields`` set and
    the keys in ``drop`` removed."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **fields}.items() if k not in drop}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
