"""Hugging Face checkpoints (config.json + safetensors, never pickle) into sharded modules."""

from __future__ import annotations

import torch

# the files and their headers are read in the runtime (adapters read them too); config.json
# lives in config.py; these names stay importable from here
from ..runtime.quant import FP8, check_block_scales, check_scale_dtype, dequantize_blocks
from ..runtime.safetensors_files import (header_facts, open_file,  # noqa: F401
                                         safetensors_files)
from ..runtime.shards import (CheckpointSlice, ReadBytes, TensorFile, columns_read_together,
                              whole)
from .config import (CheckpointError, check_divisible, check_unquantized_silu,  # noqa: F401
                     read_config, require)


def iter_weights(path, lazy: bool = False, read: ReadBytes | None = None):
    """(name, tensor) for every tensor of the checkpoint's safetensors files.

    Args:
        path: the checkpoint folder.
        lazy: yield ``CheckpointSlice``s (header facts, data read on demand, only the block a
            loader takes) instead of whole tensors; each is valid until the next item.
        read: counts the bytes the slices read.
    """
    for f in safetensors_files(path):
        with open_file(f) as handle:  # safetensors validates the header (and reads whole tensors)
            if not lazy:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
                continue
            names = list(handle.keys())
        # slices read through positioned reads, not the map (shards.py says why)
        file = TensorFile(f)  # closes when the last slice of it is dropped
        for name in names:
            yield name, CheckpointSlice(name, file, read)
        del file


_SCALE = "_scale_inv"  # ``X.weight_scale_inv`` is ``X.weight``'s block scales


def dequantized(weights, block: tuple[int, int] | None):
    """(name, tensor) of ``weights`` with each FP8 ``X.weight`` and its ``X.weight_scale_inv``
    replaced by the float32 weight (``block``: the checkpoint's [out, in] weight blocks; None:
    an unquantized checkpoint, where an FP8 tensor is an error). Tensors pair up in any order
    across files; one left without its partner is an error naming it."""
    weights_, scales = {}, {}
    for name, tensor in weights:
        if name.endswith(_SCALE) or tensor.dtype == FP8:
            tensor = whole(tensor)  # FP8 blocks are dequantized whole (and kept past the file)
        if name.endswith(_SCALE):
            base = name[:-len(_SCALE)]
            if block is None:
                raise CheckpointError(f"checkpoint tensor {name} holds FP8 block scales, and "
                                      "config.json has no quantization_config (quant_method "
                                      "fp8)")
            if base in weights_:
                yield base, _dequantize(weights_.pop(base), tensor, block, base)
            else:
                scales[base] = tensor
        elif tensor.dtype == FP8:
            if block is None:
                raise CheckpointError(f"checkpoint tensor {name} has dtype float8_e4m3fn, and "
                                      "config.json has no quantization_config (quant_method "
                                      "fp8)")
            if name in scales:
                yield name, _dequantize(tensor, scales.pop(name), block, name)
            else:
                weights_[name] = tensor
        else:
            yield name, tensor
    if weights_:
        raise CheckpointError(f"checkpoint tensor {sorted(weights_)[0]} is FP8 and has no "
                              f"{sorted(weights_)[0]}{_SCALE}")
    if scales:
        raise CheckpointError(f"checkpoint tensor {sorted(scales)[0]}{_SCALE} scales no FP8 "
                              f"tensor {sorted(scales)[0]}")


def check_fp8_tensors(path, block: tuple[int, int] | None, skip: tuple = ()) -> None:
    """What ``dequantized()`` would refuse, from the safetensors headers alone (shapes and
    dtypes, no tensor data): run before any rank loads. ``skip``: quantization_config's
    modules_to_not_convert, which must hold no FP8 tensor (transformers builds those modules
    unquantized and would read the FP8 bytes without their scales)."""
    facts = header_facts(path)
    shapes = {name: shape for name, (shape, _) in facts.items()}
    fp8 = {name for name, (_, dtype) in facts.items() if dtype == "F8_E4M3"}
    for name in sorted(fp8):
        listed = next((s for s in skip if s in name), None)
        if listed is not None:
            raise CheckpointError(f"checkpoint tensor {name} is FP8, and config.json "
                                  "quantization_config modules_to_not_convert lists "
                                  f"{listed!r}, which leaves its module unquantized")
    scales = {n[:-len(_SCALE)] for n in shapes if n.endswith(_SCALE)}
    for name in sorted(fp8 | {s + _SCALE for s in scales}):
        if block is None:
            what = ("has dtype float8_e4m3fn" if name in fp8 else "holds FP8 block scales")
            raise CheckpointError(f"checkpoint tensor {name} {what}, and config.json has no "
                                  "quantization_config (quant_method fp8)")
    for name in sorted(fp8 - scales):
        raise CheckpointError(f"checkpoint tensor {name} is FP8 and has no {name}{_SCALE}")
    for base in sorted(scales):
        if base not in fp8:
            raise CheckpointError(f"checkpoint tensor {base}{_SCALE} scales no FP8 tensor {base}")
        module = base[:-len(".weight")] if base.endswith(".weight") else base
        try:
            check_scale_dtype(facts[base + _SCALE][1], module)
            check_block_scales(shapes[base], shapes[base + _SCALE], block, module)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint tensor {exc}") from None


def _dequantize(weight, scale_inv, block, name: str) -> torch.Tensor:
    if weight.dim() != 2:
        raise CheckpointError(f"checkpoint tensor {name} is FP8 with shape "
                              f"{list(weight.shape)}; block-quantized weights are 2-d")
    try:
        out = dequantize_blocks(weight, scale_inv, block, name[:-len(".weight")]
                                if name.endswith(".weight") else name)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint tensor {exc}") from None
    if not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"checkpoint tensor {name} holds non-finite values once its "
                              "block scales are applied")
    return out


def load_weights(module: torch.nn.Module, weights, stacked=(), skip=(), locate=None,
                 complete: bool = True) -> None:
    """Copy checkpoint tensors into ``module``'s (sharded) parameters.

    ``stacked``: (fused_param_part, checkpoint_part, shard_id) triples, e.g.
    ("qkv_proj", "q_proj", "q"), for parameters that fuse several checkpoint tensors.
    ``skip``: checkpoint name prefixes/suffixes to ignore (such as a tied lm_head).
    ``locate``: checkpoint name -> the name it loads as (None: not on this rank), e.g. a
    pipeline stage's renumbered layers; errors name the checkpoint's tensor.
    ``complete``: every parameter must have been loaded (False: ``weights`` rewrite some of
    an already loaded module, as an adapter's base-model tensors do).
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    expected = {n for n, p in module.named_parameters()}
    shards_needed: dict[str, set] = {}
    for fused, _part, shard in stacked:
        for n in params:
            if f".{fused}." in f".{n}.":
                shards_needed.setdefault(n, set()).add(shard)
    loaded: dict[str, set] = {}
    # the row-parallel weights' column reads: one exchange per group for the whole walk
    with columns_read_together():
        for name, tensor in weights:
            landed = _load_tensor(params, name, tensor, stacked, skip, locate)
            if landed is not None:
                loaded.setdefault(landed[0], set()).add(landed[1])
    if not complete:
        return
    missing = sorted(n for n in expected if n not in loaded)
    partial = sorted(n for n, need in shards_needed.items()
                     if n in loaded and not need <= loaded[n])
    if missing or partial:
        raise CheckpointError(f"checkpoint lacks tensors for parameters {missing + partial}")


def _load_tensor(params: dict, name: str, tensor, stacked, skip, locate):
    """Checkpoint tensor ``name`` into its parameter (``load_weights``' arguments): the
    (parameter, shard) it went to, None where this rank skips it."""
    if any(name.startswith(s) or name.endswith(s) for s in skip):
        return None
    local = name if locate is None else locate(name)
    if local is None:
        return None
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
    if tensor.dtype == FP8:  # a reader that skipped dequantized()
        raise CheckpointError(f"checkpoint tensor {name} is FP8: load it through "
                              "loader.dequantized() with the checkpoint's weight blocks")
    if (not isinstance(tensor, CheckpointSlice) and tensor.is_floating_point()
            and not bool(torch.isfinite(tensor).all())):  # a slice checks what it reads
        raise CheckpointError(f"checkpoint tensor {name} holds non-finite values (NaN or "
                              "Inf)")
    loader = getattr(param, "weight_loader", None)
    if loader is None or not getattr(loader, "reads_slices", False):
        tensor = whole(tensor)  # a loader that takes whole tensors
    try:
        with torch.no_grad():
            if loader is None:
                if param.shape != tensor.shape:
                    raise RuntimeError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor if isinstance(tensor, CheckpointSlice)
                       else tensor.to(param.dtype))
            else:
                loader(param, tensor if isinstance(tensor, CheckpointSlice)
                       else tensor.to(param.dtype), shard)
    except CheckpointError:
        raise  # a read that names its tensor already (a non-finite block)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint tensor {name} (shape {tuple(tensor.shape)}) does not fit parameter "
            f"{target} (local shape {tuple(param.shape)}): {exc}") from None
    return target, shard
