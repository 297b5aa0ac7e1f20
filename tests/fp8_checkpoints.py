"""FP8 block-quantized checkpoints made from the tiny random ones, as the public FP8 releases
store them: each linear's ``weight`` in float8_e4m3fn with a float32 ``weight_scale_inv`` per
[out, in] block, ``quantization_config`` in config.json; embeddings, norms, the LM head and
routers left unquantized. The oracle is transformers on the dequantized weights."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
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
    """transformers' ``model_class`` from ``src`` with every weight replaced by its FP8
    checkpoint's dequantized value (fp32, eager attention and experts)."""
    from checkpoints import hf_oracle

    from layer_boundary.models.loader import dequantized, iter_weights

    ref = hf_oracle(model_class, src)
    block = tuple(json.loads((Path(fp8_dir) / "config.json").read_text())
                  ["quantization_config"]["weight_block_size"])
    weights = dict(dequantized(iter_weights(fp8_dir), block))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in weights:
                p.copy_(weights[name].to(p.dtype))
    return ref
