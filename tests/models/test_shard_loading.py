"""A rank reads only its shard of the checkpoint: the bytes it reads (counted through the
safetensors slices) are at most 1.1x what it keeps, at tp 4, with attention DP and expert
parallelism, for a dense model, a MoE and an MLA model, and the loaded model still equals
world 1's (the parity tests run on the same loader)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_qwen3_moe
from distributed.pool import get_pool
from ds_checkpoints import hf_deepseek_v3

from layer_boundary.models import load_model
from layer_boundary.engine.runner import make_runtime, RunSpec
from layer_boundary.runtime.shards import ReadBytes


def load_rank(model_dir: str, tp: int, dp: int, ep: int) -> dict:
    read = ReadBytes()
    spec = RunSpec(model_dir, tp=tp, dp=dp, ep=ep)
    model = load_model(model_dir, make_runtime(spec), read=read)
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"read": read.bytes, "kept": kept}


@pytest.fixture(scope="module")
def dirs(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    return {"qwen3": str(qwen3_dir), "qwen3_moe": str(hf_qwen3_moe(root / "qwen3_moe")),
            "deepseek_v3": str(hf_deepseek_v3(root / "deepseek_v3"))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,tp,dp,ep", [("qwen3", 4, 1, 1), ("qwen3", 4, 2, 1),
                                            ("qwen3_moe", 4, 2, 4), ("deepseek_v3", 4, 1, 2)])
def test_a_rank_reads_its_shard(dirs, model, tp, dp, ep):
    whole = load_rank(dirs[model], 1, 1, 1)
    assert whole["read"] >= 0.99 * whole["kept"]  # world 1 reads (nearly) all it keeps
    for rank, r in enumerate(get_pool(tp).run(load_rank, dirs[model], tp, dp, ep)):
        # its shard plus the replicated tensors: what it keeps (padding rows aside)
        assert r["read"] <= 1.1 * r["kept"], (rank, r)
        assert r["read"] < 0.6 * whole["read"], (rank, r, whole)  # not the whole checkpoint
