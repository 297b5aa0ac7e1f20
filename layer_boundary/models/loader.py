"""Hugging Face checkpoints (config.json + safetensors, never pickle) into sharded modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A missing, malformed or mismatched checkpoint; the message names the file or tensor."""


def read_config(path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} does not hold a JSON object")
    return cfg


_POSITIVE_INT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "moe_intermediate_size", "num_experts", "num_local_experts",
                 "n_routed_experts", "num_experts_per_tok", "moe_topk", "decoder_sparse_step",
                 "max_position_embeddings", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                 "topk_group", "n_shared_experts", "ffn_hidden_size", "expert_ffn_hidden_size",
                 "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank",
                 "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                 "conv_kernel", "chunk_size")
_NON_NEGATIVE_INT = ("first_k_dense_replace", "num_nextn_predict_layers", "zero_expert_num")
_POSITIVE_NUMBER = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta",
                    "routed_scaling_factor")
_BOOL = ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "mlp_bias", "use_bias",
         "use_conv_bias", "router_bias")
_INT_LIST = ("mlp_only_layers",)
_OBJECT = ("rope_parameters", "rope_scaling", "quantization_config")


def validate_config(cfg: dict) -> None:
    """Types and ranges of the fields the reference architectures read, checked once before
    any model reads them (null counts as absent): a string, a bool where a number belongs, a
    zero count or a list where an object belongs is an error naming the field, never a
    silent misread (``"false"`` read as true, ``0`` read as absent)."""
    def bad(field, what):
        raise CheckpointError(f"config.json field {field} must be {what}, got {cfg[field]!r}")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for field in _POSITIVE_INT:
        if cfg.get(field) is not None and not (is_int(cfg[field]) and cfg[field] >= 1):
            bad(field, "a positive integer")
    for field in _NON_NEGATIVE_INT:
        if cfg.get(field) is not None and not (is_int(cfg[field]) and cfg[field] >= 0):
            bad(field, "a non-negative integer")
    for field in _POSITIVE_NUMBER:
        v = cfg.get(field)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and v > 0):
            bad(field, "a positive number")
    for field in _BOOL:
        if cfg.get(field) is not None and not isinstance(cfg[field], bool):
            bad(field, "true or false")
    for field in _INT_LIST:
        v = cfg.get(field)
        if v is not None and not (isinstance(v, list) and all(is_int(x) for x in v)):
            bad(field, "a list of integers")
    for field in _OBJECT:
        if cfg.get(field) is not None and not isinstance(cfg[field], dict):
            bad(field, "an object")
    experts = next((cfg[f] for f in ("num_experts", "num_local_experts", "n_routed_experts")
                    if cfg.get(f) is not None), None)
    top_k = cfg.get("num_experts_per_tok")
    if experts is not None and top_k is not None and top_k > experts + (
            cfg.get("zero_expert_num") or 0):
        raise CheckpointError(f"config.json field num_experts_per_tok={top_k} exceeds the "
                              f"{experts} experts")


def require(cfg: dict, field: str, kind=int):
    if field not in cfg or cfg[field] is None:
        raise CheckpointError(f"config.json has no {field}")
    value = cfg[field]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise CheckpointError(f"config.json field {field} must be a positive integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise CheckpointError(f"config.json field {field} must be a number, got {value!r}")
    return value


def check_unquantized_silu(cfg: dict) -> None:
    """Reject a quantized config.json or one whose ``hidden_act`` is not silu."""
    if cfg.get("quantization_config"):
        raise CheckpointError("config.json quantization_config is not supported (unquantized "
                              "checkpoints only)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported (silu only)")


def check_divisible(field: str, value: int, degree: str, size: int, why: str = "") -> None:
    """A config field that must split evenly over a parallel degree (``check_parallel``)."""
    if value % size:
        raise ValueError(f"{field}={value} is not divisible by {degree}={size}{why}")


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError):
            raise CheckpointError(f"{index} is not a JSON object") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} field weight_map must map tensor names to file "
                                  "names")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights (pickle checkpoints are not loaded)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in the index but missing")
    return files


def iter_weights(path):
    """(name, tensor) for every tensor of the checkpoint's safetensors files."""
    for f in safetensors_files(path):
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{f} is not a readable safetensors file: {exc}") from None
        with handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_weights(module: torch.nn.Module, weights, stacked=(), skip=(), locate=None) -> None:
    """Copy checkpoint tensors into ``module``'s (sharded) parameters.

    ``stacked``: (fused_param_part, checkpoint_part, shard_id) triples, e.g.
    ("qkv_proj", "q_proj", "q"), for parameters that fuse several checkpoint tensors.
    ``skip``: checkpoint name prefixes/suffixes to ignore (such as a tied lm_head).
    ``locate``: checkpoint name -> the name it loads as (None: not on this rank), e.g. a
    pipeline stage's renumbered layers; errors name the checkpoint's tensor.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    expected = {n for n, p in module.named_parameters()}
    shards_needed: dict[str, set] = {}
    for fused, part, shard in stacked:
        for n in params:
            if f".{fused}." in f".{n}.":
                shards_needed.setdefault(n, set()).add(shard)
    loaded: dict[str, set] = {}
    for name, tensor in weights:
        if any(name.startswith(s) or name.endswith(s) for s in skip):
            continue
        local = name if locate is None else locate(name)
        if local is None:
            continue
        target, shard = local, None
        for fused, part, shard_id in stacked:
            if f".{part}." in f".{local}.":
                target, shard = f".{local}.".replace(f".{part}.", f".{fused}.")[1:-1], shard_id
                break
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"checkpoint tensor {name} matches no model parameter")
        if param.is_floating_point() and not tensor.is_floating_point():
            raise CheckpointError(f"checkpoint tensor {name} has dtype {tensor.dtype}; parameter "
                                  f"{target} needs a floating-point tensor")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"checkpoint tensor {name} holds non-finite values (NaN or "
                                  "Inf)")
        loader = getattr(param, "weight_loader", None)
        try:
            with torch.no_grad():
                if loader is None:
                    if param.shape != tensor.shape:
                        raise RuntimeError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                    param.data.copy_(tensor)
                elif shard is None:
                    loader(param, tensor.to(param.dtype))
                else:
                    loader(param, tensor.to(param.dtype), shard)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint tensor {name} (shape {tuple(tensor.shape)}) does not fit parameter "
                f"{target} (local shape {tuple(param.shape)}): {exc}") from None
        loaded.setdefault(target, set()).add(shard)
    missing = sorted(n for n in expected if n not in loaded)
    partial = sorted(n for n, need in shards_needed.items()
                     if n in loaded and not need <= loaded[n])
    if missing or partial:
        raise CheckpointError(f"checkpoint lacks tensors for parameters {missing + partial}")
