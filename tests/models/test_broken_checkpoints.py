"""Broken checkpoints, for every architecture: a tensor larger than its config implies (whose
shard could still be sliced out of it), an integer or non-finite weight, a wrong LM head.
Each is refused at load with an error naming the checkpoint tensor; nothing loads a wrong
number."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from checkpoints import hf_qwen3, hf_qwen3_moe
from checkpoints.ds import hf_deepseek_v3
from checkpoints.ds4 import hf_deepseek_v4
from checkpoints.lc import hf_longcat_flash
from checkpoints.nh import hf_nemotron_h
from oracle import world1
from safetensors.torch import load_file, save_file

from layer_boundary.models import load_model
from layer_boundary.models.loader import CheckpointError

WRITERS = {"qwen3": hf_qwen3, "qwen3_moe": hf_qwen3_moe, "deepseek_v3": hf_deepseek_v3,
           "deepseek_v4": hf_deepseek_v4, "nemotron_h": hf_nemotron_h,
           "longcat_flash": hf_longcat_flash}

# a sharded projection of each architecture (rows split over TP, or an expert's rows)
GROW = re.compile(r"(mlp\.gate_proj|mlps\.0\.gate_proj|experts\.0\.gate_proj|experts\.0\.up_proj"
                  r"|self_attn\.q_proj|q_b_proj|mixer\.in_proj|mixer\.up_proj|ffn\.experts\.0\.w1)"
                  r"\.weight$")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {name: write(root / name) for name, write in WRITERS.items()}


def broken(src, dst, change) -> tuple[str, str]:
    """A copy of ``src`` with one tensor changed; (path, the changed tensor's name)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return str(dst), name


def grow(tensors):
    name = next(n for n in sorted(tensors) if GROW.search(n))
    tensors[name] = torch.cat([tensors[name]] * 2)
    return name


def widen_head(tensors):
    name = "lm_head.weight" if "lm_head.weight" in tensors else "head.weight"  # DeepSeek-V4
    tensors[name] = torch.cat([tensors[name], tensors[name][:, :1]], dim=1)
    return name


def integer(tensors):
    name = next(n for n in sorted(tensors) if GROW.search(n))
    tensors[name] = tensors[name].to(torch.int32)
    return name


def non_finite(tensors):
    name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name][0] = float("nan")
    return name


@pytest.mark.parametrize("change", [grow, widen_head, integer, non_finite],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("model", list(WRITERS))
def test_a_broken_tensor_is_refused_by_name(pristine, tmp_path, model, change):
    path, name = broken(pristine[model], tmp_path / "ckpt", change)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_model(path, world1())
