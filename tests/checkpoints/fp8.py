"""FP8 block-quantized checkpoints made from the tiny random ones, as the public FP8 releases
store them: each linear's ``weight`` in float8_e4m3fn with a float32 ``weight_scale_inv`` per
[out, in] block, ``quantization_config`` in config.json; embeddings, norms, the LM head and
routers left unquantized. The oracles are transformers on the dequantized weights, with the
stage inputs as they are (``dequantized_oracle``) or fake-quantized as the package's rule says
(``fake_quantized_oracle``)."""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
# the linears a public FP8 release quantizes (2-d weights): everything but these
_KEEP = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.|e_score_correction_bias)")


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv [ceil(out/bo), ceil(in/bi)]): scale = amax / 448."""
    bo, bi = block
    out, inp = w.shape
    rows, cols = math.ceil(out / bo), math.ceil(inp / bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:out, :inp] = w.float()
    blocks = padded.view(rows, bo, cols, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.finfo(FP8).max, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).to(FP8).view(rows * bo, cols * bi)[:out, :inp]
    return q.contiguous(), scale


def fp8_checkpoint(src: Path, dst: Path, block=(16, 16), skip: tuple = ()) -> Path:
    """``src`` (an HF checkpoint) with its linears block-quantized into ``dst``; ``skip``:
    ``modules_to_not_convert`` (kept unquantized too)."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if (w.dim() == 2 and name.endswith(".weight") and not _KEEP.search(name)
                    and not any(s in name for s in skip)):
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(w, block)
            else:
                tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": list(block),
                                  "modules_to_not_convert": ["lm_head", *skip]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in ("generation_config.json",):
        if (Path(src) / extra).is_file():
            shutil.copy(Path(src) / extra, dst / extra)
    return dst


def dequantized_oracle(model_class: str, src: Path, fp8_dir: Path):
    """transformers' ``model_class`` on ``src``'s config with every weight its FP8 checkpoint's
    dequantized value (fp32, eager attention and experts). The dequantized tensors are written
    as a checkpoint and loaded by transformers itself: it fuses the per-expert tensors on disk
    into its experts' parameters, which share no name with them."""
    from layer_boundary.models.loader import dequantized, iter_weights

    from . import hf_oracle

    block = tuple(json.loads((Path(fp8_dir) / "config.json").read_text())
                  ["quantization_config"]["weight_block_size"])
    with tempfile.TemporaryDirectory() as tmp:
        save_file({name: w.contiguous() for name, w in dequantized(iter_weights(fp8_dir), block)},
                  str(Path(tmp) / "model.safetensors"))
        shutil.copy(Path(src) / "config.json", tmp)
        return hf_oracle(model_class, Path(tmp))


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """Dynamic FP8 quantize-dequantize of ``x`` [..., H] per token and per ``group`` channels
    (the last group partial), scale = amax / 448 (1 for a zero group): written here from the
    format, not taken from the package, so the oracle shares no code with what it checks."""
    shape, width = x.shape, x.shape[-1]
    groups = math.ceil(width / group)
    padded = torch.zeros(x.numel() // width, groups * group)
    padded[:, :width] = x.reshape(-1, width).float()
    g = padded.view(-1, groups, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.finfo(FP8).max, torch.ones_like(amax))
    q = (g / scale).clamp(-448, 448).to(FP8).float() * scale
    return q.view(-1, groups * group)[:, :width].reshape(shape).to(x.dtype)


def fp8_modules(fp8_dir: Path) -> set[str]:
    """The modules whose weight the checkpoint stores in FP8 (those with block scales)."""
    names = set()
    for f in Path(fp8_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            names |= {n.removesuffix(".weight_scale_inv") for n in handle.keys()
                      if n.endswith(".weight_scale_inv")}
    return names


def fake_quantized_oracle(model_class: str, src: Path, fp8_dir: Path):
    """``dequantized_oracle`` whose stages read their normalized input as the package's rule
    says (docs/features.md, FP8): where every linear consuming it is FP8, those linears read
    it fake-quantized in groups of the weights' input block; the MoE router reads it as is.
    Forward pre-hooks on transformers' attention, dense MLP, routed and shared experts."""
    ref = dequantized_oracle(model_class, src, fp8_dir)
    group = json.loads((Path(fp8_dir) / "config.json").read_text()
                       )["quantization_config"]["weight_block_size"][1]
    fp8 = fp8_modules(fp8_dir)

    def quantized(module, args, kwargs):
        if args:
            return (fake_quantize(args[0], group), *args[1:]), kwargs
        return args, dict(kwargs, hidden_states=fake_quantize(kwargs["hidden_states"], group))

    for i, layer in enumerate(ref.model.layers):
        prefix, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        readers = {attn: [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "q_a_proj",
                                                     "kv_a_proj_with_mqa")
                          if getattr(attn, n, None) is not None]}
        if hasattr(mlp, "experts"):  # routed and shared experts, not the router
            experts = [f"mlp.experts.{e}.{p}" for e in range(mlp.experts.num_experts)
                       for p in ("gate_proj", "up_proj")]
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:
                experts += ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]
            readers.update({m: experts for m in (mlp.experts, shared) if m is not None})
        else:
            readers[mlp] = ["mlp.gate_proj", "mlp.up_proj"]
        for module, names in readers.items():
            if all(prefix + n in fp8 for n in names):
                module.register_forward_pre_hook(quantized, with_kwargs=True)
    return ref
