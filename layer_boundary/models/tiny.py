"""The built-in tiny random Qwen3 checkpoint, in the Hugging Face layout (config.json +
model.safetensors), written without transformers so the main job needs only torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .loader import CheckpointError

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def default_cache_dir() -> Path:
    root = os.environ.get("LAYER_BOUNDARY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "layer_boundary")
    return Path(root)


def qwen3_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with unit-scale activations, so greedy tokens are not near ties."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=gen) * scale

    def norm_weight(n):
        return 1.0 + rand(n, scale=0.1)

    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": rand(vocab, h, scale=1.0),
         "model.norm.weight": norm_weight(h)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = rand(vocab, h, scale=h ** -0.5)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm_weight(h)
        t[p + "post_attention_layernorm.weight"] = norm_weight(h)
        t[p + "self_attn.q_proj.weight"] = rand(nh * hd, h, scale=h ** -0.5)
        t[p + "self_attn.k_proj.weight"] = rand(kv * hd, h, scale=h ** -0.5)
        t[p + "self_attn.v_proj.weight"] = rand(kv * hd, h, scale=h ** -0.5)
        t[p + "self_attn.o_proj.weight"] = rand(h, nh * hd, scale=(nh * hd) ** -0.5)
        t[p + "self_attn.q_norm.weight"] = norm_weight(hd)
        t[p + "self_attn.k_norm.weight"] = norm_weight(hd)
        t[p + "mlp.gate_proj.weight"] = rand(inter, h, scale=h ** -0.5)
        t[p + "mlp.up_proj.weight"] = rand(inter, h, scale=h ** -0.5)
        t[p + "mlp.down_proj.weight"] = rand(h, inter, scale=inter ** -0.5)
    return t


def write_tiny_qwen3(path, seed: int = 0, **overrides) -> Path:
    """Write a tiny random Qwen3 checkpoint to ``path`` (config fields may be overridden)."""
    path = Path(path)
    cfg = dict(TINY_QWEN3, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in qwen3_tensors(cfg, seed).items()}
    # per-process temporary names: several ranks may write the same folder at once, and
    # each rename is atomic; the weights land last, so a half-written folder is never used
    pid = os.getpid()
    tmp_cfg, tmp_weights = path / f"config.json.{pid}", path / f"model.safetensors.{pid}"
    tmp_cfg.write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_cfg, path / "config.json")
    os.replace(tmp_weights, path / "model.safetensors")
    return path


def _byte_symbols() -> dict[int, str]:
    """Each byte's printable stand-in in a byte-level BPE vocabulary (GPT-2's table: the
    printable Latin-1 bytes stand for themselves, the others for code points from 256)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer_json() -> dict:
    """A ``tokenizers`` tokenizer.json whose token ids are the bytes of the UTF-8 text (256
    tokens, no merges): the built-in checkpoint's vocabulary, so ``run --prompt`` works on it."""
    level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", **level},
            "post_processor": None, "decoder": {"type": "ByteLevel", **level},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {s: b for b, s in sorted(_byte_symbols().items())},
                      "merges": []}}


def write_byte_tokenizer(path) -> Path:
    """``path/tokenizer.json``: ``byte_tokenizer_json()`` (written atomically)."""
    target = Path(path) / "tokenizer.json"
    tmp = target.with_name(f"tokenizer.json.{os.getpid()}")
    tmp.write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False) + "\n")
    os.replace(tmp, target)
    return target


def builtin_checkpoint() -> Path:
    """The main job's checkpoint (with its byte-level tokenizer), written to the cache
    folder on first use."""
    path = default_cache_dir() / "tiny-qwen3"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        try:
            if not (path / "model.safetensors").is_file():
                write_tiny_qwen3(path)
            write_byte_tokenizer(path)
        except OSError as exc:
            raise CheckpointError(f"cannot write the built-in checkpoint to {path} ({exc.strerror}"
                                  "); set LAYER_BOUNDARY_CACHE to a writable folder") from None
    return path
